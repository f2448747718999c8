"""A kill at any point of checkpoint `recover` keeps the only whole checkpoint, and a promotion's copy and link swap
reach the disk before they are relied on (eyrie/stages/train/checkpoints.py, eyrie/stages/promote.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eyrie.run import files
from eyrie.stages import promote as promote_module
from eyrie.stages.train import checkpoints
from eyrie.stages.train.checkpoints import completion_link, newest_whole_checkpoint, recover, set_aside_previous


class Killed(BaseException):
    """What a SIGKILL leaves: nothing after the step it interrupted ran."""


def _save(save_path: Path, epoch: int, local_step: int, global_step: int, *, cut: bool = False) -> Path:
    """A checkpoint in speculators 0.9.0's order (tests/integration/test_checkpoints.py); `cut` stops after the
    weights, as a kill would."""
    folder = save_path / str(epoch)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights %d" % global_step)
    if cut:
        return folder
    (folder / "optimizer_state_dict.pt").write_bytes(b"optimizer %d" % global_step)
    (folder / "training_state.json").write_text(
        json.dumps({"epoch": epoch, "local_step": local_step, "global_step": global_step})
    )
    for old in save_path.glob(f"epoch{epoch}_*"):
        old.unlink()
    completion_link(save_path, epoch, local_step).symlink_to(str(epoch))
    return folder


def _only_checkpoint_cut_again(ckpts: Path) -> None:
    """Epoch 0's one whole save (step 4) set aside by its next save, which was cut: the only whole copy is
    `0.previous`."""
    whole = _save(ckpts, 0, 4, 4)
    past = os.stat(whole / "training_state.json").st_mtime_ns - 5_000_000_000
    for p in whole.iterdir():
        os.utime(p, ns=(past, past))
    set_aside_previous(whole)
    _save(ckpts, 0, 8, 8, cut=True)


def _mutations(monkeypatch, kill_after: int) -> None:
    """Every rename, link and unlink `recover` makes counted; the `kill_after`-th one completes, then the process
    dies."""
    done = [0]

    def counted(real):
        def step(*args, **kwargs):
            out = real(*args, **kwargs)
            done[0] += 1
            if done[0] == kill_after:
                raise Killed
            return out

        return step

    monkeypatch.setattr(checkpoints.os, "replace", counted(os.replace))
    monkeypatch.setattr(os, "symlink", counted(os.symlink))
    monkeypatch.setattr(Path, "unlink", counted(Path.unlink))


@pytest.mark.parametrize("kill_after", [1, 2, 3, 4])
def test_a_kill_anywhere_in_recover_keeps_the_only_whole_checkpoint(tmp_path, monkeypatch, kill_after):
    """Restoring `N.previous` renamed the folder back first and linked it after: a kill between the two left `N/`
    whole but unlinked, and the next recover set it aside as a cut save, with no other whole checkpoint left."""
    ckpts = tmp_path / "checkpoints"
    _only_checkpoint_cut_again(ckpts)
    with monkeypatch.context() as m:
        _mutations(m, kill_after)
        try:
            recover(ckpts)
        except Killed:
            pass
    recover(ckpts)  # the next run
    restored = newest_whole_checkpoint(ckpts)
    assert restored == ckpts / "0", sorted(p.name for p in ckpts.iterdir())
    assert (restored / "model.safetensors").read_bytes() == b"weights 4"
    assert recover(ckpts) == []


def test_a_promotion_is_on_disk_before_its_name_and_its_link_say_so(tmp_path, monkeypatch):
    """The copy's files and folders are fsynced before the rename that names the version, the version's folder
    after it, and the promotion folder after the link swap."""
    drafter = tmp_path / "drafter"
    (drafter / "sub").mkdir(parents=True)
    (drafter / "model.safetensors").write_bytes(b"w" * 64)
    (drafter / "sub" / "config.json").write_text("{}")
    promo = tmp_path / "promo"
    promo.mkdir()
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = files.fsync_path, os.replace

    def fsync(path):
        events.append(("fsync", str(Path(path).relative_to(tmp_path))))
        real_fsync(path)

    def replace(src, dst):
        events.append(("rename", str(Path(dst).relative_to(tmp_path))))
        real_replace(src, dst)

    monkeypatch.setattr(files, "fsync_path", fsync)
    monkeypatch.setattr(promote_module, "fsync_path", fsync, raising=False)
    monkeypatch.setattr(promote_module.os, "replace", replace)

    dest = promote_module.promote(promo, drafter, "v1", {"why": "test"})

    assert dest == promo / "versions" / "v1" and (promo / "current" / "sub" / "config.json").read_text() == "{}"
    named = events.index(("rename", "promo/versions/v1"))
    staged = {p for kind, p in events[:named] if kind == "fsync"}
    for rel in ("model.safetensors", "sub/config.json", "sub", ""):
        assert str(Path("promo/versions/.v1.staging", rel)) in staged, events
    swapped = events.index(("rename", "promo/current"))
    assert ("fsync", "promo/versions") in events[named:swapped], events
    assert ("fsync", "promo") in events[swapped:], events
