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
from eyrie.stages.extract import ExtractionPlan, clean_staging
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.prepare import load_shards
from eyrie.stages.regenerate import extraction_source, record_extraction_source
from eyrie.vllm.process import VllmServer
from tasks.extract import extract_shard_task, start_server_task, stop_server_task
from tasks.preflight import preflight_task


def shard_failures(submitted) -> dict:
    """Wait for every (shard, future) pair; each shard fails on its own, and all their errors are reported."""
    out = {}
    for shard, fut in submitted:
        try:
            fut.result()
        except Exception as err:
            out[shard.name] = f"{shard.name}: {err}"
    return out


def start_server(plan, server, startup_timeout_s: float) -> str:
    """The shards' server, started unless it runs; one that does not run leaves staging files nobody will read.
    `plan`: an extraction or regeneration plan (its server folder, staging folder and spec)."""
    removed = clean_staging(plan.staging) if not server.healthy() else 0
    if removed:
        get_run_logger().info(f"removed {removed} orphaned staging files")
    return start_server_task(plan.spec, str(plan.server_dir), startup_timeout_s)


def run_shards(submit, shards, url: str | None, server, restart) -> dict:
    """`submit(shards, url)` and wait; when shards failed because the server died under them (killed, OOM) and
    `restart` is given, start it once more (`restart()` -> its URL) and redo only those: their finished work on disk
    is kept. Returns the failures left, by shard name."""
    failed = shard_failures(submit(shards, url))
    if failed and restart is not None and not server.healthy():
        get_run_logger().warning(f"the vLLM server died ({len(failed)} shards failed); restarting it once")
        failed = shard_failures(submit([s for s in shards if s.name in failed], restart()))
    return failed


@flow(name="eyrie-extract", task_runner=ThreadPoolTaskRunner(max_workers=2))
def extract_flow(
    config: PipelineConfig, run_dir: str, report: dict | None = None, shards: list[str] | None = None
) -> dict:
    """Extract the shards of a prepared run folder: all of them, or only those named in `shards` (one node's share);
    `report` is preflight's (run here when not given)."""
    log = get_run_logger()
    run = RunFolder(run_dir)
    if report is None:
        report = preflight_task(config, run_dir)
    # A node given a share may have neighbours on the same run folder: then its server needs a folder of its own.
    node = node_name(default=socket.gethostname() if shards is not None else None)
    # The regenerated data when regeneration is on, else the prepared data: recorded for status and verify.
    source = extraction_source(run, config)
    record_extraction_source(run, source)
    plan = ExtractionPlan(config, run, PreflightReport(**report), load_shards(source), node=node)
    if not plan.shards:
        raise ExtractionError(f"{source / 'shards.json'} lists no shards: run the {source.name} stage first")
    if shards is not None:
        plan.select(shards)
    # Stat only for unchanged files: a cached run reads no hidden-state bytes (see eyrie.stages.extract.shard_complete).
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
    if not pending:
        # Every shard's manifest holds and its files check out by stat: no task per shard. (With 800 shards,
        # Prefect's bookkeeping of cached shard tasks alone took 10 s of a fully cached run.)
        return outcome
    server = VllmServer(plan.server_dir)
    timeout_s = config.extraction.startup_timeout_s
    base_url = start_server(plan, server, timeout_s)

    def submit(todo, url):
        return [
            (
                shard,
                extract_shard_task.with_options(refresh_cache=shard.name in pending).submit(
                    shard,
                    plan.keys[shard.name],
                    url,
                    config.extraction.api_key_env,
                    str(source),
                    str(run.hidden_states),
                    str(plan.manifest_path(shard)),
                    len(plan.captured_ids),
                    plan.hidden_size,
                    config.extraction.concurrency,
                    config.extraction.request_timeout_s,
                    rehash,
                    plan.hidden_states_dtype,
                    plan.storage,
                ),
            )
            for shard in todo
        ]

    # A restarted server's shards keep their valid samples on disk: only the missing ones are sent again.
    def restart() -> str:
        return start_server_task(plan.spec, str(plan.server_dir), timeout_s)

    failed = list(run_shards(submit, plan.shards, base_url, server, restart).values())
    # A success must never leave samples missing: re-check the manifests of the shards that ran against their files.
    # The others were found complete when this flow began and nothing here wrote to them (a task that found one
    # incomplete failed above): a second stat of every file, about 1 s per 100,000 files, would add nothing.
    missing = [s.name for s in plan.shards if s.name in pending and not plan.is_complete(s)]
    if failed or missing:
        if pending and not config.extraction.keep_server_after_failure:
            stop_server_task(str(plan.server_dir))
        raise ExtractionError(
            f"extraction incomplete: {len(set(missing))} of {len(plan.shards)} shards lack a "
            f"complete manifest ({', '.join(missing[:10])}); failures: {'; '.join(failed[:5])}. "
            "Run again (or retry the flow run): finished shards are kept."
        )
    if pending:
        stop_server_task(str(plan.server_dir))
        # Every request of this run has been answered and moved out of staging, and the server is down: what is
        # left there was written for a client that died (a killed earlier run whose server this run reused).
        removed = clean_staging(plan.staging)
        if removed:
            log.info(f"removed {removed} orphaned staging files")
    return outcome


@flow(name="eyrie-extract", task_runner=ThreadPoolTaskRunner(max_workers=2))
def extract_run_flow(config: PipelineConfig, run_dir: str, report: dict | None = None) -> dict:
    """Extraction alone (the eyrie-extract/production deployment): every shard of a prepared run folder, holding
    the run folder's lock as the pipeline does, so it never writes beside a pipeline run or another extraction on
    the same folder. (The pipeline runs `extract_flow` under its own lock; a fan-out node's share runs under its
    parent's.)"""
    with RunFolder(run_dir).lock():
        return extract_flow(config, run_dir, report)
