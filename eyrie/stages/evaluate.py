"""evaluate: acceptance length on held-out prompts, read from vLLM's speculative-decoding counters.

Acceptance length is mean tokens per target step with the bonus token: 1 + accepted / drafts. Per-position rates are
accepted_at_position_i / drafts. Counters are read from the server's Prometheus /metrics before and after the
prompts, so a reused server's earlier traffic does not count.

Two figures, side by side, each with a 95% confidence interval, overall and per position (`request_statistics`):
the **pooled** acceptance length (every request's drafts together: what a server's counters and vLLM's own
benchmarks report, weighted by how long each request drafted) and the **mean of the per-request** acceptance
lengths (what one user's request sees on average; vllm #42508 is the two taken for each other). The per-request
counts come from vLLM's per-request speculative-decoding metrics in each response (`--per-request-spec-decode-
metrics summary`, added to the server's arguments where the installed vLLM has it), else from the counters read
around each prompt sent alone. The pooled interval is the ratio estimator's (the delta method over requests), not a
binomial over drafts: drafts of one request are not independent.

Two drafters measured on the same prompts are compared pairwise (`paired_difference`): the difference of their
pooled acceptance lengths with the standard error of that difference over the prompts, which is what promotion
decides on and what tells a trained drafter from a useless one (`baseline_warnings`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from eyrie.stages.train.validation import position_accuracies

_SAMPLE = re.compile(r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$")


def evaluate_key(
    config, label: str, drafter_identity: str, prompts: list[list[dict]], server: str, sets: dict | None = None
) -> str:
    """What one drafter's measurement depends on (`eyrie.run.identity.STAGES["evaluate"]`): which drafter, the
    prompts and how much is generated, and what its server computes (`server`: the serving spec's
    `output_identity`, with this drafter: target identity, drafter content, draft tokens, output-shaping arguments,
    vLLM version). The target moving, or vLLM, measures again. `sets`: the named evaluation sets
    (`evaluation_sets`), by content, with the held-out prompts."""
    from eyrie.target.metadata import stage_key

    measured = {HELD_OUT: prompts, **sets} if sets else prompts
    return stage_key("evaluate", config, label=label, drafter_id=drafter_identity, prompts=measured, server=server)


def draft_tokens_key(config, trained_key: str) -> str:
    from eyrie.target.metadata import stage_key

    return stage_key("draft_tokens", config, trained=trained_key)


def spec_counters(metrics_text: str) -> dict:
    """Sum vLLM's spec-decode counters over engines: drafts, draft_tokens, accepted, per_pos {i: n}."""
    per_pos: dict[int, float] = {}
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": per_pos}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found = re.search(r'position="(\d+)"', labels)
            if found:
                pos = int(found.group(1))
                per_pos[pos] = per_pos.get(pos, 0.0) + value
        elif name in names:
            out[names[name]] += value
    return out


def acceptance(before: dict, after: dict) -> dict:
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    positions = sorted(after["per_pos"])
    per_pos = [(after["per_pos"][p] - before["per_pos"].get(p, 0.0)) / drafts if drafts else 0.0 for p in positions]
    return {
        "acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        "per_position_acceptance": [round(r, 4) for r in per_pos],
        "drafts": int(drafts),
        "accepted_tokens": int(accepted),
        "draft_tokens": int(after["draft_tokens"] - before["draft_tokens"]),
    }


PER_REQUEST_METRICS = "--per-request-spec-decode-metrics"
Z95 = 1.96  # two-sided 95% confidence intervals
CLEARLY_BETTER_Z = 1.645  # a drafter is clearly better when its paired difference is above 0 at one-sided 95%


def vllm_has_per_request_metrics() -> bool:
    """Whether the installed vLLM has `--per-request-spec-decode-metrics`, read from its source without importing it
    (an import of vLLM takes seconds to tens of seconds)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "config" / "observability.py"
        if path.is_file() and "per_request_spec_decode_metrics" in path.read_text(errors="replace"):
            return True
    return False


def with_per_request_metrics(server_args: list[str]) -> list[str]:
    """The serving arguments plus vLLM's per-request acceptance in each response, where the installed vLLM has it."""
    if any(a.split("=")[0] == PER_REQUEST_METRICS for a in server_args) or not vllm_has_per_request_metrics():
        return list(server_args)
    return [*server_args, PER_REQUEST_METRICS, "summary"]


