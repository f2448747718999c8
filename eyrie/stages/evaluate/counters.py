"""vLLM's speculative-decoding counters, overall and per request, and one measurement over a set of prompts."""

from __future__ import annotations

import importlib.util
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eyrie.stages.evaluate.intervals import request_statistics

_SAMPLE = re.compile(r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$")


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
