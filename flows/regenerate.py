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
from eyrie.vllm.process import VllmServer
from flows.extract import run_shards, start_server
from tasks.extract import start_server_task, stop_server_task
from tasks.regenerate import assemble_task, regenerate_shard_task


@flow(name="eyrie-regenerate", task_runner=ThreadPoolTaskRunner(max_workers=2))
def regenerate_flow(config: PipelineConfig, run_dir: str, report: dict, keep_server: bool = False) -> dict:
    """Regenerate every shard of a prepared run folder and assemble the result; `report` is preflight's. With
    `keep_server`, a server this run started stays up (extraction comes next and reuses it)."""
    log = get_run_logger()
    run = RunFolder(run_dir)
    plan = RegenerationPlan(config, run, PreflightReport(**report), node=node_name())
    pending = {s.name for s in plan.pending()}
    log.info(f"{len(plan.shards)} shards, {len(pending)} to regenerate")
    server = VllmServer(plan.server_dir)
    timeout_s = config.extraction.startup_timeout_s
    base_url = start_server(plan, server, timeout_s) if pending else None

    def submit(todo, url):
        return [
            (
                shard,
                regenerate_shard_task.with_options(refresh_cache=shard.name in pending).submit(
                    shard, plan.keys[shard.name], url, config, str(run.prepare), str(plan.dir)
                ),
            )
            for shard in todo
        ]

    def restart() -> str:
        return start_server_task(plan.spec, str(plan.server_dir), timeout_s)

    failed = run_shards(submit, plan.shards, base_url, server, restart if pending else None)
    missing = [s.name for s in plan.shards if not plan.is_complete(s)]
    if failed or missing:
        if pending and not config.extraction.keep_server_after_failure:
            stop_server_task(str(plan.server_dir))
        raise RegenerationError(
            f"regeneration incomplete: {len(missing)} of {len(plan.shards)} shards lack a finished manifest "
            f"({', '.join(missing[:10])}); failures: {'; '.join(list(failed.values())[:5])}. Run again (or retry "
            "the flow run): finished shards are kept."
        )
    manifest = assemble_task(str(plan.dir), str(run.prepare), plan.shards, plan.keys, plan.key, config)
    server_up = bool(pending)
    if pending and not keep_server:
        stop_server_task(str(plan.server_dir))
        server_up = False
    return {
        "key": plan.key,
        "dataset": str(plan.dir / "dataset"),
        "regenerated": sorted(pending),
        "stats": manifest["stats"],
        "server_up": server_up,
        "server_dir": str(plan.server_dir),
    }
