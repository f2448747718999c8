"""The draft-token sweep: acceptance for k = 1..K from one server, throughput with and without the drafter."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from eyrie.stages.evaluate.counters import acceptance, spec_counters
from eyrie.stages.evaluate.schedule import batch_size_schedule

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
