"""vLLM's speculative-decoding counters, overall and per request, and one measurement over a set of prompts."""

from __future__ import annotations

import importlib.util
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eyrie.stages.evaluate.intervals import request_statistics

_SAMPLE = re.compile(r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$")
# Requests the server finished (every finish reason, every engine): vLLM records it with the same step's
# spec-decode counts (`PrometheusStatLogger.record`), so counters that count a request finished include its drafts.
_FINISHED = re.compile(r"^vllm:request_success(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$")
SETTLE_TIMEOUT_S = 10.0  # the longest a read waits for the server's metrics to count the requests it answered
SETTLE_POLL_S = 0.02


def spec_counters(metrics_text: str) -> dict:
    """Sum vLLM's spec-decode counters over engines: drafts, draft_tokens, accepted, per_pos {i: n}; `finished`:
    the requests it finished (None when its metrics do not count them)."""
    per_pos: dict[int, float] = {}
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": per_pos, "finished": None}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for line in metrics_text.splitlines():
        if done := _FINISHED.match(line.strip()):
            out["finished"] = (out["finished"] or 0.0) + float(done.group(2))
            continue
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


def settled_counters(client, since: dict, answered: int, timeout_s: float | None = None) -> dict:
    """The server's counters once its metrics count the `answered` requests answered since `since` as finished.
    vLLM answers a request as soon as its last output is queued and records that step's counts afterwards (in the
    same pass of its output loop today; in a background thread, an API server of several processes, or a chunked
    output batch, later): counters read at once may lack the request's last drafts, which the next read then gives
    to the next request. A server whose metrics count no finished requests is read as it is; past `timeout_s` (or
    SETTLE_TIMEOUT_S, read at the call) the read is returned with `settled` False."""
    deadline = time.monotonic() + (SETTLE_TIMEOUT_S if timeout_s is None else timeout_s)  # read now: a knob
    while True:
        now = spec_counters(client.metrics())
        if since.get("finished") is None or now["finished"] is None or now["finished"] >= since["finished"] + answered:
            return {**now, "settled": True}
        if time.monotonic() >= deadline:
            return {**now, "settled": False}
        time.sleep(SETTLE_POLL_S)


def _alone(client, prompts: list[list[dict]], max_tokens: int, before: dict, outs: list[dict], after: dict):
    """The prompts after the first (`outs` holds its answer, `after` the counters once it finished), each sent alone
    between two settled reads of the counters: each request's counts, and the counters after the last."""
    requests = [_counts_between(before, after)]
    for p in prompts[len(outs) :]:
        outs.append(client.chat(p, max_tokens))
        now = settled_counters(client, after, 1)
        requests.append(_counts_between(after, now))
        after = {**now, "settled": now["settled"] and after["settled"]}
    return requests, after


def measure(client, prompts: list[list[dict]], max_tokens: int, concurrency: int = 8) -> dict:
    """Send every prompt (greedy) and return the acceptance figures for exactly this traffic: the pooled counters,
    each request's own counts (`requests`, in prompt order) and their statistics (`request_statistics`).

    The first prompt goes alone: whether its answer carries vLLM's per-request counts decides how the rest go.
    With them, the rest go `concurrency` at a time. Without them (a vLLM without per-request metrics, or a server
    started without the flag), every prompt is sent alone between two reads of the counters, and the pooled figure
    is taken over that same traffic: the per-request counts are then parts of the pooled ones, never of a second
    pass that, batched otherwise or hitting the prefix cache, generates other tokens. Every read waits until the
    server's metrics count the answered requests finished (`settled_counters`)."""
    before = spec_counters(client.metrics())
    outs: list[dict] = []
    requests: list[dict] = []
    source = "vllm per-request metrics"
    after = {**before, "settled": True}
    if prompts:
        outs.append(client.chat(prompts[0], max_tokens))
        after = settled_counters(client, before, 1)
        if request_counts(outs[0]) is not None:
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                outs += list(pool.map(lambda p: client.chat(p, max_tokens), prompts[1:]))
            after = settled_counters(client, after, len(prompts) - 1)
            found = [request_counts(o) for o in outs]
            requests = [r for r in found if r is not None]
        if len(requests) < len(outs):  # no per-request counts (or not in every answer): all alone, one pass
            source = "counters around each prompt sent alone"
            if requests:  # some answers had them: measured again, every figure from the new pass
                before, outs = after, [client.chat(prompts[0], max_tokens)]
                after = settled_counters(client, before, 1)
            requests, after = _alone(client, prompts, max_tokens, before, outs, after)
    result = acceptance(before, after)
    result["prompts"] = len(prompts)
    result["completion_tokens"] = sum(o["usage"]["completion_tokens"] for o in outs)
    if not after.get("settled", True):
        result["counters_settled"] = False  # a read gave up waiting: the split between requests may be off
    result["requests"] = requests
    result["requests_source"] = source
    result["statistics"] = request_statistics(requests)
    return result
