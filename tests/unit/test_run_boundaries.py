"""A run touches only its own folder (issue 22, item 1): which folders a run adopts, the run's name, which temporary
files its clean-ups remove (only Eyrie's own, only those whose writer is gone, never through a symlink or inside
another run folder), and that `eyrie verify` and extraction move or delete only paths inside the run's folders."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_extract_unit import FakeClient, prepared  # noqa: F401 (a fixture)

from eyrie.config import parse_config
from eyrie.errors import ConfigError, ExtractionError, RunFolderError
from eyrie.hidden_states.packs import PACKS_DIR, remove_overlapping, temporary_pack, write_pack
from eyrie.ops.verify import verify_run
from eyrie.run.files import TMP_SUFFIX, atomic_write_json, remove_abandoned, temporary_file, within
from eyrie.run.folder import STAMP, RunFolder, answered_file, remove_staging
from eyrie.run.lock import LOCK
from eyrie.stages.extract.shard import extract_shard
from eyrie.stages.prepare import load_shards

LAYERS, HIDDEN = 4, 8
REPO = Path(__file__).resolve().parents[2]


# --- adoption ------------------------------------------------------------------------------------------------------


def test_a_new_or_empty_folder_is_adopted_and_stamped(tmp_path):
    RunFolder(tmp_path / "new" / "run").ensure()
    assert (tmp_path / "new" / "run" / STAMP).is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / LOCK).write_text("")  # a run's own lock file (taken before the stamp) does not count
    RunFolder(empty).ensure()
    assert (empty / STAMP).is_file()


def test_a_folder_holding_other_things_is_refused_untouched(tmp_path):
    """`--run-dir /data/runs` (a parent of run folders) and `run_dir: "."` (a checkout) are refused before anything
    in them is stamped, walked or cleaned."""
    parent = tmp_path / "runs"
    RunFolder(parent / "a").ensure()
    inflight = parent / "a" / "extract" / f".manifest.json.x1y2z3w4{TMP_SUFFIX}"
    inflight.parent.mkdir(parents=True)
    inflight.write_text("another run's write in flight")
    with pytest.raises(RunFolderError, match="not empty and is not an Eyrie run folder .*holds a"):
        RunFolder(parent).ensure()
    assert not (parent / STAMP).exists() and inflight.exists()
    checkout = tmp_path / "checkout"
    (checkout / "eyrie").mkdir(parents=True)
    (checkout / "README.md").write_text("x")
    with pytest.raises(RunFolderError, match="adopts only an empty folder or one it made"):
        RunFolder(checkout).ensure()
    assert sorted(p.name for p in checkout.iterdir()) == ["README.md", "eyrie"]


def test_a_folder_inside_a_run_folder_is_refused(tmp_path):
    RunFolder(tmp_path / "run").ensure()
    with pytest.raises(RunFolderError, match="inside the run folder"):
        RunFolder(tmp_path / "run" / "extract" / "nested").ensure()
    assert not (tmp_path / "run" / "extract").exists()


def test_a_run_folder_holding_a_run_folder_is_refused(tmp_path):
    """Made before these checks (or by hand): cleaning the outer run must not reach the inner one's files."""
    RunFolder(tmp_path / "outer").ensure()
    (tmp_path / "outer" / "inner").mkdir()
    atomic_write_json(tmp_path / "outer" / "inner" / STAMP, {"format_version": 1})
    with pytest.raises(RunFolderError, match="holds other run folders \\(inner\\)"):
        RunFolder(tmp_path / "outer").ensure()


@pytest.mark.parametrize("name", ["../..", "..", "a/b", "/abs", ".hidden", "", "x" * 101, "a..b", "rün"])
def test_a_run_name_that_is_not_one_folder_name_is_refused(name):
    with pytest.raises(ConfigError, match="`name`: .*is not a run name"):
        parse_config({"name": name, "target": {"model": "m"}, "data": {"source": "d"}})


def test_ordinary_run_names_pass():
    for name in ("demo", "kimi-k2.5-eagle3", "run_2026.12.01", "A1"):
        assert parse_config({"name": name, "target": {"model": "m"}, "data": {"source": "d"}}).name == name


# --- temporary files -----------------------------------------------------------------------------------------------


