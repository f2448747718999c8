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

from eyrie.run.files import read_json

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


def with_training_metrics(rows: list[dict], trained: list[dict]) -> list[dict]:
    """The history's rows with each epoch's training figures from the trainer's metrics file
    (`eyrie.stages.train.progress.Metrics.table`): mean train loss and tokens/s over its logged steps."""
    by_epoch = {r["epoch"]: r for r in trained}
    return [
        {
            **row,
            **{
                k: by_epoch[row["epoch"]][k]
                for k in ("train_loss", "tokens_per_s")
                if k in by_epoch.get(row["epoch"], {})
            },
        }
        for row in rows
    ]


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


# ---------------------------------------------------------------------------------------------------------------
# Like with like: speculators' `full_acc_i` against what vLLM counts
#
# For draft position i (0-based), speculators counts a draft start j as right when the start token is in the loss
# mask and the drafter's first i+1 tokens are right, but divides by the positions whose (i+1)-th target is in the
# mask. So the i starts just before each answer (the template's last tokens: drafts vLLM never makes) sit in the
# denominator and can never be right, while the i starts at each answer's end are left out of both. Per answer of L
# tokens, `full_acc_i` is capped at (L - i) / L: nothing on a long answer, but 0.85 at the third position for the
# demo's 13.6-token answers. vLLM counts drafts that start inside an answer. Rescaling by the denominator speculators
# used over the starts that can be right gives the figure vLLM's per-position acceptance is comparable with.


def draft_start_counts(loss_masks, positions: int) -> tuple[list[int], list[int]]:
    """For validation rows' loss masks (as stored, before the trainer's one-token shift), per draft position
    i < `positions`: the positions speculators divides by (the (i+1)-th target in the mask) and the draft starts
    that can be right (start and (i+1)-th target both in the mask)."""
    import numpy as np

    totals, starts = [0] * positions, [0] * positions
    for mask in loss_masks:
        m = np.asarray(mask, dtype=bool)[1:]  # the trainer drops each row's first token
        for i in range(positions):
            totals[i] += int(m[i:].sum())
            starts[i] += int((m[: len(m) - i] & m[i:]).sum())
    return totals, starts


def like_for_like(metrics: dict, totals: list[int], starts: list[int]) -> list[float]:
    """`full_acc_i` per position, counted over the draft starts that can be right (see above)."""
    return [
        min(1.0, acc * totals[i] / starts[i]) if i < len(starts) and starts[i] else acc
        for i, acc in enumerate(position_accuracies(metrics))
    ]


def validation_rows_loss_masks(dataset_dir: Path, val_fraction: float) -> list:
    """The loss masks of the rows speculators validates on: the last `val_fraction` of the dataset, split as
    speculators' ArrowDataset splits it (`int(len * train_ratio)`)."""
    from datasets import load_from_disk

    ds = load_from_disk(str(dataset_dir)).with_format(None)
    split = int(len(ds) * (1 - val_fraction))
    return ds.select(range(split, len(ds)))["loss_mask"]


def like_for_like_metrics(metrics: dict | None, dataset_dir: Path, val_fraction: float) -> dict | None:
    """`metrics` with each `full_acc_i_epoch` counted over the draft starts that can be right (speculators' own
    figure kept as `full_acc_i_epoch_speculators`): what the train/serve gap compares with vLLM's acceptance."""
    accuracies = position_accuracies(metrics or {})
    if not accuracies or not (Path(dataset_dir) / "dataset_info.json").exists():
        return metrics
    totals, starts = draft_start_counts(validation_rows_loss_masks(Path(dataset_dir), val_fraction), len(accuracies))
    out = dict(metrics or {})
    for i, value in enumerate(like_for_like(out, totals, starts)):
        out[f"full_acc_{i}_epoch_speculators"] = out[f"full_acc_{i}_epoch"]
        out[f"full_acc_{i}_epoch"] = value
    return out
