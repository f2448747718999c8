from __future__ import annotations

import base64
import contextvars
import threading
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import (
    create_image_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from eyrie.config import PipelineConfig
from eyrie.stages.train.data import TrainingData
from eyrie.stages.train.progress import LiveTraining
from eyrie.stages.train.trainer import run_training, untrained_drafter
from tasks.caching import eyrie_task, stage_task

__all__ = [
    "TrainJob",
    "TrainingData",
    "UntrainedJob",
    "train_task",
    "untrained_drafter_task",
]  # TrainingData: flows build jobs from it


def watch_training(work: Path, log, every_s: float = 10, refresh_s: float = 180) -> threading.Event:
    """Show the training while it runs (eyrie/stages/train/progress.py reads the trainer's metrics file): the
    progress bar by step, a log line about every minute and at each validation, and every `refresh_s` (and at each
    validation) the `training-metrics` table and the `training-loss-curve` image. From a thread that polls until the
    returned event is set, then once more. The thread runs in a copy of the caller's context: the artifacts then
    belong to the caller's task run (a bare thread has no run context, and Prefect deprecates an artifact made
    outside one)."""
    stop = threading.Event()
    live = LiveTraining(work, refresh_s=refresh_s)

    def show(update) -> None:
        if update.percent is not None:
            update_progress_artifact(bar, update.percent)
        for line in update.lines:
            log(f"train: {line}")
        if update.table:
            create_table_artifact(update.table, key="training-metrics", description=TABLE)
        if update.curve:
            create_image_artifact(
                "data:image/png;base64," + base64.b64encode(update.curve).decode(),
                key="training-loss-curve",
                description="train loss by step, validation loss per epoch, and per-position training accuracy",
            )

    def watch() -> None:
        while not stop.wait(every_s):
            try:
                show(live.poll())
            except Exception as err:  # the view must never fail the training
                log(f"train: the live view could not be updated ({err})")
        try:
            show(live.poll(final=True))
        except Exception as err:
            log(f"train: the live view could not be updated ({err})")
        done.set()

    bar = create_progress_artifact(0.0, description="train: steps")
    done = threading.Event()
    threading.Thread(target=contextvars.copy_context().run, args=(watch,), daemon=True).start()
    stop.done = done  # type: ignore[attr-defined]
    return stop


TABLE = "per epoch: train loss (mean of the logged steps), tokens/s, validation loss and per-position accuracy"


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
    stop = watch_training(Path(job.out_dir) / job.key, log.info)
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
        stop.done.wait(60)  # type: ignore[attr-defined]  # its last poll: the bar and the curve at the end
    if manifest["history"]:  # the checkpoints' validation (every epoch's, a resumed run's too) and the train loss
        create_table_artifact(manifest["history"], key="training-metrics", description=TABLE)
    return manifest


@eyrie_task("untrained-drafter")
def untrained_drafter_task(config: PipelineConfig, job: UntrainedJob) -> str:
    return str(untrained_drafter(config, Path(job.out_dir), job.key, job.data))