def _run_with_temporaries(tmp_path) -> tuple[RunFolder, dict[str, Path]]:
    run = RunFolder(tmp_path / "run")
    run.ensure()
    (run.vocab).mkdir()
    paths = {
        "abandoned": run.vocab / f".manifest.json.a1b2c3d4{TMP_SUFFIX}",
        "not_ours": run.vocab / ".data.json.a1b2c3d4.tmp",  # another tool's name: never ours to remove
        "plain": run.vocab / f"notes{TMP_SUFFIX}",  # not a dot-name: no writer of ours makes it
    }
    for p in paths.values():
        p.write_text("x")
    return run, paths


def test_remove_staging_removes_only_abandoned_temporaries_of_eyries_writers(tmp_path):
    run, paths = _run_with_temporaries(tmp_path)
    live = run.vocab / f".d2t.npy.e5f6g7h8{TMP_SUFFIX}"
    live.write_text("a write in flight")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # its writer holds it (on this node, or another sharing the folder)
    try:
        assert remove_staging(run.root) == 1
    finally:
        os.close(fd)
    assert not paths["abandoned"].exists()
    assert paths["not_ours"].exists() and paths["plain"].exists() and live.exists()
    assert remove_staging(run.root) == 1 and not live.exists()  # its writer is gone now


