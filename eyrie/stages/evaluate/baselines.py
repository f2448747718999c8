"""The trained drafter against the baselines measured beside it, and the warnings when it is not clearly better."""

from __future__ import annotations

from eyrie.stages.evaluate.intervals import FLOOR, floor_comparison, paired_difference


def served_apart(a: dict, b: dict) -> list[str]:
    """How the servers two measurements were made under differ (`eyrie.vllm.provenance.differences`: vLLM version,
    model runner, attention backend, serving arguments); empty when they compare."""
    from eyrie.vllm.provenance import differences

    return differences(a.get("served_under"), b.get("served_under"))


def compare_drafters(results: dict[str, dict]) -> dict[str, dict]:
    """The trained drafter against each other one measured on the same prompts (`untrained`, `current`), paired;
    with no untrained drafter served, against the floor (`floor`)."""
    trained = results["trained"]
    out = {}
    for label, other in results.items():
        if label == "trained" or served_apart(trained, other):
            continue  # measured under another server: not compared (`baseline_warnings` says so)
        if (cmp := paired_difference(trained, other)) is not None:
            out[label] = cmp
    if "untrained" not in results and (floor := floor_comparison(trained)) is not None:
        out["floor"] = floor
    return out


BASELINES = (
    ("untrained", "an untrained drafter of the same shape"),
    ("floor", f"no drafter at all (acceptance length {FLOOR}, every draft rejected)"),
    ("current", "the current drafter"),
)


def baseline_warnings(results: dict[str, dict], comparisons: dict[str, dict]) -> list[str]:
    """A trained drafter not clearly better than the untrained baseline (or, with none served, the floor), or than
    the current drafter: a warning (and promotion refuses it, eyrie.stages.promote.decide)."""
    warnings = []
    for label, what in BASELINES:
        cmp = comparisons.get(label)
        if label in results and (apart := served_apart(results["trained"], results[label])):
            warnings.append(
                f"the trained drafter and {what} were measured under different servers ({'; '.join(apart)}): "
                "they are not compared and the trained drafter is not promoted. Run again: the drafter measured "
                "under the older server is measured again"
            )
            continue
        if cmp is None:
            if label not in results:
                continue
            new, old = results["trained"].get("acceptance_length"), results[label].get("acceptance_length")
            if new is not None and old is not None and new > old:
                continue
            detail = f"acceptance length {new} vs {old}, no per-request counts to pair"
        elif cmp["clearly_better"]:
            continue
        else:
            detail = (
                f"acceptance length {cmp['new']} vs {cmp['old']}, difference {cmp['difference']:+} "
                f"(standard error {cmp['se']}, 95% interval {cmp['ci95']}) over {cmp['prompts']} prompts"
            )
        warnings.append(
            f"the trained drafter is not clearly better than {what}: {detail}. It is not promoted. Train longer "
            "or on more data, check the capture (extract/capture/*.json) and that the held-out prompts are like "
            "the training data; more evaluate.num_prompts narrows the interval"
        )
    return warnings
