"""The extraction flow: start vLLM only if some shard lacks a complete manifest, one task per shard.

Run alone or as the pipeline's subflow it extracts every shard, with its server in `<run>/extract/`. Run by the
fan-out (flows/fanout.py) on one of several nodes it extracts the `shards` it is given, with this node's own server in
`<run>/extract/nodes/<node>/` ($EYRIE_NODE_NAME, else the host name): servers of different nodes never share a
folder, and each node loads its target once for all of its shards.
"""

from __future__ import annotations

import socket

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from eyrie.config import PipelineConfig
from eyrie.errors import ExtractionError
from eyrie.run.folder import RunFolder, node_name
from eyrie.stages.extract.plan import ExtractionPlan
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.prepare import load_shards
from eyrie.stages.regenerate.source import extraction_source, record_extraction_source
from flows.cancel import stop_on_cancellation
from flows.sharded import ShardedStage, ShardServer, run_sharded_stage
from flows.shares import node_share
from tasks.extract import ExtractShardJob, extract_shard_task, prove_capture_task
from tasks.preflight import preflight_task


@flow(name="eyrie-extract", task_runner=ThreadPoolTaskRunner(max_workers=2), on_cancellation=[stop_on_cancellation])
def extract_flow(
    config: PipelineConfig, run_dir: str, report: dict | None = None, shards: list[str] | None = None
) -> dict:
    """Extract the shards of a prepared run folder: all of them, or only those named in `shards` (one node's share);
    `report` is preflight's (run here when not given)."""
    run = RunFolder(run_dir)
    if shards is None:  # the whole folder: under the lock of the run that called it (the pipeline, extract_run_flow)
        return _extract(config, run, report, None, node_name())
    # A node given a share may have neighbours on the same run folder: then its server needs a folder of its own.
    # Its shards and that folder are locked by this flow run itself (flows/shares.py), not by its parent alone.
    node = node_name(default=socket.gethostname())
    with node_share(run, "extract", shards, node):
        return _extract(config, run, report, shards, node)


def _extract(
    config: PipelineConfig, run: RunFolder, report: dict | None, shards: list[str] | None, node: str | None
) -> dict:
    log = get_run_logger()
    run_dir = str(run.root)
    if report is None:
        report = preflight_task(config, run_dir)
    # The regenerated data when regeneration is on, else the prepared data: recorded for status and verify.
    source = extraction_source(run, config.regenerate)
    record_extraction_source(run, source)
    plan = ExtractionPlan(config, run, PreflightReport(**report), load_shards(source), node=node)
    if not plan.shards:
        raise ExtractionError(f"{source / 'shards.json'} lists no shards: run the {source.name} stage first")
    if shards is not None:
        plan.select(shards)
    # Stat only for unchanged files: a cached run reads no hidden-state bytes
    # (see eyrie.stages.extract.manifest.shard_complete).
    rehash = config.extraction.verify_checksums
    pending = {s.name for s in plan.pending(rehash)}
    log.info(
        f"{len(plan.shards)} shards, {len(pending)} to extract"
        + (f" on node {node} (server folder {plan.server_dir})" if node else "")
    )
    outcome = {
        "shards": len(plan.shards),
        "extracted": sorted(pending),
        "hidden_states": str(run.hidden_states),
        "keys": [plan.keys[s.name] for s in plan.shards],
        "data_keys": [plan.data_keys[s.name] for s in plan.shards],  # what training keys on
        "node": node,
    }
    # With nothing pending no server starts and no task runs: every shard's manifest holds and its files check out
    # by stat. (With 800 shards, Prefect's bookkeeping of cached shard tasks alone took 10 s of a fully cached run.)
    jobs = {
        s.name: ExtractShardJob(
            shard=s,
            key=plan.keys[s.name],
            prepare_dir=str(source),
            hidden_dir=str(run.hidden_states),
            manifest_path=str(plan.manifest_path(s)),
            num_layers=len(plan.captured_ids),
            hidden_size=plan.hidden_size,
            concurrency=config.extraction.concurrency,
            timeout_s=config.extraction.request_timeout_s,
            api_key_env=config.extraction.api_key_env,
            rehash_changed=rehash,
            hidden_states_dtype=plan.hidden_states_dtype,
            storage=plan.storage,
            sample_key=plan.sample_key,
        )
        for s in plan.shards
        if s.name in pending
    }

    def submit(todo, url):
        # Pending: whatever Prefect recorded for its key is not trusted (its files are not whole).
        return [(s, extract_shard_task.with_options(refresh_cache=True).submit(jobs[s.name], url)) for s in todo]

    server = ShardServer.of(plan, config.extraction.startup_timeout_s)
    proof: dict = {}
    submit = proved_first(
        submit, config, report, run, source, plan, server, config.extraction.keep_server_after_failure, proof
    )

    if shards is not None and not pending:
        # A node's server kept up by its regeneration share for this one: nothing to extract here, so it stops.
        ShardServer.of(plan, config.extraction.startup_timeout_s).stop()
    # A success rechecks the shards that ran; the others were found complete when this flow began and nothing here
    # wrote to them: a second stat of every file, about 1 s per 100,000 files, would add nothing.
    run_sharded_stage(
        ShardedStage(
            name="extraction",
            shards=plan.shards,
            pending=pending,
            server=server,
            submit=submit,
            is_complete=plan.is_complete,
            error=ExtractionError,
            keep_server_after_failure=config.extraction.keep_server_after_failure,
        )
    )
    if proof:
        outcome["capture_proof"] = proof
        outcome["warnings"] = list(proof.get("warnings", []))  # aux layers the proof could not recompute
    return outcome


