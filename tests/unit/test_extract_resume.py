"""Resuming extraction without the target (issue 20 item 4): a shard whose files are all on disk and whole but that
no manifest vouches for (a kill between its last file and its manifest, a switch to packed storage) is finished by
the plan, with no server, so only shards that truly need the target count as pending. Kept files are fsynced before
the manifest that vouches for them. Fake extraction (tests/unit/test_extract_unit.py's client); no vLLM, no
Prefect."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
from conftest import config_dict
from safetensors.torch import load_file, save_file
from test_extract_unit import HIDDEN, LAYERS, FakeClient, prepared  # noqa: F401 (prepared: a fixture)

import eyrie.stages.extract.shard
from eyrie.config import PipelineConfig
from eyrie.hidden_states.keyed import file_key
from eyrie.hidden_states.packs import PACKED, pack_name
from eyrie.run.files import read_json
from eyrie.run.folder import RunFolder, sample_path
from eyrie.stages.extract.manifest import shard_complete
from eyrie.stages.extract.plan import ExtractionPlan
from eyrie.stages.extract.shard import extract_shard
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.prepare import load_shards

# Captured layers of a stand-in target whose last layer (8) is not among them: the capture proof checks the files'
# rows, not the target's head (the files are fakes).
REPORT = PreflightReport(
    "LlamaForCausalLM",
    None,
    "native",
    "",
    None,
    num_layers=8,
    hidden_size=HIDDEN,
    vocab_size=512,
    aux_layer_ids=[1, 2, 3],
    captured_layer_ids=[1, 2, 3, 4][:LAYERS],
    vllm_version="x",
    max_model_len=512,
)


def _plan(prepared, root: Path, tiny_llama, storage: str = "files") -> ExtractionPlan:  # noqa: F811
    config = PipelineConfig.model_validate(config_dict(tiny_llama, extraction={"storage": storage}))
    run = RunFolder(root)
    if not run.prepare.exists():
        shutil.copytree(prepared, run.prepare)  # what extraction reads without regeneration
    return ExtractionPlan(config, run, REPORT, load_shards(run.prepare))


def _extract(plan: ExtractionPlan, shard, client) -> dict:
    return extract_shard(
        client,
        plan.run.prepare,
        shard,
        plan.keys[shard.name],
        plan.run.hidden_states,
        plan.manifest_path(shard),
        LAYERS,
        HIDDEN,
        concurrency=3,
        log=lambda *_: None,
        storage=plan.storage,
        sample_key=plan.sample_key,  # as the flow's job passes it
    )


def test_a_shard_whole_on_disk_without_its_manifest_is_not_pending(prepared, tmp_path, tiny_llama):  # noqa: F811
    """A kill after the shard's last file, before its manifest: the plan writes the manifest from the files (each
    checked, as an interrupted attempt's are) and counts only the shard with nothing on disk as pending."""
    plan = _plan(prepared, tmp_path / "run", tiny_llama)
    first, second = plan.shards
    client = FakeClient(plan.run.extract / "staging")
    done = _extract(plan, second, client)
    sent = len(client.sent)
    plan.manifest_path(second).unlink()  # killed before the manifest
    assert [s.name for s in plan.pending()] == [first.name]
    assert plan.finished_from_disk == [second.name] and len(client.sent) == sent  # no request, no server
    m = read_json(plan.manifest_path(second))
    assert m["key"] == plan.keys[second.name] and m["files"].keys() == done["files"].keys()
    assert all(m["files"][k]["sha256"] == done["files"][k]["sha256"] for k in done["files"])
    assert m["reused_samples"] == second.stop - second.start and m["extracted_samples"] == 0
    assert shard_complete(plan.manifest_path(second), plan.keys[second.name], plan.run.hidden_states)
    assert plan.pending() == [first]  # and the next look trusts it by stat
    assert plan.finished_from_disk == [second.name]


