from __future__ import annotations

import os
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from eyrie.errors import DiskFullError
from eyrie.stages.extract import extract_shard
from eyrie.stages.prepare import Shard
from eyrie.vllm.client import ServerClient
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec
from tasks.caching import BY_KEY


@task(name="start-server", retries=1, retry_delay_seconds=5)
def start_server_task(spec: ServerSpec, folder: str, startup_timeout_s: float) -> str:
    """Start (or reuse) the extraction server; returns its base URL."""
    log = get_run_logger()
    return VllmServer(Path(folder)).ensure(spec, startup_timeout_s, log=log.info).base_url


@task(name="stop-server")
def stop_server_task(folder: str) -> bool:
    return VllmServer(Path(folder)).stop(log=get_run_logger().info)


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
    rehash_changed: bool = True,
    hidden_states_dtype: str = "bfloat16",
    storage: str = "files",
) -> dict:
    log = get_run_logger()
    # No server: the flow found this shard complete and Prefect had no cache record of it (a new PREFECT_HOME or
    # result storage); extract_shard returns its manifest after the same stat check, or fails if it is not.
    client = (
        ServerClient(base_url, os.environ.get(api_key_env) if api_key_env else None, max(10, concurrency))
        if base_url
        else None
    )
    shown = [0.0]
    artifact = create_progress_artifact(0.0, description=f"extract {shard.name}") if client else None

    def progress(done: int, total: int) -> None:
        pct = 100.0 * done / max(total, 1)
        if artifact and (pct - shown[0] >= 5 or done == total):  # one API call per 5%, not per sample
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
        rehash_changed=rehash_changed,
        hidden_states_dtype=hidden_states_dtype,
        storage=storage,
    )
    log.info(f"{shard.name}: {manifest['extracted_samples']} extracted, {manifest['reused_samples']} reused")
    return {k: v for k, v in manifest.items() if k != "files"}
