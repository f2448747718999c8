"""Rows a regenerated shard lost to server errors (issue 20 item 4): named in its manifest, retried by the next run
(only those rows: the rest are kept), keyed into the assembly so the assembly made without them is not reused once
they are back, and each loss in the run's warnings. The assembled dataset is on disk before its manifest. A fake
server (tests/unit/test_regenerate_unit.py's); no vLLM, no Prefect."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from test_extract_resume import REPORT
from test_regenerate_unit import FakeClient, prepared, target_dir, tok  # noqa: F401 (fixtures)

import eyrie.stages.regenerate.shard as regen
from eyrie.errors import RequestRejected
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.folder import RunFolder
from eyrie.stages.prepare import load_shards
from eyrie.stages.regenerate.assemble import assemble
from eyrie.stages.regenerate.plan import RegenerationPlan, stage_key
from eyrie.stages.regenerate.shard import regenerate_shard, shard_paths

BOOM = {"boom": RequestRejected(500, "Internal Server Error")}


def _marked(monkeypatch, prepare_dir, shard, row: int):
    """The shard's conversations with one marked so that a client with `BOOM` fails it with a server error."""
    conversations = regen.load_conversations(prepare_dir, shard)
    next(m for m in conversations[row] if m["role"] == "user")["content"] += " #boom#"
    real = regen.load_conversations
    monkeypatch.setattr(regen, "load_conversations", lambda d, s: conversations if s == shard else real(d, s))


def _plan(tmp_path, prepared) -> RegenerationPlan:  # noqa: F811
    prepare_dir, config = prepared
    run = RunFolder(tmp_path / "run")
    shutil.copytree(prepare_dir, run.prepare)
    return RegenerationPlan(config, run, REPORT)


def test_rows_lost_to_server_errors_are_retried_by_the_next_run(tmp_path, prepared, tok, monkeypatch):  # noqa: F811
    plan = _plan(tmp_path, prepared)
    config, prepare_dir, cfg = plan.config, plan.run.prepare, plan.config.regenerate
    lossy = plan.shards[0]
    _marked(monkeypatch, prepare_dir, lossy, 1)
    for s in plan.shards:
        client = FakeClient(tok, reject=BOOM)
        regenerate_shard(client, tok, prepare_dir, plan.dir, s, plan.keys[s.name], cfg, 256)
    first = read_json(shard_paths(plan.dir, lossy)[1])
    assert first.get("server_error_rows") == [lossy.start + 1] and first["stats"]["failed"] == {"server_error": 1}
    # Complete (this run assembles what it has), pending for the next run, and the loss is a warning of the run.
    assert all(plan.is_complete(s) for s in plan.shards)
    assert plan.pending() == [lossy]
    lost_key = plan.key
    assert lost_key != stage_key(plan.keys, config)
    m = assemble(plan.dir, prepare_dir, plan.shards, plan.keys, lost_key, cfg)
    assert m["num_samples"] == sum(s.stop - s.start for s in plan.shards) - 1
    assert len(m["warnings"]) == 1 and lossy.name in m["warnings"][0] and "retries" in m["warnings"][0]
    # No server: the shard is returned as it stands (a task given no server sends nothing).
    assert regenerate_shard(None, tok, prepare_dir, plan.dir, lossy, plan.keys[lossy.name], cfg, 256) == first
    # The next run sends only the lost conversation again, and keeps the other rows.
    healthy = FakeClient(tok)
    again = regenerate_shard(healthy, tok, prepare_dir, plan.dir, lossy, plan.keys[lossy.name], cfg, 256)
    assert 0 < healthy.calls < first["stats"]["requests"]
    assert again["server_error_rows"] == [] and again["stats"]["failed"] == {} and not again["stats"]["examples"]
    assert again["stats"]["rows_out"] == again["stats"]["rows_in"] == lossy.stop - lossy.start
    assert again["stats"]["requests"] == first["stats"]["requests"] + healthy.calls
    # The rows are those a run without the error makes.
    clean = tmp_path / "clean"
    reference = regenerate_shard(FakeClient(tok), tok, prepare_dir, clean, lossy, plan.keys[lossy.name], cfg, 256)
    got = pq.read_table(shard_paths(plan.dir, lossy)[0]).to_pydict()
    assert got == pq.read_table(shard_paths(clean, lossy)[0]).to_pydict()
    assert {k: v for k, v in again["stats"].items() if k != "requests"} == {
        k: v for k, v in reference["stats"].items() if k != "requests"
    }
    assert plan.pending() == [] and plan.key == stage_key(plan.keys, config) != lost_key
    whole = assemble(plan.dir, prepare_dir, plan.shards, plan.keys, plan.key, cfg)
    assert whole["num_samples"] == m["num_samples"] + 1 and whole["warnings"] == []


def test_a_manifest_that_counts_losses_but_names_none_redoes_its_shard(tmp_path, prepared, tok, monkeypatch):  # noqa: F811
    """A manifest written before lost rows were named (it counts server errors, names no row): pending, and the
    shard is redone whole."""
    plan = _plan(tmp_path, prepared)
    shard, cfg = plan.shards[0], plan.config.regenerate
    _marked(monkeypatch, plan.run.prepare, shard, 0)
    regenerate_shard(
        FakeClient(tok, reject=BOOM), tok, plan.run.prepare, plan.dir, shard, plan.keys[shard.name], cfg, 256
    )
    path = shard_paths(plan.dir, shard)[1]
    old = read_json(path)
    old.pop("server_error_rows", None)
    atomic_write_json(path, old)
    assert shard in plan.pending()
    client = FakeClient(tok)
    m = regenerate_shard(client, tok, plan.run.prepare, plan.dir, shard, plan.keys[shard.name], cfg, 256)
    assert client.calls == m["stats"]["turns"] and m["stats"]["failed"] == {} and m["server_error_rows"] == []


def test_the_assembled_dataset_is_on_disk_before_its_manifest(tmp_path, prepared, tok, monkeypatch):  # noqa: F811
    """Every file of the assembled dataset (written by `datasets`, which does not fsync) is fsynced before the
    manifest that lists it is written."""
    prepare_dir, config = prepared
    shards = load_shards(prepare_dir)
    keys = {s.name: f"k{s.index}" for s in shards}
    for s in shards:
        regenerate_shard(FakeClient(tok), tok, prepare_dir, tmp_path, s, keys[s.name], config.regenerate, 256)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assemble(tmp_path, prepare_dir, shards, keys, "stage", config.regenerate)
    manifest_at = next(n for n, p in enumerate(synced) if Path(p).name.startswith(".manifest.json."))
    staged = [Path(p) for p in synced[:manifest_at] if Path(p).parent.name.startswith("dataset.staging-")]
    files = sorted(p.name for p in (tmp_path / "dataset").iterdir())
    assert files and sorted(p.name for p in staged if p.name in files) == files
