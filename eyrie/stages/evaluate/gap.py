"""The train/serve gap: validation accuracy per draft position beside the acceptance vLLM served."""

from __future__ import annotations

import math

from eyrie.stages.evaluate.sets import HELD_OUT, VALIDATION
from eyrie.stages.train.validation import position_accuracies


def measured_gap(val_metrics: dict | None, trained: dict, bound: float) -> dict:
    """The trained drafter's gap from its evaluation result `trained`: against the acceptance vLLM served on the
    validation conversations' own prompts (its `sets[VALIDATION]`) when they were served, the same population as
    validation; against the held-out prompts otherwise."""
    own = (trained.get("sets") or {}).get(VALIDATION)
    if own and own.get("drafts"):
        return train_serve_gap(
            val_metrics,
            own["per_position_acceptance"],
            bound,
            own["drafts"],
            served_on=VALIDATION,
            held_out=trained["per_position_acceptance"],
        )
    return train_serve_gap(val_metrics, trained["per_position_acceptance"], bound, trained["drafts"])


def train_serve_gap(
    val_metrics: dict | None,
    served: list[float],
    bound: float,
    drafts: int | None = None,
    served_on: str = HELD_OUT,
    held_out: list[float] | None = None,
) -> dict:
    """Validation accuracy per draft position (speculators' `full_acc_i`: the first i+1 draft tokens all right)
    beside the acceptance vLLM measured at that position. They count the same event, so a gap beyond `bound` means
    training and serving differ: the features (other layers, another dtype or template, a different target build)
    or the drafter's numerics in vLLM.

    `served_on` names the prompts `served` was measured on: `train-validation` (the prompts of the conversations the
    trainer validates on, `eyrie.stages.evaluate.sets.VALIDATION`: the same population as validation, so only
    training against serving differs) or `held-out` (another population: a kind of prompt the training data lacks
    shows as a gap there though nothing differs between training and serving). `held_out`: the held-out prompts'
    acceptance per position, shown beside when the gap is measured on the validation prompts.

    The served rate is an estimate from `drafts` drafts: a position is flagged only when its gap exceeds `bound`
    by more than twice the estimate's standard error (`margin`), so a short evaluation does not cry wolf and a
    real mismatch still shows."""
    accuracies = position_accuracies(val_metrics or {})
    rows = []
    for i, (val, srv) in enumerate(zip(accuracies, served, strict=False)):
        margin = 2 * math.sqrt(max(srv * (1 - srv), 0.0) / drafts) if drafts else 0.0
        row = {"position": i + 1, "validation": round(val, 4), "served": srv, "gap": round(val - srv, 4)}
        if held_out is not None and i < len(held_out):
            row["held_out"] = held_out[i]
        if (raw := (val_metrics or {}).get(f"full_acc_{i}_epoch_speculators")) is not None:
            row["validation_speculators"] = round(raw, 4)  # before eyrie.stages.train.validation.like_for_like_metrics
        rows.append({**row, "margin": round(margin, 4)})
    flagged = [r["position"] for r in rows if abs(r["gap"]) > bound + r["margin"]]
    return {"bound": bound, "drafts": drafts, "served_on": served_on, "rows": rows, "flagged": flagged}


def gap_warning(gap: dict) -> str | None:
    if not gap["flagged"]:
        return None
    worst = max(gap["rows"], key=lambda r: abs(r["gap"]))
    own = gap.get("served_on") == VALIDATION
    on = "the validation conversations' own prompts" if own else "the held-out prompts"
    where = (
        f"at draft position(s) {gap['flagged']} validation accuracy and the acceptance vLLM served on {on} differ "
        f"by more than {gap['bound']} beyond the measurement's noise (worst: position {worst['position']}, "
        f"validation {worst['validation']} vs served {worst['served']} over {gap['drafts']} drafts)"
    )
    if worst["gap"] > 0:  # training promised more than vLLM delivers
        if own:  # the same conversations on both sides: training and serving differ
            return (
                f"training does not predict serving: {where}. The prompts are the ones validation ran on, so "
                "training and serving differ: check that serving uses the same target, layers and dtype as "
                "extraction."
            )
        return (
            f"training does not predict serving: {where}. The held-out prompts are another population than the "
            "validation conversations (the validation conversations' own prompts could not be served: their "
            "conversations do not line up with the training rows); check that serving uses the same target, layers "
            "and dtype as extraction, and that the held-out prompts are like the training data."
        )
    return (
        f"serving beats validation: {where}. The served prompts are easier than the validation data (first "
        "turns only, short answers), or too few drafts were measured: raise evaluate.num_prompts and max_tokens."
    )


def gap_sentence(gap: dict) -> str:
    """The sentence above the gap's table, said from the same rows and flags the table shows: a position is over
    the bound when its gap exceeds `bound` beyond the noise margin (`flagged`)."""
    on = (
        "on the validation conversations' own prompts"
        if gap.get("served_on") == VALIDATION
        else "on the held-out prompts"
    )
    how = f"per position (validation accuracy vs acceptance in vLLM {on}, beyond the measurement's noise)"
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
