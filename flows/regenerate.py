"""The regeneration flow: the target answers every prepared conversation again, one task per shard, on the
extraction server (started only if some shard lacks its manifest). The pipeline keeps that server up for extraction,
which reuses it: the target loads once for both stages."""

from __future__ import annotations

import socket

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from eyrie.config import PipelineConfig, RegenerateConfig
from eyrie.errors import RegenerationError
from eyrie.run.folder import RunFolder, node_name
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.regenerate.plan import RegenerationPlan
from flows.cancel import stop_on_cancellation
from flows.extract import proved_first
from flows.sharded import ShardedStage, ShardServer, run_sharded_stage
from flows.shares import node_share
from tasks.regenerate import RegenerateShardJob, assemble_task, regenerate_shard_task


@flow(name="eyrie-regenerate", task_runner=ThreadPoolTaskRunner(max_workers=2), on_cancellation=[stop_on_cancellation])
def regenerate_flow(
    config: PipelineConfig, run_dir: str, report: dict, keep_server: bool = False, shards: list[str] | None = None
) -> dict:
    """Regenerate every shard of a prepared run folder and assemble the result; `report` is preflight's. With
    `keep_server`, a server this run started stays up (extraction comes next and reuses it).

    Given `shards` (one node's share of a fan-out, flows/fanout.py), only those, on this node's own server in
    `<run>/extract/nodes/<node>/` (the server the node's extraction share reuses), under locks of the share's own
    (flows/shares.py); the fan-out's parent assembles once every node is done."""
    run = RunFolder(run_dir)
    if shards is None:  # the whole folder, under the lock of the run that called it (the pipeline)
        return _regenerate(config, run, report, keep_server, None, node_name())
    node = node_name(default=socket.gethostname())
    with node_share(run, "regenerate", shards, node):
        return _regenerate(config, run, report, keep_server, shards, node)


def _regenerate(
    config: PipelineConfig, run: RunFolder, report: dict, keep_server: bool, share: list[str] | None, node: str | None
) -> dict:
    log = get_run_logger()
    plan = RegenerationPlan(config, run, PreflightReport(**report), node=node)
    shards = plan.shards
    if share is not None:
        unknown = sorted(set(share) - {s.name for s in shards})
        if unknown:
            raise RegenerationError(f"shards {unknown} are not in {run.prepare / 'shards.json'}")
        shards = [s for s in shards if s.name in set(share)]
    pending = {s.name for s in plan.pending() if share is None or s.name in set(share)}
    log.info(
        f"{len(shards)} shards, {len(pending)} to regenerate"
        + (f" on node {node} (server folder {plan.server_dir})" if share is not None else "")
    )

    def submit(todo, url):
        return [
            (
                s,
                regenerate_shard_task.with_options(refresh_cache=True).submit(
                    RegenerateShardJob(s, plan.keys[s.name], str(run.prepare), str(plan.dir)), url, config
                ),
            )
            for s in todo
        ]

    server = ShardServer.of(plan, config.extraction.startup_timeout_s)
    keep = config.extraction.keep_server_after_failure
    # The extraction server's capture proved before its first shard (flows/extract.py)
    proved = proved_first(submit, config, report, run, run.prepare, plan, server, keep, {})
    server_up = run_sharded_stage(
        ShardedStage(
            name="regeneration",
            shards=shards,
            pending=pending,
            server=server,
            submit=proved,
            is_complete=plan.is_complete,
            error=RegenerationError,
            keep_server_after_failure=config.extraction.keep_server_after_failure,
        ),
        keep_server=keep_server,
    )
    outcome = {"regenerated": sorted(pending), "server_up": server_up, "server_dir": str(plan.server_dir)}
    if share is not None:
        return {**outcome, "node": node, "shards": [s.name for s in shards]}
    return {**assemble(config.regenerate, run, plan), **outcome}


def assemble(regenerate: RegenerateConfig, run: RunFolder, plan: RegenerationPlan) -> dict:
    """Assemble every regenerated shard into the stage's dataset (the pipeline after its shards, a fan-out's parent
    once every node is done). Read after the shards ran: `plan.key` counts the rows they lost."""
    manifest = assemble_task(str(plan.dir), str(run.prepare), plan.shards, plan.keys, plan.key, regenerate)
    # Its warnings (rows lost to server errors) reach the run's summary even when the assembly is a cache hit.
    warnings = manifest.get("warnings", [])
    return {"key": plan.key, "dataset": str(plan.dir / "dataset"), "stats": manifest["stats"], "warnings": warnings}