def test_a_switch_to_packed_storage_repacks_without_a_server(prepared, tmp_path, tiny_llama):  # noqa: F811
    """Files extracted under `storage: files`, then the config says packed: the layout key changes, every sample is
    on disk, so the plan packs them and writes the packed manifest with no server; the per-sample files go."""
    root = tmp_path / "run"
    files_plan = _plan(prepared, root, tiny_llama)
    shard = files_plan.shards[1]
    _extract(files_plan, shard, FakeClient(files_plan.run.extract / "staging"))
    plan = _plan(prepared, root, tiny_llama, storage=PACKED)
    assert plan.keys[shard.name] != files_plan.keys[shard.name]
    assert [s.name for s in plan.pending()] == [plan.shards[0].name]
    m = read_json(plan.manifest_path(shard))
    assert m["storage"] == PACKED and list(m["files"]) == [pack_name(shard.start, shard.stop)]
    hidden = plan.run.hidden_states
    assert (hidden / pack_name(shard.start, shard.stop)).is_file()
    assert not any(sample_path(hidden, i).exists() for i in range(shard.start, shard.stop))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_shard_with_a_missing_or_bad_file_stays_pending(prepared, tmp_path, tiny_llama, damage):  # noqa: F811
    """Only a shard whose every sample is there and whole is finished from disk: a missing file (one stat tells) or
    a bad one (removed, as an interrupted attempt's is) leaves it pending, with no manifest."""
    plan = _plan(prepared, tmp_path / "run", tiny_llama)
    shard = plan.shards[1]
    _extract(plan, shard, FakeClient(plan.run.extract / "staging"))
    plan.manifest_path(shard).unlink()
    victim = sample_path(plan.run.hidden_states, shard.start + 2)
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:100])
    assert {s.name for s in plan.pending()} == {s.name for s in plan.shards}
    assert not plan.finished_from_disk and not plan.manifest_path(shard).exists() and not victim.exists()


def test_kept_files_reach_the_disk_before_the_manifest_vouches_for_them(prepared, tmp_path, tiny_llama, monkeypatch):  # noqa: F811
    """Files an interrupted attempt left (never fsynced: it was killed first) are fsynced, then the folder, before
    the new manifest lists them; a file an earlier manifest of this key vouched for was fsynced before it."""
    plan = _plan(prepared, tmp_path / "run", tiny_llama)
    shard = plan.shards[1]
    client = FakeClient(plan.run.extract / "staging")
    _extract(plan, shard, client)
    plan.manifest_path(shard).unlink()
    sample_path(plan.run.hidden_states, shard.start).unlink()  # the one sample the next attempt extracts
    events: list[str] = []
    real_fsync, real_manifest = eyrie.stages.extract.shard.fsync_path, eyrie.stages.extract.shard.write_manifest
    monkeypatch.setattr(
        eyrie.stages.extract.shard, "fsync_path", lambda p: events.append(Path(p).name) or real_fsync(p)
    )
    monkeypatch.setattr(
        eyrie.stages.extract.shard,
        "write_manifest",
        lambda p, m, *a, **k: events.append("manifest") or real_manifest(p, m, *a, **k),
    )
    m = _extract(plan, shard, client)
    assert m["extracted_samples"] == 1 and m["reused_samples"] == shard.stop - shard.start - 1
    names = [sample_path(Path("."), i).name for i in range(shard.start, shard.stop)]
    at = {e: n for n, e in enumerate(events)}
    assert set(names) <= set(at), "every file the manifest lists is fsynced"
    assert max(at[n] for n in names) < at[plan.run.hidden_states.name] < at["manifest"]


def _other_layers(plan: ExtractionPlan, root: Path, tiny_llama) -> ExtractionPlan:  # noqa: F811
    """The same run after `extraction.layer_ids` changed to as many other layers: files of the same rows, token ids
    and shape, made under another key."""
    config = PipelineConfig.model_validate(config_dict(tiny_llama))
    other = dataclasses.replace(REPORT, captured_layer_ids=[c + 1 for c in REPORT.captured_layer_ids])
    return ExtractionPlan(config, RunFolder(root), other, load_shards(plan.run.prepare))