def test_remove_staging_follows_no_symlink_and_enters_no_other_run(tmp_path):
    run, _ = _run_with_temporaries(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / f".victim.a1b2c3d4{TMP_SUFFIX}"
    victim.write_text("someone else's")
    (run.root / "linked").symlink_to(elsewhere)  # a symlinked folder: not walked
    (run.vocab / f".link.a1b2c3d4{TMP_SUFFIX}").symlink_to(victim)  # a symlink with our name: not a file of ours
    other = run.root / "stray"
    RunFolder(tmp_path / "stray-made-elsewhere").ensure()
    os.rename(tmp_path / "stray-made-elsewhere", other)  # a run folder moved in by hand
    theirs = other / f".manifest.json.a1b2c3d4{TMP_SUFFIX}"
    theirs.write_text("theirs")
    assert remove_staging(run.root) == 1  # the abandoned one of this run only
    assert victim.exists() and theirs.exists() and (run.vocab / f".link.a1b2c3d4{TMP_SUFFIX}").is_symlink()


def test_remove_staging_refuses_a_folder_that_is_no_run_folder(tmp_path):
    (tmp_path / f".x.a1b2c3d4{TMP_SUFFIX}").write_text("x")
    with pytest.raises(RunFolderError, match="not an Eyrie run folder"):
        remove_staging(tmp_path)
    assert (tmp_path / f".x.a1b2c3d4{TMP_SUFFIX}").exists()


def test_atomic_writes_leave_no_temporary_and_name_theirs_as_eyries(tmp_path, monkeypatch):
    seen = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: seen.append(Path(a).name) or real(a, b))
    atomic_write_json(tmp_path / "m.json", {"a": 1})
    assert seen and seen[0].startswith(".m.json.") and seen[0].endswith(TMP_SUFFIX)
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def _killed_holding(tmp: Path) -> None:
    """A writer killed (SIGKILL) inside a write of `tmp`, as a kill inside `write_pack` leaves it."""
    code = (
        "import sys, time; from pathlib import Path; from eyrie.run.files import temporary_file\n"
        "with temporary_file(Path(sys.argv[1])) as f:\n"
        "    f.write(b'x' * 4096); f.flush(); print('writing', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        assert not remove_abandoned(tmp)  # its writer is alive: kept
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_pack_write_killed_midway_is_removed_by_the_next_plan(tmp_path):
    """A kill inside `write_pack` leaves a temporary pack of up to a shard's bytes. The next extraction of any
    shard removes it, whatever range it was for (a later plan may have other ranges); one being written is kept."""
    hidden = tmp_path / "hidden_states"
    (hidden / PACKS_DIR).mkdir(parents=True)
    killed = temporary_pack(hidden / PACKS_DIR / "0_256.safetensors")
    _killed_holding(killed)
    assert killed.stat().st_size == 4096
    writing = temporary_pack(hidden / PACKS_DIR / "256_512.safetensors")
    with temporary_file(writing) as f:
        f.write(b"in flight")
        remove_overlapping(hidden, 512, 768)  # another shard's plan, of other rows
        assert writing.exists()
        with pytest.raises(RunFolderError, match="being written by another process"):
            write_pack([], hidden / PACKS_DIR / "256_512.safetensors", "k")
    assert not killed.exists()


# --- paths from manifests and answers ------------------------------------------------------------------------------


def test_within(tmp_path):
    (tmp_path / "run" / "a").mkdir(parents=True)
    (tmp_path / "run" / "out").symlink_to(tmp_path)
    assert within(tmp_path / "run" / "a" / "f", tmp_path / "run")
    assert within(tmp_path / "run" / "a", tmp_path / "run")
    for p in ("../../x", "a/../../x", "out/x", ".."):
        assert not within(tmp_path / "run" / p, tmp_path / "run"), p
    assert not within(tmp_path / "run", tmp_path / "run")


def test_answered_file_only_in_the_staging_folders(tmp_path):
    extract = tmp_path / "run" / "extract"
    (extract / "staging").mkdir(parents=True)
    (extract / "hidden_states").mkdir()
    good = extract / "staging" / "eyrie-0.safetensors"
    good.write_text("x")
    assert answered_file(str(good), extract, extract / "hidden_states", "s") == good
    outside = tmp_path / "x.safetensors"
    outside.write_text("x")
    (extract / "staging" / "link.safetensors").symlink_to(outside)
    (extract / "hidden_states" / "hs_0.safetensors").write_text("x")
    for bad in (
        outside,
        extract / "staging" / ".." / ".." / ".." / "x.safetensors",
        extract / "staging" / "link.safetensors",
        extract / "hidden_states" / "hs_0.safetensors",
        extract / "shards" / "shard-00000.json",
    ):
        with pytest.raises(ExtractionError, match="not a hidden-states file in this run's staging folders"):
            answered_file(str(bad), extract, extract / "hidden_states", "s")


class ElsewhereClient(FakeClient):
    """A server that answers with a file outside the run (not Eyrie's, or one a client steered)."""

    def extract(self, token_ids, timeout_s):
        path = Path(super().extract(token_ids, timeout_s))
        target = self.staging.parents[2] / "victim.safetensors"
        os.replace(path, target)
        return str(target)


def test_extraction_moves_no_file_a_server_answer_points_outside_the_run(prepared, tmp_path):  # noqa: F811
    run = RunFolder(tmp_path / "run")
    run.ensure()
    shard = load_shards(prepared)[0]
    client = ElsewhereClient(run.extract / "staging")  # writes victim.safetensors in tmp_path, outside the run
    with pytest.raises(ExtractionError, match="victim.safetensors, which is not a hidden-states file"):
        extract_shard(
            client,
            prepared,
            shard,
            "k",
            run.hidden_states,
            run.shard_manifests / f"{shard.name}.json",
            LAYERS,
            HIDDEN,
            concurrency=1,
            log=lambda *_: None,
        )
    assert (tmp_path / "victim.safetensors").exists()  # neither moved into the run nor deleted
    assert not list(run.hidden_states.glob("*.safetensors"))


def test_verify_deletes_nothing_a_manifest_names_outside_the_run(tmp_path):
    """A shard manifest naming `../../x` got x deleted; now it is a problem of that manifest, and x stays."""
    run = RunFolder(tmp_path / "run")
    run.ensure()
    victim = tmp_path / "x"
    victim.write_text("not the run's")
    run.shard_manifests.mkdir(parents=True)
    files = {"../../../x": {"sha256": "0" * 64, "bytes": 1}}
    atomic_write_json(
        run.shard_manifests / "shard-00000.json", {"shard": "shard-00000", "storage": "packed", "files": files}
    )
    report = verify_run(run.root, workers=1, progress=False)
    assert not report.ok and report.files == 0
    assert any("outside extract/hidden_states: not read and not removed" in p for p in report.problems)
    assert victim.read_text() == "not the run's"
    assert json.loads((run.shard_manifests / "shard-00000.json").read_text())["files"] == files


def test_the_run_lock_file_is_the_only_thing_before_the_stamp(tmp_path):
    """`eyrie run` stamps before it locks; a second process stamping at the same moment sees the other's stamp or
    its temporary file, never a foreign folder."""
    root = tmp_path / "run"
    root.mkdir()
    (root / f".{STAMP}.a1b2c3d4{TMP_SUFFIX}").write_text("{}")
    RunFolder(root).ensure()
    assert (root / STAMP).is_file()
