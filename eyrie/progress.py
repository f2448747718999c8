"""What the trainer's validation says, epoch by epoch: the history the train manifest and the run summary show,
when training has plateaued, and whether it was still improving when it stopped.

speculators measures, per draft position i, `full_acc_i`: the share of validation positions where the drafter's
first i+1 tokens are all right. That is what vLLM counts as accepted at draft position i, so 1 + their sum predicts
the acceptance length served. speculators writes an epoch's metrics into its checkpoint only when the validation loss
improved (`val_metrics.json`); Eyrie's trainer entry point records every epoch's (VALIDATION), so the history has no
holes and a plateau can be seen.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.store import read_json

VALIDATION = "eyrie-validation.json"  # in each epoch's checkpoint folder
PLATEAU = "plateau.json"  # in the checkpoints folder: training stopped there on a plateau


def position_accuracies(metrics: dict) -> list[float]:
    out: list[float] = []
    while f"full_acc_{len(out)}_epoch" in metrics:
        out.append(float(metrics[f"full_acc_{len(out)}_epoch"]))
    return out


def predicted_acceptance_length(metrics: dict) -> float:
    return 1.0 + sum(position_accuracies(metrics))


def plateaued(scores: list[float], patience: int, min_delta: float) -> bool:
    """True when none of the last `patience` epochs beat the best epoch before them by at least `min_delta`."""
    if patience < 1 or len(scores) <= patience:
        return False
    return max(scores[-patience:]) < max(scores[:-patience]) + min_delta


def _read(path: Path) -> dict | None:
    data = read_json(path)
    return data if isinstance(data, dict) else None


def epoch_validation(folder: Path) -> dict | None:
    return _read(folder / VALIDATION) or _read(folder / "val_metrics.json")


def history(save_path: Path) -> list[dict]:
    """One row per epoch checkpoint: its global step, validation metrics and predicted acceptance length."""
    rows = []
    epochs = sorted((p for p in save_path.glob("*") if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    for folder in epochs:
        metrics = epoch_validation(folder) or {}
        state = _read(folder / "training_state.json") or {}
        row = {"epoch": int(folder.name), "global_step": state.get("global_step")}
        row.update({k: round(v, 5) for k, v in metrics.items() if isinstance(v, (int, float))})
        if position_accuracies(metrics):
            row["predicted_acceptance_length"] = round(predicted_acceptance_length(metrics), 4)
        rows.append(row)
    return rows


def still_improving(rows: list[dict], threshold: float) -> str | None:
    """A warning when the last epoch still raised the predicted acceptance length by more than `threshold`."""
    scores = [r["predicted_acceptance_length"] for r in rows if "predicted_acceptance_length" in r]
    if len(scores) < 2 or scores[-1] - scores[-2] <= threshold:
        return None
    return (
        f"training was still improving when it stopped: the last epoch raised the predicted acceptance length from "
        f"{scores[-2]:.3f} to {scores[-1]:.3f} (more than train.still_improving_warning={threshold}); more epochs, "
        "or train.stop_on_plateau with a higher train.epochs, would likely give a better drafter"
    )
