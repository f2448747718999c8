from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from eyrie.config import PipelineConfig
from eyrie.stages.train.checkpoints import newest_whole_checkpoint
from eyrie.stages.train.data import TrainingData
from eyrie.stages.train.trainer import run_training, untrained_drafter
from tasks.caching import eyrie_task, stage_task

__all__ = [
    "TrainJob",
    "TrainingData",
    "UntrainedJob",
    "train_task",
    "untrained_drafter_task",
]  # TrainingData: flows build jobs from it


def watch_progress(save_path: Path, total_epochs: int, every_s: float = 10) -> threading.Event:
    """Move the UI's progress bar as speculators writes epoch checkpoints, from a thread, until the returned event
    is set. The thread runs in a copy of the caller's context: the bar then belongs to the caller's task run (a bare
    thread has no run context, and Prefect deprecates an artifact made outside one)."""
    stop = threading.Event()

    def watch() -> None:
        artifact = create_progress_artifact(0.0, description="train: epochs checkpointed")
        while not stop.wait(every_s):
            last = newest_whole_checkpoint(save_path)
            if last is not None:
                update_progress_artifact(artifact, min(100.0, 100.0 * (int(last.name) + 1) / total_epochs))

    threading.Thread(target=contextvars.copy_context().run, args=(watch,), daemon=True).start()
    return stop


@dataclass
class TrainJob:
    out_dir: str
    key: str
    data: TrainingData
    seq_lens: list[int]
    warm_start: str | None = None  # the drafter training starts from
    server_url: str | None = None  # train.hidden_states: online: the extraction server to train from


@dataclass
class UntrainedJob:
    out_dir: str
    key: str
    data: TrainingData


# retries resume from the newest checkpoint: the key (and so the checkpoint folder) is unchanged.
@stage_task("train", manifest="{job.out_dir}/manifest.json", argument="job.key", retries=1, retry_delay_seconds=5)
def train_task(config: PipelineConfig, job: TrainJob) -> dict:
    log = get_run_logger()
    stop = watch_progress(Path(job.out_dir) / job.key / "checkpoints", config.train.epochs)
    try:
        manifest = run_training(
            config,
            Path(job.out_dir),
            job.key,
            job.data,
            job.seq_lens,
            Path(job.warm_start) if job.warm_start else None,
            log=log.info,
            server_url=job.server_url,
        )
    finally:
        stop.set()
    if manifest["history"]:
        create_table_artifact(manifest["history"], key="training-metrics", description="validation metrics per epoch")
    return manifest


@eyrie_task("untrained-drafter")
def untrained_drafter_task(config: PipelineConfig, job: UntrainedJob) -> str:
    return str(untrained_drafter(config, Path(job.out_dir), job.key, job.data))
