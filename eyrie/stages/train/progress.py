"""Training watched while it runs: the trainer's metrics as a file, and what the UI and `eyrie status` make of them.

The trainer (a subprocess, eyrie/stages/train/entry.py) appends every metrics record speculators logs to
`speculators.metrics` (a training step every `train.log_every_steps`: loss, per-position accuracy, tokens/s, learning
rate; each epoch's validation) to `<train>/<key>/metrics.jsonl`, one JSON object a line, rank 0 only. At launch
Eyrie writes `trainer.json` beside it: the trainer's pid and host, when it started, the steps per epoch and the
epochs. Nothing here imports Prefect: the train task (tasks/train.py) polls a `LiveTraining` from a thread and turns
its updates into artifacts and log lines; `eyrie status` calls `describe`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from eyrie.run.files import atomic_write_json, read_json

METRICS = "metrics.jsonl"  # in the training's work folder, `<run>/train/<key>/`
TRAINER = "trainer.json"  # ditto: the running trainer's pid, host, start and planned steps
METRICS_FLAG = "--eyrie-metrics"  # the trainer's option naming the metrics file


# ---------------------------------------------------------------------------------------------------------------
# The trainer's side


def _flatten(record: Mapping, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in record.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


class MetricsFile(logging.Handler):
    """Appends each of speculators' metric records (a mapping logged to `speculators.metrics`, not the run's
    hyperparameters) to a JSON-lines file, with the time and the step it was logged at; rank 0 only."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(logging.INFO)
        self.path = Path(path)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name != "speculators.metrics" or not isinstance(record.msg, Mapping):
            return
        if getattr(record, "hparams", False) or int(os.environ.get("RANK", "0")) != 0:
            return
        row = {"time": round(record.created, 3), "step": getattr(record, "step", None), **_flatten(record.msg)}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        except OSError:  # a full disk must not stop training; the checkpoints then fail loudly
            pass


def record_metrics(argv: list[str]) -> None:
    """`--eyrie-metrics PATH` (removed from `argv`): speculators' metric records also go to PATH. speculators' own
    console handler is set up first, as its CLI would (its set-up then finds the root logger configured and leaves
    it), and the file's handler joins it on the root logger, which `speculators.metrics` propagates to; speculators'
    own loggers (`--logger`) are configured on `speculators.metrics` itself and are left as they are."""
    if METRICS_FLAG not in argv:
        return
    i = argv.index(METRICS_FLAG)
    path = argv[i + 1]
    del argv[i : i + 2]
    from speculators.train.logger import setup_root_logger

    setup_root_logger()
    # First among the root's handlers: speculators' console handler rewrites each record's mapping into text.
    root = logging.getLogger()
    root.handlers.insert(0, MetricsFile(path))


def record_launch(work: Path, steps_per_epoch: int, epochs: int, pid: int) -> None:
    """`trainer.json`: which process trains into `work` and how many steps it plans (a resume keeps them)."""
    atomic_write_json(
        work / TRAINER,
        {
            "pid": pid,
            "hostname": socket.gethostname(),
            "started_at": time.time(),
            "steps_per_epoch": steps_per_epoch,
            "epochs": epochs,
        },
    )


