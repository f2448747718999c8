"""A checkpoint counts only when it is whole, and a save cut short never poisons a resume
(eyrie/stages/train/checkpoints.py).

The unit tests build checkpoint folders as speculators 0.9.0 lays them out; the last test kills the real trainer
between a save's weights and its training state, then resumes and ends with the step count of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import build_tiny_target, config_dict, synthetic_training_inputs

from eyrie.config import parse_config
from eyrie.errors import EyrieError
from eyrie.stages.train.checkpoints import (
    completion_link,
    is_whole,
    newest_whole_checkpoint,
    recover,
    set_aside_previous,
)
from eyrie.stages.train.trainer import run_training, steps_per_epoch


def save(save_path: Path, epoch: int, local_step: int, global_step: int, *, cut_after_weights: bool = False) -> Path:
    """Write a checkpoint in speculators' order; `cut_after_weights` stops after the weights, as a kill would."""
    folder = save_path / str(epoch)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights %d" % global_step)
    if cut_after_weights:
        return folder
    (folder / "optimizer_state_dict.pt").write_bytes(b"optimizer %d" % global_step)
    state = {"epoch": epoch, "local_step": local_step, "global_step": global_step}
    (folder / "training_state.json").write_text(json.dumps(state))
    for old in save_path.glob(f"epoch{epoch}_*"):
        old.unlink()
    completion_link(save_path, epoch, local_step).symlink_to(str(epoch))
    return folder


def age(folder: Path, seconds: float) -> None:
    for p in folder.iterdir():
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


def test_whole_checkpoints_count_and_cut_ones_do_not(tmp_path):
    ckpts = tmp_path / "checkpoints"
    first = save(ckpts, 0, 0, 10)
    assert is_whole(first) and newest_whole_checkpoint(ckpts) == first

    second = save(ckpts, 1, 4, 14)
    age(second, 5)
    (second / "model.safetensors").write_bytes(b"weights of a later step")  # newer than its training state
    assert not is_whole(second)
    assert newest_whole_checkpoint(ckpts) == first

    third = save(ckpts, 2, 0, 20)
    (ckpts / "epoch2_end").unlink()  # killed before the completion link
    assert not is_whole(third)

    fourth = save(ckpts, 3, 0, 30)
    (fourth / "training_state.json").write_text(json.dumps({"epoch": 2, "local_step": 0, "global_step": 30}))
    assert not is_whole(fourth)  # a state that names another epoch vouches for nothing here


def test_recover_sets_a_cut_save_aside_and_restores_the_checkpoint_it_replaced(tmp_path):
    ckpts = tmp_path / "checkpoints"
    save(ckpts, 0, 0, 10)
    mid = save(ckpts, 1, 4, 14)
    age(mid, 5)
    set_aside_previous(mid)  # what the next save of epoch 1 does first (eyrie/stages/train/entry.py)
    save(ckpts, 1, 8, 18, cut_after_weights=True)

    notes = recover(ckpts)

    assert len(notes) == 2, notes
    assert (ckpts / "1.incomplete" / "model.safetensors").read_bytes() == b"weights 18"
    restored = ckpts / "1"
    assert is_whole(restored) and newest_whole_checkpoint(ckpts) == restored
    assert (restored / "model.safetensors").read_bytes() == b"weights 14"
    assert not (ckpts / "1.previous").exists()
    assert recover(ckpts) == []  # nothing left to mend


def test_recover_without_a_previous_copy_falls_back_to_the_last_whole_epoch(tmp_path):
    ckpts = tmp_path / "checkpoints"
    first = save(ckpts, 0, 0, 10)
    save(ckpts, 1, 4, 14, cut_after_weights=True)  # the first save of epoch 1, cut
    recover(ckpts)
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir() and not p.is_symlink()) == ["0", "1.incomplete"]
    assert newest_whole_checkpoint(ckpts) == first


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_kill_between_weights_and_state_resumes_to_the_uninterrupted_step_count(tmp_path, monkeypatch):
    target = build_tiny_target("tiny-llama")
    data = config_dict(target, max_samples=40, shard_size=40, max_length=96, layer_ids=[2, 4, 5])
    data["train"] = {"epochs": 2, "max_seq_len": 96, "save_every_steps": 5}
    config = parse_config(data)
    _, inputs, seq_lens = synthetic_training_inputs(config, tmp_path)

    whole_run = run_training(config, tmp_path / "uninterrupted", "k", inputs, seq_lens, log=print)
    steps = whole_run["global_step"]
    # Where speculators saves mid-epoch: every `interval` steps of the epoch (checkpoint_freq as run_training sets
    # it, rounded over the loader's real length, which epoch 0's end-of-epoch global step gives).
    epoch_steps = whole_run["history"][0]["global_step"]
    interval = max(1, round(epoch_steps * 5 / steps_per_epoch(seq_lens, 96, 0.9)))
    # The second save of epoch 0 overwrites the first, whole one, in place: cut it between weights and state.
    cut_at = 2 * interval
    assert epoch_steps - cut_at >= interval / 4, f"epoch 0 has too few steps ({epoch_steps}) for two saves"
    monkeypatch.setenv("EYRIE_FAULTS", f"train.before-state.step{cut_at}=kill")
    with pytest.raises(EyrieError, match="exited with code -9"):
        run_training(config, tmp_path / "cut", "k", inputs, seq_lens, log=print)
    cut = tmp_path / "cut" / "k" / "checkpoints"
    cut_folder = next(p for p in cut.iterdir() if p.is_dir() and p.name.isdigit() and not is_whole(p))
    assert (cut_folder / "model.safetensors").exists()  # weights written, state not: the save was cut

    monkeypatch.delenv("EYRIE_FAULTS")
    notes: list[str] = []
    resumed = run_training(config, tmp_path / "cut", "k", inputs, seq_lens, log=notes.append)
    assert any("moved aside" in n for n in notes), notes
    assert any("restored checkpoint" in n for n in notes), notes  # the whole save the cut one was replacing
    assert resumed["global_step"] == steps
    assert [h["epoch"] for h in resumed["history"]] == [h["epoch"] for h in whole_run["history"]]


def test_a_save_is_on_disk_before_the_previous_copy_is_deleted(tmp_path, monkeypatch):
    """settle_save deletes the whole copy a save replaced: every file of the new save, its folder and the folder
    holding its link are fsynced before that (a power loss after the delete would otherwise leave only a new save
    whose bytes may never have reached the disk)."""
    import shutil

    import eyrie.stages.train.checkpoints as checkpoints

    ckpts = tmp_path / "checkpoints"
    mid = save(ckpts, 1, 4, 14)
    age(mid, 5)
    set_aside_previous(mid)
    new = save(ckpts, 1, 8, 18)
    events: list[tuple[str, str]] = []
    real_fsync, real_rmtree = os.fsync, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rmtree(path, *a, **kw):
        events.append(("rmtree", str(path)))
        real_rmtree(path, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(checkpoints.shutil, "rmtree", rmtree)
    checkpoints.settle_save(new)

    assert not (ckpts / "1.previous").exists()
    deleted = events.index(("rmtree", str(ckpts / "1.previous")))
    synced = {path for what, path in events[:deleted] if what == "fsync"}
    assert {str(p) for p in new.iterdir()} | {str(new), str(ckpts)} <= synced, events
