"""`eyrie verify` (a full re-hash of what the manifests list, removing what is damaged so the next run redoes it),
`eyrie status` checking the listed files by stat, and `remove_staging` leaving the hidden-state folder unwalked.
Fake extraction (tests/unit/test_extract_unit.py's client); no vLLM, no Prefect."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from test_extract_unit import HIDDEN, LAYERS, FakeClient, prepared  # noqa: F401 (prepared: a fixture)

from eyrie.ops.status import format_status, run_status
from eyrie.ops.verify import verify_run
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.folder import RunFolder, remove_staging, sample_path
from eyrie.run.manifest import list_files
from eyrie.stages.extract.manifest import shard_complete
from eyrie.stages.extract.shard import extract_shard
from eyrie.stages.prepare import load_shards
from flows.cli import main


def _extract(run: RunFolder, prepared_dir: Path, client: FakeClient) -> dict[str, str]:
    """Every shard of the prepared data into the run folder, as the flow does; returns shard name -> key."""
    keys = {}
    for shard in load_shards(run.prepare):
        keys[shard.name] = f"key-{shard.name}"
        extract_shard(
            client,
            prepared_dir,
            shard,
            keys[shard.name],
            run.hidden_states,
            run.shard_manifests / f"{shard.name}.json",
            LAYERS,
            HIDDEN,
            concurrency=3,
            log=lambda *_: None,
        )
    return keys


@pytest.fixture
def run(prepared, tmp_path) -> RunFolder:  # noqa: F811
    """A run folder with two extracted shards (12 files) and a vocab stage whose manifest lists two files."""
    run = RunFolder(tmp_path / "run")
    run.ensure()
    run.prepare.mkdir()
    shutil.copy(prepared / "shards.json", run.prepare / "shards.json")
    run.keys = _extract(run, prepared, FakeClient(run.extract / "staging"))  # type: ignore[attr-defined]
    run.vocab.mkdir()
    for name in ("d2t-8.npy", "t2d-8.npy"):
        (run.vocab / name).write_bytes(name.encode() * 100)
    files = list_files(run.vocab, [run.vocab / name for name in ("d2t-8.npy", "t2d-8.npy")])
    atomic_write_json(run.manifest("vocab"), {"stage": "vocab", "key": "v", "files": files})
    return run


def _rot(path: Path) -> None:
    """Bit rot: one byte changed in place, size, mtime and inode as they were, so no stat check can see it."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    with open(path, "r+b") as f:
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
    )


def test_verify_intact_run(run, capsys):
    assert main(["verify", "--run-dir", str(run.root), "--workers", "3"]) == 0
    out = capsys.readouterr().out
    assert "verified 14 files" in out and "2 shard and 1 stage manifests" in out and "3 workers" in out
    assert "every file matches its manifest" in out and "GiB/s" in out


def test_verify_finds_rot_removes_it_and_the_next_run_redoes_only_it(run, prepared, tmp_path, capsys):  # noqa: F811
    shard = load_shards(run.prepare)[1]
    victim = sample_path(run.hidden_states, shard.start + 2)
    manifest = run.shard_manifests / f"{shard.name}.json"
    _rot(victim)
    assert shard_complete(manifest, run.keys[shard.name], run.hidden_states)  # a run's stat check cannot see it

    assert main(["verify", "--run-dir", str(run.root), "--report-only"]) == 1
    out = capsys.readouterr().out
    assert f"extract/hidden_states/{victim.name} ({shard.name}): content differs from its manifest" in out
    assert "nothing was changed: --report-only" in out and victim.exists()

    assert main(["verify", "--run-dir", str(run.root)]) == 1
    out = capsys.readouterr().out
    assert victim.name in out and "removed 1 damaged hidden-state file(s)" in out and not victim.exists()
    status = run_status(run)
    assert status["shards"][shard.name].startswith(
        f"damaged: 1 of 6 listed files missing or of another size ({victim.name} missing)"
    )
    assert status["stages"]["extract"] == "1/2 shards (1 damaged)"
    assert not shard_complete(manifest, run.keys[shard.name], run.hidden_states)

    client = FakeClient(run.extract / "staging")
    _extract(run, prepared, client)  # the next run: only the removed sample goes to the server
    assert len(client.sent) == 1
    assert main(["verify", "--run-dir", str(run.root)]) == 0
    assert run_status(run)["stages"]["extract"] == "done"


