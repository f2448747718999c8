"""Acceptance statistics with their uncertainty: pooled and per-request figures, paired differences, the floor."""

from __future__ import annotations

import math

Z95 = 1.96  # two-sided 95% confidence intervals
CLEARLY_BETTER_Z = 1.645  # a drafter is clearly better when its paired difference is above 0 at one-sided 95%


def ratio_estimate(num: list[float], den: list[float]) -> tuple[float | None, float | None]:
    """sum(num) / sum(den) and its standard error over the units (the delta method): each unit is one request, whose
    drafts are not independent of each other."""
    m, total = len(den), sum(den)
    if not m or total <= 0:
        return None, None
    r = sum(num) / total
    if m < 2:
        return r, None
    resid = sum((a - r * n) ** 2 for a, n in zip(num, den, strict=True))
    return r, math.sqrt(resid / (m * (m - 1))) / (total / m)


def mean_estimate(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, None
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return mean, math.sqrt(var / len(xs))


def _figure(value: float | None, se: float | None, offset: float = 0.0) -> dict:
    if value is None:
        return {"value": None, "se": None, "ci95": None}
    v = value + offset
    return {
        "value": round(v, 4),
        "se": round(se, 4) if se is not None else None,
        "ci95": [round(v - Z95 * se, 4), round(v + Z95 * se, 4)] if se is not None else None,
    }


def request_statistics(requests: list[dict]) -> dict:
    """The pooled acceptance length and the mean of the per-request ones, each with its standard error and 95%
    interval, overall and per position. Requests that drafted nothing (answers of one token) count in neither."""
    used = [r for r in requests if r["drafts"] > 0]
    drafts = [float(r["drafts"]) for r in used]
    k = max((len(r["per_pos"]) for r in used), default=0)
    pos = [[float(r["per_pos"][i]) if i < len(r["per_pos"]) else 0.0 for r in used] for i in range(k)]
    return {
        "requests": len(requests),
        "requests_with_drafts": len(used),
        "pooled": {
            "acceptance_length": _figure(*ratio_estimate([float(r["accepted"]) for r in used], drafts), offset=1.0),
            "per_position": [_figure(*ratio_estimate(pos[i], drafts)) for i in range(k)],
        },
        "per_request_mean": {
            "acceptance_length": _figure(*mean_estimate([1 + r["accepted"] / r["drafts"] for r in used])),
            "per_position": [
                _figure(*mean_estimate([c / n for c, n in zip(pos[i], drafts, strict=True)])) for i in range(k)
            ],
        },
    }


def paired_difference(new: dict, old: dict) -> dict | None:
    """`new`'s pooled acceptance length minus `old`'s, measured on the same prompts (their `requests`, in prompt
    order), with the standard error of the difference over the prompts (the delta method for two ratio
    estimators on paired units: a prompt easy for one drafter is easy for the other, so the pair's difference is
    far less noisy than either figure). None when either has no per-request counts for the same prompts."""
    a, b = new.get("requests"), old.get("requests")
    if not a or not b or len(a) != len(b):
        return None
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x["drafts"] > 0 and y["drafts"] > 0]
    if len(pairs) < 2:
        return None
    m = len(pairs)
    n1, n2 = sum(x["drafts"] for x, _ in pairs) / m, sum(y["drafts"] for _, y in pairs) / m
    r1 = sum(x["accepted"] for x, _ in pairs) / (n1 * m)
    r2 = sum(y["accepted"] for _, y in pairs) / (n2 * m)
    u = [(x["accepted"] - r1 * x["drafts"]) / n1 - (y["accepted"] - r2 * y["drafts"]) / n2 for x, y in pairs]
    mean_u = sum(u) / m
    se = math.sqrt(sum((v - mean_u) ** 2 for v in u) / (m - 1) / m)
    diff = r1 - r2
    return {
        "new": round(1 + r1, 4),
        "old": round(1 + r2, 4),
        "difference": round(diff, 4),
        "se": round(se, 4),
        "ci95": [round(diff - Z95 * se, 4), round(diff + Z95 * se, 4)],
        "prompts": m,
        "clearly_better": diff > CLEARLY_BETTER_Z * se if se > 0 else diff > 0,
    }


FLOOR = 1.0  # acceptance length with no drafter, or one whose drafts are never accepted


def floor_comparison(result: dict) -> dict | None:
    """A drafter against the floor (`FLOOR`: what no drafter gives, known without serving one): its pooled
    acceptance length minus 1 with that figure's standard error over the prompts. None without per-request counts."""
    figure = (result.get("statistics") or {}).get("pooled", {}).get("acceptance_length") or {}
    value, se = figure.get("value"), figure.get("se")
    if value is None or se is None:
        return None
    diff = value - FLOOR
    return {
        "new": value,
        "old": FLOOR,
        "difference": round(diff, 4),
        "se": se,
        "ci95": [round(diff - Z95 * se, 4), round(diff + Z95 * se, 4)],
        "prompts": result["statistics"]["requests_with_drafts"],
        "clearly_better": diff > CLEARLY_BETTER_Z * se if se > 0 else diff > 0,
    }
