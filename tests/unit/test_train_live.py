"""Training watched while it runs (eyrie/stages/train/progress.py): the trainer's metrics file, what the UI makes of
it (progress by step, log lines, the table with train and validation loss, the loss curve), what `eyrie status`
says about a training without a manifest, and `train.loggers` passing speculators' own loggers through."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TARGET_FACTS as FACTS
from conftest import config_dict

from eyrie.config import parse_config
from eyrie.errors import ConfigError, EyrieError
from eyrie.ops.status import format_status, loading_phase, run_status
from eyrie.run.files import atomic_write_json
from eyrie.run.folder import RunFolder
from eyrie.stages.train.command import logger_environment, missing_loggers, trainer_environment, training_command
from eyrie.stages.train.data import TrainingData
from eyrie.stages.train.progress import (
    METRICS,
    METRICS_FLAG,
    TRAINER,
    LiveTraining,
    Metrics,
    describe,
    read_rows,
    record_launch,
    record_metrics,
)


def _step(step: int, epoch: int, loss: float, acc=(0.5, 0.25), tps: float = 1000.0) -> dict:
    row = {"time": time.time(), "step": step, "epoch": epoch, "global_step": step, "train/loss": loss}
    row.update({f"train/full_acc_{i}": a for i, a in enumerate(acc)})
    row["profile/tokens_per_s"] = tps
    return row


def _val(epoch: int, step: int, loss: float, acc=(0.6, 0.3)) -> dict:
    row = {"time": time.time(), "step": step, "epoch": epoch, "val/loss_epoch": loss}
    row.update({f"val/full_acc_{i}_epoch": a for i, a in enumerate(acc)})
    return row


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_speculators_metric_records_reach_the_file_past_its_own_logger_setup(tmp_path):
    """The file's handler is installed before speculators' CLI sets up its loggers (dictConfig on
    `speculators.metrics`): its records still reach the file, its hyperparameters do not, and its console handler
    is there as its CLI makes it."""
    from speculators.train.logger import setup_metric_logger

    path = tmp_path / METRICS
    argv = ["--epochs", "1", METRICS_FLAG, str(path), "--lr", "1"]
    root = logging.getLogger()
    before = list(root.handlers)
    root.handlers.clear()  # as in the trainer's process: speculators' console handler is then installed, not pytest's
    try:
        record_metrics(argv)
        assert any(type(h).__name__ == "RichHandler" for h in root.handlers)
        assert argv == ["--epochs", "1", "--lr", "1"]  # speculators never sees Eyrie's option
        setup_metric_logger(loggers="", run_name=None, output_dir=str(tmp_path / "logs"))  # as its CLI does
        metrics = logging.getLogger("speculators.metrics")
        metrics.info({"lr": 1e-4}, extra={"hparams": True})
        metrics.info({"train": {"loss": 2.5, "full_acc_0": 0.4}, "epoch": 0, "global_step": 7}, extra={"step": 7})
        metrics.info({"val": {"loss_epoch": 2.0}, "epoch": 0}, extra={"step": 8})
        logging.getLogger("speculators").info("not a metric")
    finally:
        root.handlers[:] = before
    rows, _ = read_rows(path)
    assert [r.get("train/loss") for r in rows] == [2.5, None]
    assert rows[0]["global_step"] == 7 and rows[0]["train/full_acc_0"] == 0.4 and rows[0]["step"] == 7
    assert rows[1] == {**rows[1], "val/loss_epoch": 2.0, "epoch": 0, "step": 8}


def test_a_line_being_written_waits_for_the_next_read(tmp_path):
    path = tmp_path / METRICS
    path.write_text(json.dumps(_step(0, 0, 3.0)) + "\n" + '{"global_step": 1, "tra')
    rows, offset = read_rows(path)
    assert len(rows) == 1
    with open(path, "a") as f:
        f.write('in/loss": 2.0, "epoch": 0}\n')
    more, _ = read_rows(path, offset)
    assert more == [{"global_step": 1, "train/loss": 2.0, "epoch": 0}]


def test_the_table_has_train_and_validation_loss_per_epoch_and_a_resume_replaces_repeated_steps():
    m = Metrics()
    m.add([_step(0, 0, 4.0), _step(1, 0, 3.0, tps=3000), _val(0, 2, 2.9)])
    m.add([_step(2, 1, 9.0), _step(2, 1, 2.0), _step(3, 1, 1.0), _val(1, 4, 1.5, acc=(0.8, 0.5))])  # 2 again: resumed
    table = m.table()
    assert [r["epoch"] for r in table] == [0, 1]
    assert table[0]["train_loss"] == 3.5 and table[0]["tokens_per_s"] == 2000 and table[0]["val_loss"] == 2.9
    assert table[1]["train_loss"] == 1.5 and table[1]["global_step"] == 3
    assert table[1]["val_acc_0"] == 0.8 and table[1]["predicted_acceptance_length"] == 2.3
    png = m.curve_png()
    assert png is not None and png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000
    assert Metrics().curve_png() is None


def test_the_live_view_moves_by_step_and_refreshes_on_its_clock(tmp_path):
    now = [0.0]
    record_launch(tmp_path, steps_per_epoch=10, epochs=2, pid=os.getpid())
    live = LiveTraining(tmp_path, log_every_s=60, refresh_s=180, clock=lambda: now[0])
    assert live.poll().percent is None  # nothing logged yet
    _write(tmp_path / METRICS, [_step(0, 0, 4.0), _step(4, 0, 3.0)])
    first = live.poll()
    assert first.percent == 25.0  # step 4 of 20: by step, not by finished epoch
    assert first.lines == ["epoch 0, step 4 of 20: loss 3, accuracy 0.50/0.25, 1,000 tokens/s"]
    assert first.table and first.curve
    now[0] = 30.0
    _write(tmp_path / METRICS, [_step(5, 0, 2.5)])
    second = live.poll()
    assert second.percent == 30.0 and second.lines == [] and second.table is None  # the next line in a minute
    now[0] = 70.0
    _write(tmp_path / METRICS, [_step(9, 0, 2.0), _val(0, 10, 1.9)])
    third = live.poll()
    assert third.percent == 50.0
    assert third.lines[-1].startswith("epoch 0 validation: loss 1.9, accuracy 0.60/0.30 (predicted acceptance")
    assert third.table and third.table[0]["val_loss"] == 1.9 and third.curve  # a validation refreshes both
    assert live.poll().percent is None  # nothing new
    assert live.poll(final=True).table


def _sleeper(work: Path) -> subprocess.Popen:
    """A process whose command line names the trainer's module, as the trainer's does."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "eyrie.stages.train.entry"])