def test_verify_damaged_stage_file_removes_the_stage_manifest(run, capsys):
    _rot(run.vocab / "t2d-8.npy")
    (run.vocab / "d2t-8.npy").unlink()
    assert run_status(run)["stages"]["vocab"].startswith("damaged: d2t-8.npy missing")
    assert main(["verify", "--run-dir", str(run.root)]) == 1
    out = capsys.readouterr().out
    assert "vocab/d2t-8.npy (vocab): missing" in out and "vocab/t2d-8.npy (vocab): content differs" in out
    assert "removed vocab/manifest.json: the next `eyrie run` redoes the vocab stage" in out
    assert not run.manifest("vocab").exists() and run_status(run)["stages"]["vocab"] == "not started"


def test_verify_changes_nothing_while_a_run_holds_the_folder(run):
    victim = sample_path(run.hidden_states, 0)
    _rot(victim)
    with run.lock():
        report = verify_run(run.root, progress=False)
    assert not report.ok and victim.exists()
    assert "is in use by pid" in report.summary() and "Run `eyrie verify` again" in report.summary()


def test_verify_skips_shard_manifests_of_an_earlier_prepare(run):
    stale = read_json(run.shard_manifests / "shard-00001.json")
    stale["fingerprint"] = "from-an-older-prepare"
    atomic_write_json(run.shard_manifests / "shard-00001.json", stale)
    _rot(sample_path(run.hidden_states, 7))  # its files may since belong to a current shard: not judged by it
    report = verify_run(run.root, progress=False)
    assert report.ok and report.files == 8 and report.shard_manifests == 1
    assert "shard-00001.json: not a shard of the current prepare/shards.json" in report.summary()


def test_verify_refuses_what_is_not_a_run_folder(tmp_path, capsys):
    assert main(["verify", "--run-dir", str(tmp_path / "nowhere")]) == 2
    assert "no run folder at" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    assert main(["verify", "--run-dir", str(tmp_path / "plain")]) == 2
    assert "not an Eyrie run folder" in capsys.readouterr().err


def test_status_checks_the_listed_files_by_stat(run):
    shard = load_shards(run.prepare)[0]
    status = run_status(run)
    assert status["stages"]["extract"] == "done" and status["stages"]["vocab"] == "done"
    resized = sample_path(run.hidden_states, shard.start + 1)
    resized.write_bytes(resized.read_bytes()[:-1])
    text = format_status(run_status(run))
    assert f"{shard.name}  damaged: 1 of 6 listed files missing or of another size ({resized.name} " in text
    assert "its manifest records" in text and re.search(r"extract +1/2 shards \(1 damaged\)", text)


def test_remove_staging_leaves_the_hidden_states_unwalked(run, monkeypatch):
    (run.shard_manifests / ".shard-00000.json.x1.eyrie-tmp").write_text("torn")
    (run.hidden_states / ".hs_0.safetensors.x2.eyrie-tmp").write_text("not ours")
    walked: list[str] = []
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p=".": walked.append(os.fspath(p)) or real_scandir(p))
    monkeypatch.chdir(run.root.parent)
    assert remove_staging(Path(run.root.name), skip=run.write_once_folders) == 1  # a relative path too
    assert not (run.shard_manifests / ".shard-00000.json.x1.eyrie-tmp").exists()
    assert (run.hidden_states / ".hs_0.safetensors.x2.eyrie-tmp").exists()
    assert str(run.hidden_states) not in walked and str(run.shard_manifests) in walked