def test_files_made_under_another_key_are_redone(prepared, tmp_path, tiny_llama, caplog):  # noqa: F811
    """A shard interrupted (or finished) under other layers leaves whole files of the same rows and tokens: they are
    not this shard's, so it is pending, not finished from disk, and every one of its files is extracted again."""
    root = tmp_path / "run"
    old = _plan(prepared, root, tiny_llama)
    shard = old.shards[1]
    _extract(old, shard, FakeClient(old.run.extract / "staging"))
    old.manifest_path(shard).unlink()  # interrupted before its manifest (with it, the key already differs)
    plan = _other_layers(old, root, tiny_llama)
    assert plan.sample_key != old.sample_key
    with caplog.at_level(logging.INFO, logger="eyrie.stages.extract.plan"):
        assert {s.name for s in plan.pending()} == {s.name for s in plan.shards}
    assert not plan.finished_from_disk and not plan.manifest_path(shard).exists()
    assert f"made under another key ({old.sample_key}" in caplog.text
    client = FakeClient(plan.run.extract / "staging")
    m = _extract(plan, shard, client)
    assert len(client.sent) == shard.stop - shard.start and m["reused_samples"] == 0
    assert all(
        file_key(sample_path(plan.run.hidden_states, i)) == plan.sample_key for i in range(shard.start, shard.stop)
    )


def test_files_without_a_key_are_redone_once_with_the_reason(prepared, tmp_path, tiny_llama):  # noqa: F811
    """Files written before files recorded their key cannot say what made them: redone once, with a line saying
    why; the files written then carry the key, and the next attempt keeps them."""
    plan = _plan(prepared, tmp_path / "run", tiny_llama)
    shard = plan.shards[1]
    _extract(plan, shard, FakeClient(plan.run.extract / "staging"))
    plan.manifest_path(shard).unlink()
    for i in range(shard.start, shard.stop):  # as the connector wrote them before: no metadata
        p = sample_path(plan.run.hidden_states, i)
        save_file(load_file(str(p)), str(p))
        assert file_key(p) is None
    lines: list[str] = []
    client = FakeClient(plan.run.extract / "staging")
    m = extract_shard(
        client,
        plan.run.prepare,
        shard,
        plan.keys[shard.name],
        plan.run.hidden_states,
        plan.manifest_path(shard),
        LAYERS,
        HIDDEN,
        log=lines.append,
        sample_key=plan.sample_key,
    )
    n = shard.stop - shard.start
    assert m["reused_samples"] == 0 and len(client.sent) == n
    assert [line for line in lines if "recorded the key they were made under" in line] == [
        f"{shard.name}: redoing {n} sample(s) on disk (rows {shard.start}-{shard.stop - 1}): written before "
        "hidden-state files recorded the key they were made under"
    ]
    plan.manifest_path(shard).unlink()  # interrupted again: now the files carry the key and are kept
    assert [s.name for s in plan.pending()] == [plan.shards[0].name] and plan.finished_from_disk == [shard.name]
    assert len(client.sent) == n


def test_files_of_the_same_key_survive_a_new_shard_plan(prepared, tmp_path, tiny_llama):  # noqa: F811
    """The key a file records is its values' (no shard's): a shard plan regrouping the same rows and tokens keeps
    every file; only its shards' manifests are new."""
    plan = _plan(prepared, tmp_path / "run", tiny_llama)
    shard = plan.shards[1]
    _extract(plan, shard, FakeClient(plan.run.extract / "staging"))
    half = (shard.start + shard.stop) // 2
    regrouped = [
        dataclasses.replace(shard, index=7, stop=half, fingerprint="a"),
        dataclasses.replace(shard, index=8, start=half, fingerprint="b"),
    ]
    config = PipelineConfig.model_validate(config_dict(tiny_llama))
    again = ExtractionPlan(config, plan.run, REPORT, regrouped)
    assert again.sample_key == plan.sample_key and again.keys[regrouped[0].name] != plan.keys[shard.name]
    assert again.pending() == [] and again.finished_from_disk == [s.name for s in regrouped]
