"""The run summary's acceptance section, per evaluation set and per prompt category."""

from __future__ import annotations

from eyrie.stages.evaluate.sets import HELD_OUT


def _ci_text(figure: dict) -> str:
    if not figure or figure.get("value") is None:
        return "-"
    ci = figure.get("ci95")
    return f"{figure['value']} [{ci[0]}, {ci[1]}]" if ci else f"{figure['value']}"


def _statistics_lines(first: str, stats: dict) -> list[str]:
    rows = []
    for kind, label in (("pooled", "pooled"), ("per_request_mean", "mean of per-request")):
        s = stats[kind]
        cells = [_ci_text(s["acceptance_length"]), *(_ci_text(f) for f in s["per_position"])]
        rows.append(f"| {first} | {label} | " + " | ".join(cells) + f" | {stats['requests_with_drafts']} |")
    return rows


def _header(first: str, k: int) -> list[str]:
    heads = [first, "figure", "acceptance length", *(f"accept@{i + 1}" for i in range(k)), "requests"]
    return ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]


def evaluation_markdown(results: dict[str, dict]) -> list[str]:
    """The run summary's acceptance section: for each evaluation set (the held-out prompts first, then the named
    prompt files), the pooled acceptance length and the mean of the per-request ones side by side, each with its
    95% interval, overall and per position, per drafter; then per prompt category where the set has one."""
    sets: dict[str, dict[str, dict]] = {}
    for label, r in results.items():
        if r.get("statistics"):
            sets.setdefault(HELD_OUT, {})[label] = r
        for name, s in (r.get("sets") or {}).items():
            sets.setdefault(name, {})[label] = s
    lines: list[str] = []
    for name, by_label in sets.items():
        k = max(len(r["statistics"]["pooled"]["per_position"]) for r in by_label.values())
        lines += [
            f"Acceptance on `{name}` with 95% intervals: pooled (every request's drafts together, as vLLM's "
            "counters and benchmarks report it) beside the mean of per-request acceptance (what one request sees):",
            "",
            *_header("drafter", k),
        ]
        for label, r in by_label.items():
            lines += _statistics_lines(label, r["statistics"])
        for label, r in by_label.items():
            if r.get("categories"):
                lines += ["", f"`{name}` per prompt category, {label} drafter:", "", *_header("category", k)]
                for cat, stats in r["categories"].items():
                    lines += _statistics_lines(cat, stats)
        lines.append("")
    return lines