def test_status_names_the_running_trainers_epoch_step_and_loss(tmp_path):
    run = RunFolder(tmp_path / "run")
    assert run_status(run)["stages"]["train"] == "not started"
    work = run.stage("train") / "0123456789abcdef01234567"
    work.mkdir(parents=True)
    proc = _sleeper(work)
    try:
        record_launch(work, steps_per_epoch=50, epochs=3, pid=proc.pid)
        _write(work / METRICS, [_step(60, 1, 2.25), _val(0, 50, 2.5)])
        line = run_status(run)["stages"]["train"]
        assert line.startswith(f"training (pid {proc.pid}, for ")
        assert "epoch 1, step 60 of 150: loss 2.25" in line and "epoch 0 validation: loss 2.5" in line
        assert "no checkpoint yet" in line
        assert "since the trainer's launch" in format_status(run_status(run))
    finally:
        proc.kill()
        proc.wait()
    stopped = describe(work)
    assert stopped.startswith("stopped (no trainer running)") and "the next run starts over" in stopped


def test_a_loading_server_names_its_phase():
    assert loading_phase({}) == "imports"
    assert loading_phase({"imports": 3.0, "engine start": 9.0}) == "weights"
    assert loading_phase({"imports": 3.0, "engine start": 9.0, "weights": 40.0, "engine init": 12.0}) == "API server"