def test_status_of_an_online_run_does_not_call_its_shards_pending(tmp_path):
    """train.hidden_states: online has no extract stage: preflight records the mode and status says so, instead of
    listing every shard as pending forever."""
    run = RunFolder(tmp_path / "run")
    run.prepare.mkdir(parents=True)
    atomic_write_json(
        run.prepare / "shards.json", [{"index": 0, "start": 0, "stop": 4, "fingerprint": "f", "num_tokens": 40}]
    )
    atomic_write_json(run.root / "preflight.json", {"hidden_states": "offline"})
    assert run_status(run)["stages"]["extract"] == "0/1 shards"
    atomic_write_json(run.root / "preflight.json", {"hidden_states": "online"})
    status = run_status(run)
    assert status["stages"]["extract"].startswith("not used (train.hidden_states: online")
    assert status["shards"] == {}
    assert "shard-00000" not in format_status(status)


def _checkpoint(save_path: Path, epoch: int, global_step: int) -> Path:
    """A whole end-of-epoch checkpoint as speculators 0.9.0 lays it out (tests/integration/test_checkpoints.py)."""
    import json

    from eyrie.stages.train.checkpoints import completion_link

    folder = save_path / str(epoch)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights %d" % global_step * 100)
    (folder / "optimizer_state_dict.pt").write_bytes(b"optimizer %d" % global_step)
    (folder / "training_state.json").write_text(
        json.dumps({"epoch": epoch, "local_step": 0, "global_step": global_step})
    )
    completion_link(save_path, epoch, 0).symlink_to(str(epoch))
    return folder


def test_verify_takes_a_rotted_checkpoint_out_of_the_next_runs_resume(run, capsys):
    """Bit rot in the shipped checkpoint: removing the train manifest alone let the next run resume from that same
    checkpoint, find no epoch left and vouch for the rotted file again. The checkpoint stops counting instead."""
    from speculators.train.checkpointer import SingleGPUCheckpointer

    from eyrie.run.manifest import files_under
    from eyrie.stages.train.checkpoints import newest_whole_checkpoint, recover

    ckpts = run.train / "k" / "checkpoints"
    first, final = _checkpoint(ckpts, 0, 10), _checkpoint(ckpts, 1, 20)
    (ckpts / "checkpoint_best").symlink_to("1")  # speculators' link to the best epoch
    files = list_files(run.train, files_under(final))
    atomic_write_json(run.manifest("train"), {"stage": "train", "key": "k", "checkpoint": str(final), "files": files})
    _rot(final / "model.safetensors")
    assert newest_whole_checkpoint(ckpts) == final  # a stat cannot see it

    assert main(["verify", "--run-dir", str(run.root)]) == 1
    out = capsys.readouterr().out
    assert "train/k/checkpoints/1/model.safetensors (train): content differs" in out
    assert "moved the damaged checkpoint train/k/checkpoints/1 aside to 1.damaged" in out
    assert "removed train/manifest.json" in out and not run.manifest("train").exists()
    assert (ckpts / "1.damaged" / "model.safetensors").exists()  # kept for a look, under a name nothing resumes
    assert not (ckpts / "epoch1_end").is_symlink() and not (ckpts / "checkpoint_best").is_symlink()

    # The next run: recover, then resume from the newest whole checkpoint, which is now the one before.
    assert recover(ckpts) == []
    assert newest_whole_checkpoint(ckpts) == first
    assert SingleGPUCheckpointer(ckpts).previous_epoch == 0  # speculators' own choice agrees
    assert main(["verify", "--run-dir", str(run.root)]) == 0  # nothing vouches for the rotted file any more


def test_status_gives_each_stages_time_in_the_stages_order(run):
    manifest = read_json(run.manifest("vocab"))
    atomic_write_json(run.manifest("vocab"), {**manifest, "seconds": 4.2})
    times = run_status(run)["times"]
    assert list(times) == ["extract", "vocab"] and times["vocab"] == "4 s", times
    assert times["extract"].endswith("of shard work over 2 shards")
    text = format_status(run_status(run))
    assert re.search(r"time per stage:\n  extract .*\n  vocab +4 s", text), text