def request_counts(response: dict) -> dict | None:
    """One response's per-request speculative-decoding counts (`metrics.speculative_decoding`), or None: drafts
    (verify steps), accepted draft tokens, and per position i the steps that accepted at least i tokens."""
    sd = (response.get("metrics") or {}).get("speculative_decoding")
    if not sd or "acceptance_histogram" not in sd:
        return None
    hist = [int(c) for c in sd["acceptance_histogram"]]
    return {
        "drafts": sum(hist),
        "accepted": sum(j * c for j, c in enumerate(hist)),
        "per_pos": [sum(hist[i:]) for i in range(1, len(hist))],
    }


def _counts_between(before: dict, after: dict) -> dict:
    positions = sorted(after["per_pos"])
    return {
        "drafts": int(after["drafts"] - before["drafts"]),
        "accepted": int(after["accepted"] - before["accepted"]),
        "per_pos": [int(after["per_pos"][p] - before["per_pos"].get(p, 0.0)) for p in positions],
    }


def measure(client, prompts: list[list[dict]], max_tokens: int, concurrency: int = 8) -> dict:
    """Send every prompt (greedy) and return the acceptance figures for exactly this traffic: the pooled counters,
    each request's own counts (`requests`, in prompt order) and their statistics (`request_statistics`)."""
    before = spec_counters(client.metrics())
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(lambda p: client.chat(p, max_tokens), prompts))
    after = spec_counters(client.metrics())
    result = acceptance(before, after)
    result["prompts"] = len(prompts)
    result["completion_tokens"] = sum(o["usage"]["completion_tokens"] for o in outs)
    found = [request_counts(o) for o in outs]
    requests = [r for r in found if r is not None]
    source = "vllm per-request metrics"
    if len(requests) < len(found):
        # This vLLM gives no per-request figures: each prompt again, alone, between two reads of the counters.
        requests, source = [], "counters around each prompt sent alone"
        for p in prompts:
            b = spec_counters(client.metrics())
            client.chat(p, max_tokens)
            requests.append(_counts_between(b, spec_counters(client.metrics())))
    result["requests"] = requests
    result["requests_source"] = source
    result["statistics"] = request_statistics(requests)
    return result


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


# ---------------------------------------------------------------------------------------------------------------
# How many draft tokens: acceptance for k = 1..K from one server, and what the drafter buys in tokens per second


def measure_throughput(client, prompts: list[list[dict]], max_tokens: int, concurrency: int) -> dict:
    """Output tokens per second for `prompts` (greedy) sent `concurrency` at a time, from the first request to the
    last answer, after one warm-up request."""
    client.chat(prompts[0], max_tokens)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(lambda p: client.chat(p, max_tokens), prompts))
    seconds = time.perf_counter() - t0
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return {
        "concurrency": concurrency,
        "prompts": len(prompts),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(tokens / seconds, 1),
    }


def draft_token_table(swept: dict, measured: dict) -> list[dict]:
    """Acceptance length for k = 1..K draft tokens, from one server drafting K (`swept`). Under greedy verification
    the first k tokens of a K-token chain draft are exactly the k-token draft, so AL(k) = 1 + the acceptance at
    positions 1..k; only the steps that follow differ a little with k, so the row for the k that was also served
    (`measured`, the evaluation's own run) shows its directly measured figure beside the estimate."""
    rows, total = [], 1.0
    for k, rate in enumerate(swept["per_position_acceptance"], 1):
        total += rate
        row = {"k": k, "acceptance_length": round(total, 4), "acceptance_at_k": rate}
        if k == len(measured["per_position_acceptance"]):
            row["measured_acceptance_length"] = measured["acceptance_length"]
        rows.append(row)
    return rows


