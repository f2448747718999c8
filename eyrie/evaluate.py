"""evaluate: acceptance length on held-out prompts, read from vLLM's speculative-decoding counters.

Acceptance length is mean tokens per target step with the bonus token: 1 + accepted / drafts. Per-position rates are
accepted_at_position_i / drafts. Counters are read from the server's Prometheus /metrics before and after the
prompts, so a reused server's earlier traffic does not count.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


def measure(client, prompts: list[list[dict]], max_tokens: int, concurrency: int = 8) -> dict:
    """Send every prompt (greedy) and return the acceptance figures for exactly this traffic."""
    before = spec_counters(client.metrics())
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(lambda p: client.chat(p, max_tokens), prompts))
    after = spec_counters(client.metrics())
    result = acceptance(before, after)
    result["prompts"] = len(prompts)
    result["completion_tokens"] = sum(o["usage"]["completion_tokens"] for o in outs)
    return result