def proved_first(submit, config, report, run, source, plan, server, keep_server_after_failure, figures: dict):
    """`submit` that first proves the capture of each server it is handed (eyrie.hidden_states.proof), before any
    shard reaches it: a refusal stops the server (unless the config keeps it) and fails the stage within minutes of
    the load, with nothing extracted. The proof's figures go to `figures` (and `capture/proof.json`)."""
    proved: set[str] = set()

    def proving(todo, url):
        if url not in proved and todo:
            try:
                figures.update(
                    prove_capture_task(
                        config, report, str(run.root), str(source), str(plan.server_dir), plan.spec.max_model_len, url
                    )
                )
            except Exception:
                if not keep_server_after_failure:
                    server.stop()
                raise
            proved.add(url)
        return submit(todo, url)

    return proving


def prove_online_server(config, report, run, source, plan, url: str) -> list[str]:
    """The online trainer's extraction server proved as extraction's are (`proved_first`), before the trainer asks
    it for its first sample: a refusal stops the server (unless the config keeps it) and fails the run. Returns the
    proof's warnings (aux layers it could not recompute), for the run's own."""
    from eyrie.vllm.process import VllmServer

    try:
        figures = prove_capture_task(
            config, report, str(run.root), str(source), str(plan.server_dir), plan.spec.max_model_len, url
        )
    except Exception:
        if not config.extraction.keep_server_after_failure:
            VllmServer(plan.server_dir).stop()
        raise
    return list(figures.get("warnings", []))


@flow(name="eyrie-extract", task_runner=ThreadPoolTaskRunner(max_workers=2), on_cancellation=[stop_on_cancellation])
def extract_run_flow(config: PipelineConfig, run_dir: str, report: dict | None = None) -> dict:
    """Extraction alone (the eyrie-extract/production deployment): every shard of a prepared run folder, holding
    the run folder's lock as the pipeline does, so it never writes beside a pipeline run or another extraction on
    the same folder. (The pipeline runs `extract_flow` under its own lock; a fan-out node's share holds locks of
    its own: flows/shares.py.)"""
    with RunFolder(run_dir).lock():
        return extract_flow(config, run_dir, report)
