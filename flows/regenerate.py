"""The regeneration flow: the target answers every prepared conversation again, one task per shard, on the
extraction server (started only if some shard lacks its manifest). The pipeline keeps that server up for extraction,
which reuses it: the target loads once for both stages."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from eyrie.config import PipelineConfig
from eyrie.errors import RegenerationError
from eyrie.run.folder import RunFolder, node_name
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.regenerate import RegenerationPlan
from flows.sharded import ShardedStage, ShardServer, run_sharded_stage
from tasks.regenerate import RegenerateShardJob, assemble_task, regenerate_shard_task


@flow(name="eyrie-regenerate", task_runner=ThreadPoolTaskRunner(max_workers=2))
def regenerate_flow(config: PipelineConfig, run_dir: str, report: dict, keep_server: bool = False) -> dict:
    """Regenerate every shard of a prepared run folder and assemble the result; `report` is preflight's. With
    `keep_server`, a server this run started stays up (extraction comes next and reuses it)."""
    log = get_run_logger()
    run = RunFolder(run_dir)
    plan = RegenerationPlan(config, run, PreflightReport(**report), node=node_name())
    pending = {s.name for s in plan.pending()}
    log.info(f"{len(plan.shards)} shards, {len(pending)} to regenerate")

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

    server_up = run_sharded_stage(
        ShardedStage(
            name="regeneration",
            shards=plan.shards,
            pending=pending,
            server=ShardServer.of(plan, config.extraction.startup_timeout_s),
            submit=submit,
            is_complete=plan.is_complete,
            error=RegenerationError,
            keep_server_after_failure=config.extraction.keep_server_after_failure,
        ),
        keep_server=keep_server,
    )
    manifest = assemble_task(str(plan.dir), str(run.prepare), plan.shards, plan.keys, plan.key, config)
    return {
        "key": plan.key,
        "dataset": str(plan.dir / "dataset"),
        "regenerated": sorted(pending),
        "stats": manifest["stats"],
        "server_up": server_up,
        "server_dir": str(plan.server_dir),
    }