def record_exit(work: Path, returncode: int) -> None:
    """The launch's end in `trainer.json`: its exit code and how long it ran."""
    plan = read_json(work / TRAINER)
    if isinstance(plan, dict):
        seconds = round(time.time() - plan.get("started_at", time.time()), 1)
        atomic_write_json(work / TRAINER, {**plan, "returncode": returncode, "seconds": seconds})


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_rows(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """The rows from byte `offset` on, and the offset after the last whole line (a line being written is left for
    the next read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows, offset + end


def accuracies(row: dict, prefix: str = "train/", suffix: str = "") -> list[float]:
    out: list[float] = []
    while isinstance(row.get(f"{prefix}full_acc_{len(out)}{suffix}"), (int, float)):
        out.append(float(row[f"{prefix}full_acc_{len(out)}{suffix}"]))
    return out


@dataclass
class Metrics:
    """The trainer's rows, a training step's and a validation's apart; a step logged again after a resume (the
    steps after the last checkpoint run twice) replaces the earlier one."""

    steps: dict[int, dict] = field(default_factory=dict)
    validations: dict[int, dict] = field(default_factory=dict)  # by epoch

    def add(self, rows: list[dict]) -> bool:
        added = False
        for row in rows:
            if "train/loss" in row and isinstance(row.get("global_step"), int):
                self.steps[row["global_step"]] = row
                added = True
            elif "val/loss_epoch" in row and isinstance(row.get("epoch"), int):
                self.validations[row["epoch"]] = row
                added = True
        return added

    @property
    def last_step(self) -> dict | None:
        return self.steps[max(self.steps)] if self.steps else None

    def table(self) -> list[dict]:
        """One row per epoch: its last step, mean train loss and tokens/s over its logged steps, and its
        validation loss, per-position accuracy and predicted acceptance length (1 + the accuracies' sum)."""
        epochs = sorted(
            {r["epoch"] for r in self.steps.values() if isinstance(r.get("epoch"), int)} | set(self.validations)
        )
        out = []
        for epoch in epochs:
            rows = [r for _, r in sorted(self.steps.items()) if r.get("epoch") == epoch]
            row: dict = {"epoch": epoch}
            if rows:
                row["global_step"] = rows[-1]["global_step"]
                row["train_loss"] = round(sum(r["train/loss"] for r in rows) / len(rows), 5)
                speeds = [
                    r["profile/tokens_per_s"] for r in rows if isinstance(r.get("profile/tokens_per_s"), (int, float))
                ]
                if speeds:
                    row["tokens_per_s"] = round(sum(speeds) / len(speeds))
            val = self.validations.get(epoch)
            if val:
                row["val_loss"] = round(float(val["val/loss_epoch"]), 5)
                acc = accuracies(val, "val/", "_epoch")
                row.update({f"val_acc_{i}": round(a, 4) for i, a in enumerate(acc)})
                if acc:
                    row["predicted_acceptance_length"] = round(1 + sum(acc), 4)
            out.append(row)
        return out

    def curve_png(self) -> bytes | None:
        """The loss curve (train loss by step, validation loss at each epoch's end) above the per-position training
        accuracy, as a PNG; None before two steps are logged."""
        if len(self.steps) < 2:
            return None
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        steps = sorted(self.steps)
        fig = Figure(figsize=(7, 5), dpi=80)
        loss, acc = fig.subplots(2, 1, sharex=True)
        loss.plot(steps, [self.steps[s]["train/loss"] for s in steps], label="train", linewidth=1)
        vals = [
            (v.get("step"), v["val/loss_epoch"]) for v in self.validations.values() if isinstance(v.get("step"), int)
        ]
        if vals:
            loss.plot([s for s, _ in vals], [v for _, v in vals], "o-", label="validation")
        loss.set_ylabel("loss")
        loss.legend()
        loss.grid(alpha=0.3)
        for i in range(max((len(accuracies(self.steps[s])) for s in steps), default=0)):
            xs = [s for s in steps if len(accuracies(self.steps[s])) > i]
            acc.plot(xs, [accuracies(self.steps[s])[i] for s in xs], label=f"position {i}", linewidth=1)
        acc.set_ylabel("train accuracy")
        acc.set_xlabel("global step")
        acc.set_ylim(0, 1)
        if acc.lines:
            acc.legend(fontsize="small")
        acc.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()


def step_line(row: dict, total_steps: int | None = None) -> str:
    """`epoch 1, step 40 of 120: loss 3.214, accuracy 0.41/0.22/0.10, 1,234 tokens/s`."""
    step = row.get("global_step")
    where = f"epoch {row.get('epoch')}, step {step}" + (f" of {total_steps}" if total_steps else "")
    parts = [f"loss {row['train/loss']:.4g}"]
    acc = accuracies(row)
    if acc:
        parts.append("accuracy " + "/".join(f"{a:.2f}" for a in acc))
    if isinstance(row.get("profile/tokens_per_s"), (int, float)):
        parts.append(f"{row['profile/tokens_per_s']:,.0f} tokens/s")
    return f"{where}: {', '.join(parts)}"


def validation_line(row: dict) -> str:
    acc = accuracies(row, "val/", "_epoch")
    line = f"epoch {row.get('epoch')} validation: loss {row['val/loss_epoch']:.4g}"
    if acc:
        line += f", accuracy {'/'.join(f'{a:.2f}' for a in acc)} (predicted acceptance length {1 + sum(acc):.3f})"
    return line


# ---------------------------------------------------------------------------------------------------------------
# Watching from the flow's side


@dataclass
class Update:
    """What changed since the last poll: the progress bar's percent, lines for the log, and (at most every
    `LiveTraining.refresh_s`, and at each new validation) the table and the loss curve."""

    percent: float | None = None
    lines: list[str] = field(default_factory=list)
    table: list[dict] | None = None
    curve: bytes | None = None


class LiveTraining:
    """Polls a training's work folder (`<run>/train/<key>`); `poll()` says what to show. A log line at most every
    `log_every_s` (and each validation); the table and the curve at most every `refresh_s`, and at each validation."""

    def __init__(self, work: Path, log_every_s: float = 60.0, refresh_s: float = 180.0, clock=time.monotonic):
        self.work = Path(work)
        self.metrics = Metrics()
        self.offset = 0
        self.log_every_s, self.refresh_s, self.clock = log_every_s, refresh_s, clock
        self._logged = self._refreshed = None
        self._percent: float | None = None

    def total_steps(self) -> int | None:
        plan = read_json(self.work / TRAINER)
        if isinstance(plan, dict) and plan.get("steps_per_epoch") and plan.get("epochs"):
            return int(plan["steps_per_epoch"]) * int(plan["epochs"])
        return None

    def poll(self, final: bool = False) -> Update:
        rows, self.offset = read_rows(self.work / METRICS, self.offset)
        before = set(self.metrics.validations)
        if not self.metrics.add(rows) and not final:
            return Update()
        now = self.clock()
        update = Update()
        total = self.total_steps()
        last = self.metrics.last_step
        if last is not None and total:
            percent = min(100.0, 100.0 * (last["global_step"] + 1) / total)
            if percent != self._percent:
                update.percent = self._percent = percent
        new_val = [self.metrics.validations[e] for e in sorted(set(self.metrics.validations) - before)]
        if last is not None and (self._logged is None or now - self._logged >= self.log_every_s or new_val or final):
            update.lines.append(step_line(last, total))
            self._logged = now
        update.lines += [validation_line(v) for v in new_val]
        if self._refreshed is None or now - self._refreshed >= self.refresh_s or new_val or final:
            update.table = self.metrics.table() or None
            update.curve = self.metrics.curve_png()
            if update.table or update.curve:
                self._refreshed = now
        return update


# ---------------------------------------------------------------------------------------------------------------
# `eyrie status`


def trainer_running(work: Path) -> dict | None:
    """`trainer.json` when the process it names on this host is alive and still Eyrie's trainer (a pid can be
    reused); else None."""
    plan = read_json(work / TRAINER)
    if not isinstance(plan, dict) or plan.get("hostname") != socket.gethostname():
        return None
    try:
        cmdline = Path(f"/proc/{int(plan['pid'])}/cmdline").read_bytes()
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return plan if b"eyrie.stages.train.entry" in cmdline else None


def last_rows(path: Path, tail_bytes: int = 256 * 1024) -> list[dict]:
    """The rows of the file's last `tail_bytes` (its first, cut, line dropped)."""
    try:
        size = path.stat().st_size
    except OSError:
        return []
    start = max(0, size - tail_bytes)
    rows, _ = read_rows(path, start)
    return rows[1:] if start and rows else rows


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def describe(work: Path) -> str:
    """One line on a training that has no manifest yet: whether its trainer runs, the epoch and step it logged
    last with its loss, and the newest whole checkpoint (the one a resume starts from)."""
    from eyrie.stages.train.checkpoints import newest_whole_checkpoint, read_state

    running = trainer_running(work)
    plan = read_json(work / TRAINER) if running is None else running
    metrics = Metrics()
    metrics.add(last_rows(work / METRICS))
    last = metrics.last_step
    total = None
    if isinstance(plan, dict) and plan.get("steps_per_epoch") and plan.get("epochs"):
        total = int(plan["steps_per_epoch"]) * int(plan["epochs"])
    parts = []
    if running:
        parts.append(f"training (pid {running['pid']}, for {_duration(time.time() - running['started_at'])})")
    else:
        parts.append("stopped (no trainer running)")
    if last is not None:
        parts.append(
            step_line(last, total) + (f" ({_ago(last['time'])})" if isinstance(last.get("time"), (int, float)) else "")
        )
    elif running:
        parts.append("no step logged yet")
    if metrics.validations:
        parts.append(validation_line(metrics.validations[max(metrics.validations)]))
    checkpoint = newest_whole_checkpoint(work / "checkpoints")
    if checkpoint is not None:
        state = read_state(checkpoint) or {}
        parts.append(f"last checkpoint {checkpoint.name} (step {state.get('global_step')})")
    else:
        parts.append("no checkpoint yet")
    if not running and (checkpoint is not None or last is not None):
        parts.append(
            "the next run resumes from the last checkpoint" if checkpoint is not None else "the next run starts over"
        )
    return "; ".join(parts)
