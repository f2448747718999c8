"""What "done" means (eyrie/run/manifest.py), and the stage tasks' cache policy that trusts Prefect's cache only while
it holds (tasks/caching.py): pure logic, then one real flow in process on the session's Prefect server."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prefect import flow

from eyrie.run.files import atomic_write_json, read_json, sha256_file
from eyrie.run.manifest import finished_manifest, list_files, problems
from tasks import caching
from tasks.caching import StageDone
from tasks.vocab import vocab_task


@pytest.fixture
def stage(tmp_path) -> Path:
    """A stage folder with two files (one in a subfolder) and a manifest listing them under key "k"."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"a" * 100)
    (tmp_path / "sub" / "b.bin").write_bytes(b"b" * 50)
    files = list_files(tmp_path, [tmp_path / "a.bin", tmp_path / "sub" / "b.bin"])
    atomic_write_json(tmp_path / "manifest.json", {"key": "k", "files": files})
    return tmp_path


def test_a_whole_stage_with_its_key_is_done(stage):
    m = finished_manifest(stage / "manifest.json", "k")
    assert m is not None and m["files"]["sub/b.bin"] == {"bytes": 50, "sha256": sha256_file(stage / "sub" / "b.bin")}
    assert finished_manifest(stage / "manifest.json", None) == m  # any key
    assert finished_manifest(stage / "manifest.json", "other") is None
    assert finished_manifest(stage / "missing.json", "k") is None


def test_a_missing_or_resized_file_undoes_the_stage(stage):
    (stage / "sub" / "b.bin").unlink()
    assert finished_manifest(stage / "manifest.json", "k") is None
    assert problems(stage, read_json(stage / "manifest.json")) == ["sub/b.bin missing"]
    (stage / "sub" / "b.bin").write_bytes(b"b" * 49)
    assert problems(stage, read_json(stage / "manifest.json")) == ["sub/b.bin 49 bytes, its manifest records 50"]


def test_changed_content_of_the_same_size_is_found_only_with_hashes(stage):
    (stage / "a.bin").write_bytes(b"x" * 100)
    assert finished_manifest(stage / "manifest.json", "k") is not None  # a stat-only check cannot see it
    assert finished_manifest(stage / "manifest.json", "k", hashes=True) is None
    assert problems(stage, read_json(stage / "manifest.json"), hashes=True) == [
        "a.bin content differs from its manifest (sha256)"
    ]


def test_a_manifest_of_an_older_format_never_counts_as_done(stage):
    """Records without sizes (`{name: sha256}`, format 1) are refused, not trusted by presence."""
    atomic_write_json(stage / "manifest.json", {"key": "k", "files": {"a.bin": sha256_file(stage / "a.bin")}})
    assert finished_manifest(stage / "manifest.json", "k") is None


def test_the_cache_policy_never_uses_a_record_that_outlived_its_files(stage, monkeypatch):
    policy = StageDone(manifest="{out_dir}/manifest.json")
    ctx = SimpleNamespace(task=SimpleNamespace(name="vocab"))
    inputs = {"out_dir": str(stage), "key": "k"}
    key = policy.compute_key(ctx, inputs, {})
    assert key.startswith("eyrie-vocab-k-")  # and the folder's place: a result names its paths
    recorded = {key}  # Prefect's result store, holding a result for that key
    monkeypatch.setattr(caching, "get_result_store", lambda: SimpleNamespace(exists=recorded.__contains__))
    assert policy.compute_key(ctx, inputs, {}) == key  # done: the record is used
    (stage / "a.bin").unlink()
    assert policy.compute_key(ctx, inputs, {}).startswith(f"{key}-redo-")  # it outlived its files: not used
    recorded.clear()
    assert policy.compute_key(ctx, inputs, {}) == key  # nothing recorded: this run's result will be


def test_a_moved_stage_folder_runs_its_task_which_names_the_paths_where_they_are_now(stage):
    """A cached result names its stage's paths (the drafter, the checkpoint): in a moved run folder, or another
    folder of the same key, it would name the old place, or another run's files."""
    policy = StageDone(manifest="{out_dir}/manifest.json")
    ctx = SimpleNamespace(task=SimpleNamespace(name="vocab"))
    key = policy.compute_key(ctx, {"out_dir": str(stage), "key": "k"}, {})
    moved = stage.with_name("moved")
    stage.rename(moved)
    assert finished_manifest(moved / "manifest.json", "k") is not None
    assert policy.compute_key(ctx, {"out_dir": str(moved), "key": "k"}, {}) not in (key, None)


@pytest.mark.usefixtures("flow_api")
def test_a_stage_task_whose_files_vanished_runs_again(tmp_path):
    """The real vocab task in a real flow: cached on its second run, run again once a listed file is gone."""
    torch.save({i: 10 - i for i in range(10)}, tmp_path / "token_freq.pt")
    out = tmp_path / "vocab"

    @flow
    def vocab_flow() -> str:
        state = vocab_task(str(tmp_path / "token_freq.pt"), 4, 10, str(out), "key-1", return_state=True)
        return state.name

    assert vocab_flow() == "Completed"
    assert vocab_flow() == "Cached"
    d2t = out / "d2t-4.npy"
    kept = np.load(d2t)
    d2t.unlink()
    assert vocab_flow() == "Completed"  # not "Cached": its manifest is no longer done
    assert np.array_equal(np.load(d2t), kept) and finished_manifest(out / "manifest.json", "key-1") is not None
    assert vocab_flow() == "Cached"
