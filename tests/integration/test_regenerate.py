"""The regenerate stage on the real stack (tiny-llama-chat, vLLM's CPU build, Prefect), one server for the module:
a first flow run with one shard failing, a second that redoes that shard alone, then checks that every regenerated
answer is the server's own ids verbatim (as it returned them, and as a direct request returns them), that the mask
covers exactly those ids, that the extraction server wrote no hidden-state file for a generation and serves
extraction of the regenerated rows without a second load, and that no held-out prompt was regenerated or trained on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import build_tiny_target, register_server_folder, stop_server, write_config

from eyrie.config import PipelineConfig
from eyrie.errors import RegenerationError
from eyrie.run.files import read_json
from eyrie.run.folder import RunFolder
from eyrie.stages.prepare import _render, iter_eval_prompts, load_dataset_rows, load_shards, prepare
from eyrie.stages.regenerate.conversation import shared_tokenizer
from eyrie.stages.regenerate.plan import RegenerationPlan
from eyrie.stages.regenerate.shard import shard_paths
from eyrie.vllm.client import ServerClient
from eyrie.vllm.process import VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("flow_api")]

SHARDS, SHARD_SIZE = 3, 8


@dataclass
class Regenerated:
    config: PipelineConfig
    run: RunFolder
    report: dict
    plan: RegenerationPlan
    first_error: str
    finished_after_first: dict  # shard name -> (inode, mtime_ns) of its manifest
    second: dict
    calls: list[tuple[list[int], dict]]  # every generation request, both runs: (prompt ids, the answer)
    first_run_calls: int


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Regenerated:
    from eyrie.stages.preflight import run_preflight
    from flows.regenerate import regenerate_flow

    root = tmp_path_factory.mktemp("regenerate")
    _, config = write_config(
        root / "config.yaml",
        build_tiny_target("tiny-llama-chat"),
        "tiny-llama-chat",
        max_samples=SHARDS * SHARD_SIZE,
        shard_size=SHARD_SIZE,
        max_length=256,
        max_model_len=512,
        data={"eval_fraction": 0.2},
        regenerate={"enabled": True, "concurrency": 4, "max_tokens": 48},
    )
    run = RunFolder(root / "run")
    run.ensure()
    register_server_folder(run.extract)
    prepare(config.target, config.data, run.prepare)
    report = run_preflight(config, run.root, serve=False).as_dict()

    calls: list[tuple[list[int], dict]] = []
    async_generator = ServerClient.async_generator

    @contextlib.asynccontextmanager
    async def recording(self):  # regeneration's window sends every request through the client's coroutine form
        async with async_generator(self) as generate:

            async def recorded(token_ids, *args, **kwargs):
                out = await generate(token_ids, *args, **kwargs)
                calls.append((list(token_ids), out))  # on the window's one loop: no lock needed
                return out

            yield recorded

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(ServerClient, "async_generator", recording)
        # First run: shard 1 fails on every attempt; the other two finish, the server stays up for a retry.
        mp.setenv("EYRIE_FAULTS", "regenerate.shard-00001=raise")
        with pytest.raises(RegenerationError) as info:
            regenerate_flow(config, str(run.root), report, keep_server=True)
        mp.delenv("EYRIE_FAULTS")
        plan = RegenerationPlan(config, run, _report(report))
        finished = {s.name: _stat(shard_paths(plan.dir, s)[1]) for s in plan.shards if plan.is_complete(s)}
        first_run_calls = len(calls)
        second = regenerate_flow(config, str(run.root), report, keep_server=True)
    finally:
        mp.undo()
    yield Regenerated(config, run, report, plan, str(info.value), finished, second, list(calls), first_run_calls)
    stop_server(run.extract)
    # The flows ran in this process: send their logs while the session's Prefect server is still up (at exit its
    # log worker would retry against a stopped server for about a minute).
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)


def _report(report: dict):
    from eyrie.stages.preflight import PreflightReport

    return PreflightReport(**report)


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, stop) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_a_failed_shard_is_redone_alone(regenerated):
    r = regenerated
    assert "shard-00001" in r.first_error and "Run again" in r.first_error
    assert sorted(r.finished_after_first) == ["shard-00000", "shard-00002"]
    assert r.second["regenerated"] == ["shard-00001"]
    # The shards finished in the first run were not touched: same manifest file, same mtime.
    for name, stat in r.finished_after_first.items():
        assert _stat(r.plan.dir / "shards" / f"{name}.json") == stat
    # Only shard 1's conversations went to the server the second time.
    shard = load_shards(r.run.prepare)[1]
    second_run_calls = len(r.calls) - r.first_run_calls
    assert r.first_run_calls > 0
    assert second_run_calls == read_json(shard_paths(r.plan.dir, shard)[1])["stats"]["requests"] > 0
    manifest = read_json(r.run.manifest("regenerate"))
    assert manifest["num_samples"] == manifest["stats"]["rows_used"] > 0
    assert manifest["stats"]["rows_in"] == SHARDS * SHARD_SIZE
    assert manifest["stats"]["rows_out"] + sum(manifest["stats"]["failed"].values()) == SHARDS * SHARD_SIZE


def test_answers_are_the_servers_ids_verbatim_and_masked_exactly(regenerated):
    import pyarrow.parquet as pq

    r = regenerated
    shard = load_shards(r.run.prepare)[1]
    rows = pq.read_table(shard_paths(r.plan.dir, shard)[0]).to_pylist()
    answers: dict[tuple[int, ...], list[list[int]]] = {}
    for prompt, out in r.calls:
        answers.setdefault(tuple(prompt), []).append(out["token_ids"])
    checked = 0
    for row in rows:
        spans = _spans(row["loss_mask"])
        assert spans, f"row {row['row']} has no generated token"
        for start, stop in spans:
            # Each masked run is exactly what the server returned for the ids before it: no token of the template
            # is masked, no generated token is left out, none re-tokenized.
            returned = answers.get(tuple(row["input_ids"][:start]))
            assert returned, f"row {row['row']}: the ids before {start} were never sent as a prompt"
            assert row["input_ids"][start:stop] in returned
            checked += 1
    assert checked >= len(rows)
    # The assembled dataset holds those rows as they are.
    out_shard = next(s for s in load_shards(r.plan.dir) if s.name == shard.name)
    assert load_dataset_rows(r.plan.dir, out_shard.start, out_shard.stop) == [row["input_ids"] for row in rows]


def test_a_direct_request_returns_the_same_ids(regenerated):
    import pyarrow.parquet as pq

    r = regenerated
    client = VllmServer(r.plan.server_dir).ensure(r.plan.spec, 60)
    rows = pq.read_table(shard_paths(r.plan.dir, load_shards(r.run.prepare)[0])[0]).to_pylist()
    for row in rows[:4]:
        start, stop = _spans(row["loss_mask"])[0]
        budget = r.config.regenerate.max_tokens
        out = client.generate(row["input_ids"][:start], budget, 0.0, 1.0, None, 60)
        assert out["token_ids"] == row["input_ids"][start:stop]


def test_one_server_serves_both_stages_and_writes_no_file_for_a_generation(regenerated):
    from flows.pipeline import pipeline_flow

    r = regenerated
    log = r.run.extract / "server.log"
    assert log.read_text(errors="replace").count("eyrie: starting vLLM") == 1
    assert not list(r.plan.staging.glob("*.safetensors")) and not list(r.plan.staging.glob("*.lock"))
    # The pipeline finds regeneration done (no request sent), then extracts on the server regeneration started.
    out = pipeline_flow(r.config, str(r.run.root), until="extract")
    assert log.read_text(errors="replace").count("eyrie: starting vLLM") == 1
    assert out["data"] == str(r.plan.dir / "dataset") and out["shards"] == len(load_shards(r.plan.dir))
    assert read_json(r.run.extract / "source.json") == {"stage": "regenerate"}
    assert not VllmServer(r.plan.server_dir).state  # stopped once extraction was done
    from safetensors.torch import load_file

    rows = load_dataset_rows(r.plan.dir, 0, 3)
    for i, ids in enumerate(rows):
        assert load_file(str(r.run.hidden_states / f"hs_{i}.safetensors"))["token_ids"].tolist() == ids


def test_held_out_prompts_are_never_regenerated_or_trained_on(regenerated):
    r = regenerated
    tok = shared_tokenizer(r.config.target)
    prompts = [_render(tok, p, True) for p in iter_eval_prompts(r.run.prepare)]
    assert prompts, "the test data holds nothing out: raise eval_fraction"
    rows = load_dataset_rows(r.plan.dir, 0, read_json(r.run.manifest("regenerate"))["num_samples"])
    sent = [prompt for prompt, _ in r.calls]
    for ids in prompts:
        assert not [i for i, row in enumerate(rows) if row[: len(ids)] == ids], "a held-out prompt is trained on"
        assert not [p for p in sent if p[: len(ids)] == ids], "a held-out prompt was sent for regeneration"
