"""The draft length per batch size: the best k per concurrency, as vLLM's speculative config takes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
