from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger

from eyrie.errors import DiskFullError
from eyrie.stages.extract.shard import extract_shard
from eyrie.stages.prepare import Shard
from eyrie.vllm.client import ServerClient
from tasks.caching import eyrie_task, keyed_task
from tasks.progress import report_rows


@dataclass
class ExtractShardJob:
    """One shard's extraction: what it reads, where it writes, and how (the extraction plan's settings for it).
    Plain fields (strings, numbers, the shard), so it is JSON as a task parameter."""

    shard: Shard
    key: str  # the shard's key (its cache identity)
    prepare_dir: str  # the data extraction reads (prepared or regenerated)
    hidden_dir: str
    manifest_path: str
    num_layers: int  # captured layers
    hidden_size: int
    concurrency: int
    timeout_s: float
    api_key_env: str | None = None
    rehash_changed: bool = True
    hidden_states_dtype: str = "bfloat16"
    storage: str = "files"
    sample_key: str | None = None  # what each file records it was made under (eyrie.stages.extract.plan.sample_key)


def _worth_retrying(task, task_run, state) -> bool:
    return not isinstance(state.data, DiskFullError)  # nothing changes in 5 s until someone frees space


@keyed_task(
    "extract",
    argument="job.key",
    task_run_name="extract-{job.shard.name}",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=_worth_retrying,
)
def extract_shard_task(job: ExtractShardJob, base_url: str | None) -> dict:
    log = get_run_logger()
    # No server: the shard must be complete on disk already; extract_shard returns its manifest after the same stat
    # check the flow made, or fails if it is not (the flow submits only pending shards, with a server).
    client = (
        ServerClient(base_url, os.environ.get(job.api_key_env) if job.api_key_env else None, max(10, job.concurrency))
        if base_url
        else None
    )

    def progress(done: int, total: int) -> None:  # counted for the stage's one progress artifact (tasks/progress.py)
        report_rows("extraction", job.shard.name, done, total)

    manifest = extract_shard(
        client,
        Path(job.prepare_dir),
        job.shard,
        job.key,
        Path(job.hidden_dir),
        Path(job.manifest_path),
        job.num_layers,
        job.hidden_size,
        job.concurrency,
        job.timeout_s,
        progress=progress,
        log=log.info,
        rehash_changed=job.rehash_changed,
        hidden_states_dtype=job.hidden_states_dtype,
        storage=job.storage,
        sample_key=job.sample_key,
    )
    log.info(f"{job.shard.name}: {manifest['extracted_samples']} extracted, {manifest['reused_samples']} reused")
    return {k: v for k, v in manifest.items() if k != "files"}


@eyrie_task("prove-capture")
def prove_capture_task(
    config, report: dict, run_dir: str, source_dir: str, server_dir: str, max_model_len: int, base_url: str
) -> dict:
    """The capture proof on the extraction server at `base_url`, before its first shard
    (eyrie.hidden_states.proof): a refusal fails the task with the reason; a pass leaves its figures in
    `<run>/extract/capture/proof.json`."""
    from eyrie.hidden_states.check import FOLDER, context_for
    from eyrie.run.folder import RunFolder
    from eyrie.stages.extract.proof import prove_server
    from eyrie.stages.preflight import PreflightReport
    from eyrie.vllm.process import VllmServer

    api_key_env = config.extraction.api_key_env
    client = ServerClient(base_url, os.environ.get(api_key_env) if api_key_env else None)
    return prove_server(
        context_for(config, PreflightReport(**report)),
        Path(source_dir),
        RunFolder(run_dir).extract / FOLDER,
        VllmServer(Path(server_dir)).state,
        client,
        max_model_len,
        config.extraction.request_timeout_s,
        log=get_run_logger().info,
    )