def test_a_finished_run_ends_with_its_headline(tmp_path):
    run = RunFolder(tmp_path / "run")
    for stage, manifest in {
        "train": {"warnings": ["training was still improving"]},
        "export": {"drafter": "/runs/x/export/drafter"},
        "evaluate": {
            "results": {"trained": {"acceptance_length": 2.41}, "untrained": {"acceptance_length": 1.02}},
            "warnings": [],
        },
    }.items():
        run.stage(stage).mkdir(parents=True)
        atomic_write_json(run.manifest(stage), {"stage": stage, "files": [], **manifest})
    status = run_status(run)
    assert status["headline"].splitlines() == [
        "acceptance length 2.41 (untrained 1.02); drafter /runs/x/export/drafter; 1 warning(s)",
        "  warning: training was still improving",
    ]
    assert format_status(status).endswith("warning: training was still improving")


# ---------------------------------------------------------------------------------------------------------------
# train.loggers


def _command(tmp_path: Path, **train) -> list[str]:
    config = parse_config(config_dict(tmp_path / "target", train=train))
    data = TrainingData(
        tmp_path / "data", tmp_path / "hs", tmp_path / "d2t.npy", tmp_path / "t2d.npy", [2, 4, 5], FACTS
    )
    save = tmp_path / "run" / "train" / "kkk" / "checkpoints"
    return training_command(config, data, save, 1.0, "cuda", warm_start=tmp_path / "drafter")


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_loggers_are_off_by_default_and_passed_through_when_set(tmp_path):
    assert _value(_command(tmp_path), "--logger") == ""
    cmd = _command(tmp_path, loggers=["tensorboard", "mlflow"])
    assert _value(cmd, "--logger") == "tensorboard,mlflow"
    assert Path(_value(cmd, "--log-dir")).is_relative_to(tmp_path / "run")  # inside the run folder
    name = parse_config(config_dict(tmp_path / "target")).name
    assert _value(cmd, "--run-name") == f"{name}-kkk"  # the same on a resume: MLflow continues its run
    with pytest.raises(ConfigError):
        parse_config(config_dict(tmp_path / "target", train={"loggers": ["neptune"]}))


def test_every_logger_eyrie_accepts_is_one_speculators_configures(tmp_path):
    """speculators' metric logger set-up names its handlers; an unknown name fails there (dictConfig)."""
    from typing import get_args

    from speculators.train.logger import setup_metric_logger

    from eyrie.config import TrainConfig

    names = get_args(get_args(TrainConfig.model_fields["loggers"].annotation)[0])
    assert set(names) == {"tensorboard", "wandb", "trackio", "mlflow"}
    for name in names:
        setup_metric_logger(loggers=name, run_name="x", output_dir=str(tmp_path))  # builds the handler, no import
    with pytest.raises(ValueError):
        setup_metric_logger(loggers="neptune", run_name="x", output_dir=str(tmp_path))
    setup_metric_logger(loggers="", run_name="x", output_dir=str(tmp_path))


