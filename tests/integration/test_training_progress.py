"""What validation says about training (eyrie/stages/train/validation.py): the per-epoch history, a stop on a plateau,
and the
warning for a drafter that was still improving when its epochs ran out."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import build_tiny_target, config_dict, synthetic_training_inputs

from eyrie.config import parse_config
from eyrie.ops.status import run_status
from eyrie.run.folder import RunFolder
from eyrie.stages.train.progress import METRICS
from eyrie.stages.train.trainer import run_training
from eyrie.stages.train.validation import plateaued, predicted_acceptance_length, still_improving


def test_predicted_acceptance_length_sums_the_position_accuracies():
    metrics = {"full_acc_0_epoch": 0.8, "full_acc_1_epoch": 0.5, "full_acc_2_epoch": 0.25, "loss_epoch": 3.0}
    assert predicted_acceptance_length(metrics) == pytest.approx(2.55)


@pytest.mark.parametrize(
    ("scores", "patience", "min_delta", "expected"),
    [
        ([1.5, 1.9, 2.2], 1, 0.01, False),  # still rising
        ([1.5, 1.9, 1.905], 1, 0.01, True),  # rose by less than min_delta
        ([1.5, 1.9, 1.8, 1.95], 2, 0.01, False),  # a dip, then a new best inside the patience window
        ([1.5, 1.9, 1.8, 1.85], 2, 0.01, True),
        ([1.5], 1, 0.0, False),  # one epoch: nothing to compare with
    ],
)
def test_plateau(scores, patience, min_delta, expected):
    assert plateaued(scores, patience, min_delta) is expected


def test_still_improving_warns_only_on_a_real_rise():
    rows = [{"epoch": 0, "predicted_acceptance_length": 1.6}, {"epoch": 1, "predicted_acceptance_length": 1.9}]
    assert "still improving" in still_improving(rows, 0.02)
    assert still_improving(rows, 0.5) is None
    assert still_improving(rows[:1], 0.0) is None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_training_stops_on_a_plateau_and_is_not_relaunched(tmp_path):
    """Random hidden states teach nothing: with a rise of 0.5 required, the second epoch is a plateau. Training
    stops there instead of running its ten epochs, and the next run finds it finished. While the trainer runs,
    `eyrie status` names it with its epoch, step, loss and last checkpoint (it said `not started`), and its metrics
    reach the file the train task's live view reads."""
    target = build_tiny_target("tiny-llama")
    data = config_dict(target, max_samples=24, shard_size=24, max_length=96, layer_ids=[2, 4, 5])
    data["train"] = {
        "epochs": 10,
        "max_seq_len": 96,
        "stop_on_plateau": True,
        "plateau_patience": 1,
        "plateau_min_delta": 0.5,
        "log_every_steps": 1,
    }
    config = parse_config(data)
    _, inputs, seq_lens = synthetic_training_inputs(config, tmp_path)

    # The run folder's train stage is tmp_path/train: `eyrie status` reads it while the trainer runs.
    training = ThreadPoolExecutor(1).submit(
        run_training, config, tmp_path / "train", "k", inputs, seq_lens, None, print
    )
    seen = []
    while not training.done():
        line = run_status(RunFolder(tmp_path))["stages"]["train"]
        if line.startswith("training (pid"):
            seen.append(line)
        time.sleep(0.2)
    manifest = training.result()
    assert any(re.search(r"epoch \d+, step \d+ of \d+: loss [\d.]+", line) for line in seen), seen[-3:]
    assert any(re.search(r"last checkpoint 0 \(step \d+\)", line) for line in seen), seen[-3:]
    assert run_status(RunFolder(tmp_path))["stages"]["train"] == "done"
    rows = [json.loads(line) for line in (tmp_path / "train" / "k" / METRICS).read_text().splitlines()]
    assert {r["epoch"] for r in rows if "train/loss" in r} == {0, 1} and sum("val/loss_epoch" in r for r in rows) == 2
    assert all("train_loss" in row for row in manifest["history"])  # beside the checkpoints' validation

    assert manifest["stopped_on_plateau"]["epoch"] == 1
    assert [row["epoch"] for row in manifest["history"]] == [0, 1]
    assert all("predicted_acceptance_length" in row for row in manifest["history"])  # every epoch, not only bests
    best = manifest["stopped_on_plateau"]["best_epoch"]
    assert Path(manifest["checkpoint"]).name == str(best)
    assert manifest["warnings"] == []  # a plateau is not "still improving"
    (tmp_path / "train" / "manifest.json").unlink()  # as a kill after training, before the manifest, leaves it
    again = run_training(config, tmp_path / "train", "k", inputs, seq_lens, log=print)
    assert again["checkpoint"] == manifest["checkpoint"]
    assert Path(again["log"]).read_text().count("===== eyrie:") == 1  # not relaunched