def throughput_rows(target_alone: list[dict], with_drafter: dict[int, list[dict]]) -> list[dict]:
    """One row per concurrency: the target alone against target + drafter at each k served, with the speed-up."""
    rows = []
    for i, base in enumerate(target_alone):
        row = {"concurrency": base["concurrency"], "target_alone": base["output_tokens_per_s"]}
        for k, runs in sorted(with_drafter.items()):
            row[f"drafter_k{k}"] = runs[i]["output_tokens_per_s"]
            row[f"speedup_k{k}"] = round(runs[i]["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
        rows.append(row)
    return rows


SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"


def vllm_has_batch_size_schedule() -> bool:
    """Whether the installed vLLM's speculative config takes `num_speculative_tokens_per_batch_size` (dynamic
    speculative decoding), read from its source without importing it."""
    spec = importlib.util.find_spec("vllm")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "config" / "speculative.py"
        if path.is_file() and SCHEDULE_FIELD in path.read_text(errors="replace"):
            return True
    return False


def best_k_per_concurrency(throughput: list[dict]) -> list[dict]:
    """At each measured concurrency, the draft-token count with the most output tokens per second among those
    served there (0: the target alone)."""
    out = []
    for row in sorted(throughput, key=lambda r: r["concurrency"]):
        served = {0: row["target_alone"]} | {
            int(key.removeprefix("drafter_k")): v for key, v in row.items() if key.startswith("drafter_k")
        }
        k = max(served, key=lambda kk: (served[kk], -kk))  # a tie goes to fewer draft tokens (less work)
        out.append({"concurrency": row["concurrency"], "best_k": k, "output_tokens_per_s": served[k]})
    return out


def batch_size_schedule(throughput: list[dict], drafter: str, has_field: bool | None = None) -> dict:
    """The draft length per batch size vLLM takes: `num_speculative_tokens_per_batch_size`, inclusive batch-size
    ranges `[start, end, k]` from 1, each measured concurrency's best k (`best_k_per_concurrency`) holding from it
    to the next one measured (below the first, the first's; above the last, vLLM carries the last on), in a
    speculative config whose `num_speculative_tokens` is the largest k of the schedule. Where the installed vLLM
    has no such field (`has_field`, read from it by default) the best k per concurrency is given alone, and the
    config is the fixed k best at the lowest concurrency."""
    best = best_k_per_concurrency(throughput)
    has_field = vllm_has_batch_size_schedule() if has_field is None else has_field
    ranges: list[list[int]] = []
    for i, b in enumerate(best):
        start = 1 if i == 0 else b["concurrency"]
        end = best[i + 1]["concurrency"] - 1 if i + 1 < len(best) else max(b["concurrency"], start)
        if ranges and ranges[-1][2] == b["best_k"]:
            ranges[-1][1] = end  # the same k on: one range
        else:
            ranges.append([start, end, b["best_k"]])
    top = max(b["best_k"] for b in best)
    out: dict = {"best_k": best, "vllm_takes_schedule": has_field}
    if top == 0:
        out["note"] = "the target alone was fastest at every measured concurrency: serve it without the drafter"
        out["speculative_config"] = None
        return out
    config: dict = {"method": "eagle3", "model": drafter, "num_speculative_tokens": top}
    if has_field:
        config[SCHEDULE_FIELD] = ranges
        out[SCHEDULE_FIELD] = ranges
    else:
        config["num_speculative_tokens"] = best[0]["best_k"] or top
        out["note"] = (
            f"the installed vLLM takes no {SCHEDULE_FIELD}: one k for every batch size (the best at the lowest "
            "concurrency measured); a vLLM that has it takes the best k per concurrency"
        )
    out["speculative_config"] = config
    return out


def draft_token_report(serve, spec, drafter: str, prompts, max_tokens: int, sweep: int, trained: dict) -> dict:
    """The trained drafter served drafting `sweep` tokens (acceptance at every k up to it, and its throughput),
    then the target alone (throughput without a drafter), beside `trained`: the evaluation's own measurement at the
    served k, with its throughput. `serve(spec, folder_name)` is a context manager yielding a client of a server
    for `spec`, stopped when the block ends: two target loads in all."""
    concurrency = [t["concurrency"] for t in trained["throughput"]]
    with serve(replace(spec, drafter=drafter, num_speculative_tokens=sweep), "server-sweep") as client:
        # The acceptance comes from the throughput runs' own traffic (the same greedy prompts, once per
        # concurrency): no separate pass over the prompts.
        before = spec_counters(client.metrics())
        swept_throughput = [measure_throughput(client, prompts, max_tokens, c) for c in concurrency]
        swept = acceptance(before, spec_counters(client.metrics()))
        swept["prompts"] = len(prompts) * len(concurrency)
    with serve(replace(spec, drafter=None, layer_ids=None, storage_path=None), "server-target") as client:
        alone = [measure_throughput(client, prompts, max_tokens, c) for c in concurrency]
    with_drafter = {trained["num_speculative_tokens"]: trained["throughput"], sweep: swept_throughput}
    throughput = throughput_rows(alone, with_drafter)
    return {
        "draft_tokens": draft_token_table(swept, trained),
        "throughput": throughput,
        "swept": swept,
        "schedule": batch_size_schedule(throughput, drafter),
    }


def plot_draft_tokens(table: list[dict], throughput: list[dict], path: Path) -> Path:
    """Acceptance length against draft tokens, and output tokens per second with and without the drafter."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a worker
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ks = [r["k"] for r in table]
    left.bar(ks, [r["acceptance_at_k"] for r in table], color="#9ecae1", label="acceptance at position k")
    left.plot(ks, [r["acceptance_length"] for r in table], "o-", color="#08519c", label="acceptance length")
    measured = [(r["k"], r["measured_acceptance_length"]) for r in table if "measured_acceptance_length" in r]
    if measured:
        left.plot(*zip(*measured, strict=True), "s", color="#e6550d", label="measured at the served k")
    left.set(xlabel="draft tokens k", ylabel="tokens per target step", xticks=ks, title="How many draft tokens?")
    left.legend(fontsize=8)
    series = [key for key in throughput[0] if key == "target_alone" or key.startswith("drafter_k")]
    width = 0.8 / len(series)
    for j, key in enumerate(series):
        xs = [i + j * width for i in range(len(throughput))]
        right.bar(xs, [r[key] for r in throughput], width, label=key.replace("_", " "))
    right.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(throughput))])
    right.set_xticklabels([f"concurrency {r['concurrency']}" for r in throughput])
    right.set(ylabel="output tokens / s", title="Throughput")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Named evaluation sets (issue 25 item 3): the held-out prompts, plus each prompt file the config lists, each
# reported apart, per prompt category where the file has one.

HELD_OUT = "held-out"


def prompt_rows(path: Path, name: str, category_field: str = "category", limit: int | None = None) -> list[dict]:
    """A prompt file's rows as `{"messages": [...], "category": str | None}`, in file order: JSON lines (or one
    JSON list) whose rows hold MT-Bench-style `turns` (a list of user turns: the first is sent, later turns need the
    target's own answer to the one before), or `messages` (a conversation, cut before its first assistant turn,
    as the held-out prompts are). A row of neither shape is an error that names the row and the shapes taken."""
    from eyrie.errors import ConfigError

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"evaluation set {name!r}: cannot read its prompt file {path}: {e}") from e
    stripped = text.lstrip()
    rows_raw: list = json.loads(stripped) if stripped.startswith("[") else []
    if not rows_raw:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows_raw.append(json.loads(line))
                except ValueError as e:
                    raise ConfigError(f"evaluation set {name!r}: line {n} of {path} is not JSON ({e})") from e
    rows = []
    for n, row in enumerate(rows_raw, 1):
        messages = None
        if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            first = row["turns"][0]
            messages = [{"role": "user", "content": first if isinstance(first, str) else json.dumps(first)}]
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            cut = next((i for i, m in enumerate(row["messages"]) if m.get("role") == "assistant"), None)
            messages = row["messages"][:cut]
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ConfigError(
                f"evaluation set {name!r}: row {n} of {path} has no prompt: give each row `turns` (a list of user "
                "turns, MT-Bench style) or `messages` (a list of {role, content} with at least one turn before the "
                "first assistant turn)"
            )
        category = row.get(category_field)
        rows.append({"messages": messages, "category": None if category is None else str(category)})
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ConfigError(f"evaluation set {name!r}: {path} holds no prompts")
    return rows


def evaluation_sets(config, root: Path | None = None) -> dict[str, list[dict]]:
    """The prompt files `evaluate.prompt_sets` lists, by name, each its rows (`prompt_rows`); relative paths from
    `root` (the config's folder), each set capped at `evaluate.num_prompts` unless it says otherwise."""
    from eyrie.errors import ConfigError

    out: dict[str, list[dict]] = {}
    for s in getattr(config.evaluate, "prompt_sets", None) or []:
        if s.name == HELD_OUT or s.name in out:
            raise ConfigError(f"evaluate.prompt_sets: the name {s.name!r} is taken; give each set a name of its own")
        path = Path(s.path)
        if not path.is_absolute() and root is not None:
            path = root / path
        out[s.name] = prompt_rows(path, s.name, s.category_field, s.limit or config.evaluate.num_prompts)
    return out


def by_category(requests: list[dict], categories: list[str | None]) -> dict[str, dict]:
    """`request_statistics` for each prompt category (requests in prompt order, one category each); empty when no
    prompt has one."""
    if not any(c is not None for c in categories):
        return {}
    groups: dict[str, list[dict]] = {}
    for r, c in zip(requests, categories, strict=True):
        groups.setdefault(c if c is not None else "(none)", []).append(r)
    return {c: request_statistics(rs) for c, rs in sorted(groups.items())}


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


# ---------------------------------------------------------------------------------------------------------------
# Chat-template variants (issue 25 item 4): the prompts rendered as production serves them, switches included.


class TemplateVariant:
    """A server's client whose chat requests carry `chat_template_kwargs` (a variant's switches, e.g.
    `{"enable_thinking": true}`): vLLM renders each prompt with the target's chat template and these, as it does
    for production's requests. `metrics` is the server's own."""

    def __init__(self, client, chat_template_kwargs: dict):
        self.client, self.chat_template_kwargs = client, dict(chat_template_kwargs)

    def chat(self, messages: list[dict], max_tokens: int, timeout_s: float = 600) -> dict:
        body = {
            "model": "target",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        r = self.client.session.post(self.client.base_url + "/v1/chat/completions", json=body, timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> str:
        return self.client.metrics()


def template_variants(config) -> dict[str, dict]:
    """`evaluate.template_variants` by name: each its `chat_template_kwargs`."""
    from eyrie.errors import ConfigError

    out: dict[str, dict] = {}
    for v in getattr(config.evaluate, "template_variants", None) or []:
        if v.name in out:
            raise ConfigError(f"evaluate.template_variants: two variants are named {v.name!r}; name each apart")
        out[v.name] = dict(v.chat_template_kwargs)
    return out


def variant_set_name(set_name: str, variant: str) -> str:
    return f"{set_name}, {variant}"


def template_variant_warnings(chat_template: str | None, variants: dict[str, dict]) -> list[str]:
    """A variant whose switches the target's chat template never reads renders exactly as the default: measuring
    it tells nothing (a misspelt `enable_thinking`, or a template without that switch). One warning per switch the
    template's text does not name (`chat_template`: the tokenizer's template; None or empty: vLLM's default)."""
    out = []
    for name, switches in variants.items():
        unread = [k for k in switches if not chat_template or not re.search(rf"\b{re.escape(k)}\b", chat_template)]
        if unread:
            out.append(
                f"evaluate.template_variants {name!r}: the target's chat template never reads "
                f"{', '.join(unread)}, so this variant renders as the default; check the switch's name against the "
                "template (tokenizer_config.json `chat_template` or chat_template.jinja)"
            )
    return out