def test_logger_files_stay_in_the_run_folder_and_their_settings_reach_the_trainer(tmp_path):
    logs = tmp_path / "run" / "train" / "k" / "logs"
    environ = {"WANDB_API_KEY": "secret", "WANDB_PROJECT": "p", "MLFLOW_EXPERIMENT_NAME": "e", "PATH": "/bin"}
    extra, passed = logger_environment(["wandb", "mlflow", "trackio"], logs, environ)
    assert set(passed) == {"WANDB_API_KEY", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME"}
    assert extra["MLFLOW_TRACKING_URI"] == (logs / "mlruns").resolve().as_uri()
    assert extra["TRACKIO_DIR"] == str((logs / "trackio").resolve()) and extra["WANDB_DIR"] == str(logs.resolve())
    extra, _ = logger_environment(["mlflow"], logs, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"})
    assert "MLFLOW_TRACKING_URI" not in extra  # the operator's store wins
    config = parse_config(config_dict(tmp_path / "target", train={"loggers": ["wandb"]}))
    os.environ["WANDB_API_KEY"] = "k"
    try:
        env = trainer_environment(config, "cpu", False, log_dir=logs)
    finally:
        del os.environ["WANDB_API_KEY"]
    assert env["WANDB_API_KEY"] == "k" and env["WANDB_DIR"] == str(logs.resolve())
    assert "WANDB_API_KEY" not in trainer_environment(parse_config(config_dict(tmp_path / "target")), "cpu", False)


def test_a_logger_whose_package_is_missing_is_named_before_training(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    missing_loggers([])
    with pytest.raises(EyrieError, match="train.loggers names wandb, but wandb is not installed"):
        missing_loggers(["wandb"])


def test_the_trainer_record_names_the_launch(tmp_path):
    record_launch(tmp_path, 12, 3, 4242)
    plan = json.loads((tmp_path / TRAINER).read_text())
    assert plan["pid"] == 4242 and plan["steps_per_epoch"] == 12 and plan["epochs"] == 3


@pytest.mark.usefixtures("flow_api")
def test_the_train_task_run_shows_steps_table_and_curve_while_it_trains(tmp_path):
    """The watcher thread (tasks/train.py) makes the bar, the table and the curve in the task run's context: they
    are the train task run's (from a bare thread they were not, with Prefect's FutureWarning that artifacts made
    outside a run are deprecated), the bar at the step logged last, the table with train and validation loss."""
    import asyncio

    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.client.orchestration import get_client
    from prefect.runtime import task_run

    from tasks.train import watch_training

    lines: list[str] = []

    @task(cache_policy=NO_CACHE)
    def training() -> str:
        record_launch(tmp_path, steps_per_epoch=10, epochs=2, pid=os.getpid())
        stop = watch_training(tmp_path, lines.append, every_s=0.05, refresh_s=0)
        _write(tmp_path / METRICS, [_step(0, 0, 4.0), _step(9, 0, 3.0)])
        time.sleep(0.5)
        _write(tmp_path / METRICS, [_val(0, 10, 2.5)])
        stop.set()
        assert stop.done.wait(30)
        return str(task_run.id)

    @flow
    def run_training():
        return training()

    task_run_id = run_training()

    async def artifacts():
        async with get_client() as c:
            return await c.read_artifacts()

    mine = [a for a in asyncio.run(artifacts()) if str(a.task_run_id) == task_run_id]
    kinds = {a.type: a for a in mine}
    assert {"progress", "table", "image"} <= set(kinds), [(a.type, a.key) for a in mine]
    assert kinds["progress"].description == "train: steps" and float(kinds["progress"].data) == 50.0
    tables = sorted((a for a in mine if a.key == "training-metrics"), key=lambda a: a.created)
    rows = json.loads(tables[-1].data) if isinstance(tables[-1].data, str) else tables[-1].data
    assert rows[0]["train_loss"] == 3.5 and rows[0]["val_loss"] == 2.5
    assert str(kinds["image"].data).startswith("data:image/png;base64,")
    assert any(line.startswith("train: epoch 0, step 9 of 20: loss 3") for line in lines)
    assert any(line.startswith("train: epoch 0 validation: loss 2.5") for line in lines)


def test_a_stage_waiting_for_its_loading_server_says_so(tmp_path):
    """Extraction had not started while its server loaded: the stage says it waits, and the server its phase."""
    from conftest import server_recorded_as_this_process

    from eyrie.vllm.phases import START_MARK

    run = RunFolder(tmp_path / "run")
    assert run_status(run)["stages"]["extract"] == "not started"
    server = server_recorded_as_this_process(run.extract, started_at=time.time())
    server.log_path.write_text(
        f"{START_MARK}{time.strftime('%Y-%m-%d %H:%M:%S')} =====\n"
        f"INFO {time.strftime('%m-%d %H:%M:%S')} [core.py:1] Initializing engine\n"
        f"INFO {time.strftime('%m-%d %H:%M:%S')} [gpu_model_runner.py:2] Starting to load model /m\n"
    )
    status = run_status(run)
    assert (
        status["server"].startswith(f"starting: pid {os.getpid()}, loading for ")
        and "now in weights" in status["server"]
    )
    assert status["stages"]["extract"] == "waiting for the extraction server, loading (weights)"
