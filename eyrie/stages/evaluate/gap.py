"""The train/serve gap: validation accuracy per draft position beside the acceptance vLLM served."""

from __future__ import annotations

import math

from eyrie.stages.train.validation import position_accuracies


def train_serve_gap(val_metrics: dict | None, served: list[float], bound: float, drafts: int | None = None) -> dict:
    """Validation accuracy per draft position (speculators' `full_acc_i`: the first i+1 draft tokens all right)
    beside the acceptance vLLM measured at that position on held-out prompts. They count the same event, so a gap
    beyond `bound` means training and serving differ: usually the features (other layers, another dtype or
    template, a different target build) or the data (the served prompts are unlike the training conversations).

    The served rate is an estimate from `drafts` drafts: a position is flagged only when its gap exceeds `bound`
    by more than twice the estimate's standard error (`margin`), so a short evaluation does not cry wolf and a
    real mismatch still shows."""
    accuracies = position_accuracies(val_metrics or {})
    rows = []
    for i, (val, srv) in enumerate(zip(accuracies, served, strict=False)):
        margin = 2 * math.sqrt(max(srv * (1 - srv), 0.0) / drafts) if drafts else 0.0
        row = {"position": i + 1, "validation": round(val, 4), "served": srv, "gap": round(val - srv, 4)}
        if (raw := (val_metrics or {}).get(f"full_acc_{i}_epoch_speculators")) is not None:
            row["validation_speculators"] = round(raw, 4)  # before eyrie.stages.train.validation.like_for_like_metrics
        rows.append({**row, "margin": round(margin, 4)})
    flagged = [r["position"] for r in rows if abs(r["gap"]) > bound + r["margin"]]
    return {"bound": bound, "drafts": drafts, "rows": rows, "flagged": flagged}


def gap_warning(gap: dict) -> str | None:
    if not gap["flagged"]:
        return None
    worst = max(gap["rows"], key=lambda r: abs(r["gap"]))
    where = (
        f"at draft position(s) {gap['flagged']} validation accuracy and served acceptance differ by more than "
        f"{gap['bound']} beyond the measurement's noise (worst: position {worst['position']}, validation "
        f"{worst['validation']} vs served {worst['served']} over {gap['drafts']} drafts)"
    )
    if worst["gap"] > 0:  # training promised more than vLLM delivers
        return (
            f"training does not predict serving: {where}. Check that serving uses the same target, layers and "
            "dtype as extraction, and that the evaluation prompts are like the training data (regenerate the data "
            "with the target)."
        )
    return (
        f"serving beats validation: {where}. The held-out prompts are easier than the validation data (first "
        "turns only, short answers), or too few drafts were measured: raise evaluate.num_prompts and max_tokens."
    )


def gap_sentence(gap: dict) -> str:
    """The sentence above the gap's table, said from the same rows and flags the table shows: a position is over
    the bound when its gap exceeds `bound` beyond the noise margin (`flagged`)."""
    how = "per position (validation accuracy vs acceptance in vLLM, beyond the measurement's noise)"
    rows, flagged = gap["rows"], set(gap["flagged"])
    if not rows:
        return "No validation accuracy per position to compare with serving."
    over = [r["position"] for r in rows if r["position"] in flagged]
    within = [r["position"] for r in rows if r["position"] not in flagged]
    if not over:
        return f"Training predicts serving within {gap['bound']} {how}:"
    if not within:
        return f"Training does not predict serving: every position is over the bound of {gap['bound']} {how}:"
    return (
        f"Training predicts serving within {gap['bound']} at position(s) {within}, not at {over} (over the bound) "
        f"{how}:"
    )
