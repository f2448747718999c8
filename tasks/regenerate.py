from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact

from eyrie.config import PipelineConfig, RegenerateConfig
from eyrie.errors import RegenerationError
from eyrie.run.files import read_json
from eyrie.stages.prepare import Shard
from eyrie.stages.regenerate.assemble import assemble
from eyrie.stages.regenerate.conversation import shared_tokenizer, template_mix
from eyrie.stages.regenerate.shard import regenerate_shard, shard_complete, shard_paths
from eyrie.vllm.client import ServerClient
from tasks.caching import keyed_task, stage_task
from tasks.progress import report_rows


@dataclass
class RegenerateShardJob:
    """One shard's regeneration: its conversations (in `prepare_dir`), where its rows go (`stage_dir`), its key."""

    shard: Shard
    key: str
    prepare_dir: str
    stage_dir: str


@keyed_task(
    "regenerate", argument="job.key", task_run_name="regenerate-{job.shard.name}", retries=2, retry_delay_seconds=5
)
def regenerate_shard_task(job: RegenerateShardJob, base_url: str | None, config: PipelineConfig) -> dict:
    shard, key, stage_dir = job.shard, job.key, Path(job.stage_dir)
    if base_url is None:
        # The disk before the server: a shard complete there needs none (its Prefect record may be gone).
        if shard_complete(stage_dir, shard, key):
            return read_json(shard_paths(stage_dir, shard)[1]) or {}
        raise RegenerationError(
            f"{shard.name} has no finished manifest in {stage_dir / 'shards'} and no server was started for it: "
            "run the regenerate stage again (it starts the server for the shards it finds pending)"
        )
    log = get_run_logger()
    cfg = config.regenerate
    api_key_env = config.extraction.api_key_env
    api_key = os.environ.get(api_key_env) if api_key_env else None
    # Its own client, as every shard task: clients of one server share its window of requests (the window module)
    client = ServerClient(base_url, api_key)

    def progress(done: int, total: int) -> None:  # counted for the stage's one progress artifact (tasks/progress.py)
        report_rows("regeneration", shard.name, done, total)

    manifest = regenerate_shard(
        client,
        shared_tokenizer(config.target),
        Path(job.prepare_dir),
        stage_dir,
        shard,
        key,
        cfg,
        config.data.max_length,
        progress=progress,
        variants=template_mix(config.regenerate, config.evaluate),
    )
    s = manifest["stats"]
    log.info(
        f"{shard.name}: {s['rows_out']} of {s['rows_in']} conversations regenerated ({s['generated_tokens']} tokens"
        f", {manifest['generated_tokens_per_s']} tokens/s), {s['length_capped']} length-capped"
        + (f", failed: {s['failed']}" if s["failed"] else "")
    )
    if lost := manifest.get("server_error_rows"):
        log.warning(f"{shard.name}: {len(lost)} conversations lost to server errors; the next run retries them")
    return manifest


@stage_task("regenerate-assemble", manifest="{stage_dir}/manifest.json", retries=1)
def assemble_task(
    stage_dir: str, prepare_dir: str, shards: list[Shard], keys: dict[str, str], key: str, regenerate: RegenerateConfig
) -> dict:
    manifest = assemble(Path(stage_dir), Path(prepare_dir), shards, keys, key, regenerate)
    stats = manifest["stats"]
    rows = [{"measure": k, "value": v} for k, v in stats.items() if not isinstance(v, dict)]
    rows += [{"measure": f"failed: {k}", "value": v} for k, v in stats["failed"].items()]
    rows += [{"measure": f"temperature {k}", "value": v} for k, v in stats["temperatures"].items()]
    create_table_artifact(
        rows, key="regeneration-statistics", description="regenerate: conversations answered, capped and failed"
    )
    for warning in manifest.get("warnings", []):  # rows lost to server errors (the run summary lists them too)
        get_run_logger().warning(warning)
    return manifest
