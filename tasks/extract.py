from __future__ import annotations

import os
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from eyrie.errors import DiskFullError
from eyrie.extract import extract_shard
from eyrie.prepare import Shard
from eyrie.server import ExtractionServer, ServerClient, ServerSpec
from tasks.caching import BY_KEY


@task(name="start-server", retries=1, retry_delay_seconds=5)
def start_server_task(spec: ServerSpec, folder: str, startup_timeout_s: float) -> str:
    """Start (or reuse) the extraction server; returns its base URL."""
    log = get_run_logger()
    return ExtractionServer(Path(folder)).ensure(spec, startup_timeout_s, log=log.info).base_url


@task(name="stop-server")
def stop_server_task(folder: str) -> bool:
    return ExtractionServer(Path(folder)).stop(log=get_run_logger().info)


def _worth_retrying(task, task_run, state) -> bool:
    return not isinstance(state.data, DiskFullError)  # nothing changes in 5 s until someone frees space


@task(
    name="extract",
    task_run_name="extract-{shard.name}",
    cache_policy=BY_KEY,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=_worth_retrying,
)
def extract_shard_task(
    shard: Shard,
    key: str,
    base_url: str | None,
    api_key_env: str | None,
    prepare_dir: str,
    hidden_dir: str,
    manifest_path: str,
    num_layers: int,
    hidden_size: int,
    concurrency: int,
    timeout_s: float,
    verify_checksums: bool = True,
) -> dict:
    log = get_run_logger()
    if base_url is None:
        raise RuntimeError(f"{shard.name} has no complete manifest but no server was started for it")
    client = ServerClient(base_url, os.environ.get(api_key_env) if api_key_env else None, max(10, concurrency))
    artifact = create_progress_artifact(0.0, description=f"extract {shard.name}")
    shown = [0.0]

    def progress(done: int, total: int) -> None:
        pct = 100.0 * done / max(total, 1)
        if pct - shown[0] >= 5 or done == total:  # one API call per 5%, not per sample
            shown[0] = pct
            update_progress_artifact(artifact, pct)

    manifest = extract_shard(
        client,
        Path(prepare_dir),
        shard,
        key,
        Path(hidden_dir),
        Path(manifest_path),
        num_layers,
        hidden_size,
        concurrency,
        timeout_s,
        progress=progress,
        log=log.info,
        verify_checksums=verify_checksums,
    )
    log.info(f"{shard.name}: {manifest['extracted_samples']} extracted, {manifest['reused_samples']} reused")
    return {k: v for k, v in manifest.items() if k != "files"}
