"""Acceptance as vLLM serves it, with its uncertainty (eyrie/stages/evaluate/), and the promotion decisions made
on it (eyrie/stages/promote.py): per-request counts from vLLM's response metrics, pooled vs mean-of-per-request
figures with intervals, the paired comparison, a useless drafter never promoted, and the promotion folder locked
across the decision and the swap."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from eyrie.stages.evaluate import (
    PER_REQUEST_METRICS,
    baseline_warnings,
    compare_drafters,
    measure,
    paired_difference,
    request_counts,
    request_statistics,
    vllm_has_per_request_metrics,
    with_per_request_metrics,
)
from eyrie.stages.promote import current_version, decide, decide_and_promote, promotion_lock


def _response(hist: list[int] | None, tokens: int = 10) -> dict:
    out: dict = {"usage": {"completion_tokens": tokens}, "choices": [{"message": {"content": "x"}}]}
    if hist is not None:
        out["metrics"] = {
            "speculative_decoding": {
                "acceptance_histogram": hist,
                "num_spec_steps": sum(hist),
                "mean_acceptance_length": 0.0,
                "draft_acceptance_rate": 0.0,
                "num_accepted_draft_tokens": 0,
                "num_draft_tokens": 3 * sum(hist),
                "num_spec_tokens": 3,
            }
        }
    return out


def test_a_response_histogram_gives_the_requests_counts_per_position():
    # 2 steps accepting 0, 1 accepting 1, 3 accepting 2, 4 accepting all 3.
    counts = request_counts(_response([2, 1, 3, 4]))
    assert counts == {"drafts": 10, "accepted": 1 + 6 + 12, "per_pos": [8, 7, 4]}
    assert request_counts(_response(None)) is None


def test_pooled_and_mean_of_per_request_differ_and_each_has_an_interval():
    """One long request that drafts well and many short ones that do not: the pooled figure follows the long one
    (vllm #42508's confusion), the per-request mean the short ones."""
    requests = [{"drafts": 100, "accepted": 280, "per_pos": [98, 95, 87]}]
    requests += [{"drafts": 4, "accepted": 2, "per_pos": [2, 0, 0]} for _ in range(9)]
    requests.append({"drafts": 0, "accepted": 0, "per_pos": [0, 0, 0]})  # a one-token answer: in neither
    stats = request_statistics(requests)
    pooled, mean = stats["pooled"]["acceptance_length"], stats["per_request_mean"]["acceptance_length"]
    assert stats["requests_with_drafts"] == 10
    assert pooled["value"] == round(1 + 298 / 136, 4) and mean["value"] == round(1 + (2.8 + 9 * 0.5) / 10, 4)
    assert pooled["value"] > 3 > 2 > mean["value"]
    for fig in (pooled, mean):
        assert fig["se"] > 0 and fig["ci95"][0] < fig["value"] < fig["ci95"][1]
    assert [f["value"] for f in stats["pooled"]["per_position"]] == [round(116 / 136, 4), round(95 / 136, 4), 0.6397]
    assert len(stats["per_request_mean"]["per_position"]) == 3


def spec_decode_lines(t: dict) -> list[str]:
    """vLLM's spec-decode counters in its Prometheus text, for totals {drafts, accepted, per_pos} (3 draft tokens)."""
    return [
        f'vllm:spec_decode_num_drafts_total{{engine="0"}} {t["drafts"]}',
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {3 * t["drafts"]}',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {t["accepted"]}',
        *(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} {v}'
            for i, v in enumerate(t["per_pos"])
        ),
    ]


class FakeClient:
    """A server's two surfaces `measure` reads: chat responses and the Prometheus counters."""

    def __init__(self, hists: dict[str, list[int]], per_request: bool):
        self.hists, self.per_request = hists, per_request
        self.totals = {"drafts": 0, "accepted": 0, "per_pos": [0, 0, 0]}
        self.lock = threading.Lock()

    def chat(self, messages, max_tokens):
        hist = self.hists[messages[0]["content"]]
        c = request_counts(_response(hist))
        with self.lock:
            self.totals["drafts"] += c["drafts"]
            self.totals["accepted"] += c["accepted"]
            self.totals["per_pos"] = [a + b for a, b in zip(self.totals["per_pos"], c["per_pos"], strict=True)]
        return _response(hist if self.per_request else None)

    def metrics(self) -> str:
        return "\n".join(spec_decode_lines(self.totals))


@pytest.mark.parametrize("per_request", [True, False], ids=["response-metrics", "counters-per-prompt"])
def test_measure_keeps_each_requests_counts_in_prompt_order(per_request):
    hists = {f"p{i}": [i % 3, 1, 2, i] for i in range(12)}
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(12)]
    result = measure(FakeClient(hists, per_request), prompts, 16, concurrency=4)
    want = [request_counts(_response(hists[f"p{i}"])) for i in range(12)]
    assert result["requests"] == want
    assert result["requests_source"] == (
        "vllm per-request metrics" if per_request else "counters around each prompt sent alone"
    )
    # The pooled figure from the requests is the counters' own.
    assert result["statistics"]["pooled"]["acceptance_length"]["value"] == result["acceptance_length"]


def _requests(rng: random.Random, rates: list[float], drafts: list[int]) -> list[dict]:
    """Each prompt's counts for a chain drafter whose step accepts each next token with probability rate."""
    out = []
    for rate, n in zip(rates, drafts, strict=True):
        accepted, per_pos = 0, [0, 0, 0]
        for _ in range(n):
            j = 0
            while j < 3 and rng.random() < rate:
                j += 1
            accepted += j
            for i in range(j):
                per_pos[i] += 1
        out.append({"drafts": n, "accepted": accepted, "per_pos": per_pos})
    return out


def test_an_equal_drafter_is_almost_never_clearly_better_and_a_better_one_is():
    """The same prompts measured twice with an equal drafter: `new >= old` promotes about half the time; the paired
    rule about 5%. A drafter better by a margin the prompts resolve is promoted."""
    rng = random.Random(0)
    prompts = 40
    ease = [rng.uniform(0.3, 0.9) for _ in range(prompts)]  # prompts differ far more than drafters do
    drafts = [rng.randint(5, 40) for _ in range(prompts)]
    naive = paired = 0
    trials = 200
    for _ in range(trials):
        a, b = _requests(rng, ease, drafts), _requests(rng, ease, drafts)
        cmp = paired_difference({"requests": a}, {"requests": b})
        naive += cmp["new"] >= cmp["old"]
        paired += cmp["clearly_better"]
    assert 0.35 < naive / trials < 0.65
    assert paired / trials < 0.12
    better = _requests(rng, [min(e + 0.08, 0.99) for e in ease], drafts)
    cmp = paired_difference({"requests": better}, {"requests": _requests(rng, ease, drafts)})
    assert cmp["clearly_better"] and cmp["difference"] > 0 and cmp["ci95"][0] > 0


def _measured(requests, label, drafter=None):
    stats = request_statistics(requests)
    out = {
        "label": label,
        "acceptance_length": stats["pooled"]["acceptance_length"]["value"],
        "requests": requests,
        "statistics": stats,
    }
    if drafter:
        out["drafter"] = str(drafter)
    return out


def test_a_useless_drafter_is_a_warning_and_never_promoted(tmp_path):
    """The issue's run: trained 1.0 against untrained 1.0 ended with exit 0 and no warning."""
    rng = random.Random(1)
    zero = [{"drafts": n, "accepted": 0, "per_pos": [0, 0, 0]} for n in (rng.randint(5, 30) for _ in range(20))]
    results = {"trained": _measured(zero, "trained"), "untrained": _measured(zero, "untrained")}
    comparisons = compare_drafters(results)
    [warning] = baseline_warnings(results, comparisons)
    assert "not clearly better than an untrained drafter" in warning and "It is not promoted" in warning
    candidate = {**results["trained"], "versus": comparisons}
    ok, why = decide(candidate, None)
    assert not ok and "untrained" in why
    drafter = tmp_path / "d"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    d = decide_and_promote(tmp_path / "promo", drafter, "v1", candidate, None, {})
    assert not d["promoted"] and current_version(tmp_path / "promo") is None
    # A drafter that does draft well is no warning, and is promoted as the first one.
    good = _requests(rng, [0.7] * 20, [r["drafts"] for r in zero])
    results = {"trained": _measured(good, "trained"), "untrained": _measured(zero, "untrained")}
    comparisons = compare_drafters(results)
    assert baseline_warnings(results, comparisons) == []
    assert decide({**results["trained"], "versus": comparisons}, None)[0]


def _drafter(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"name": name}))
    return d


def test_a_current_drafter_promoted_by_another_run_meanwhile_refuses_the_swap(tmp_path):
    """Issue 22: two runs sharing promotion.dir each measured against v1; the first to promote wins, the second
    refuses (its comparison was against a drafter no longer current) instead of replacing it."""
    promo = tmp_path / "promo"
    rng = random.Random(2)
    drafts = [20] * 30
    assert decide_and_promote(promo, _drafter(tmp_path, "a"), "v1", {"acceptance_length": 2.0}, None, {})["promoted"]
    v1 = current_version(promo)
    current = _measured(_requests(rng, [0.5] * 30, drafts), "current", drafter=v1)
    run_b = _measured(_requests(rng, [0.8] * 30, drafts), "trained")
    run_c = _measured(_requests(rng, [0.7] * 30, drafts), "trained")
    b = decide_and_promote(promo, _drafter(tmp_path, "b"), "v2", run_b, current, {"run_dir": "B"})
    assert b["promoted"] and "clearly better than the current drafter" in b["reason"]
    c = decide_and_promote(promo, _drafter(tmp_path, "c"), "v3", run_c, current, {"run_dir": "C"})
    assert not c["promoted"] and "changed since this run measured against it" in c["reason"]
    assert current_version(promo).name == "v2"
    history = [json.loads(line) for line in (promo / "history.jsonl").read_text().splitlines()]
    assert [(h["version"], h["promoted"]) for h in history] == [("v1", True), ("v2", True), ("v3", False)]


def test_the_promotion_lock_is_held_across_the_decision_and_the_swap(tmp_path):
    promo = tmp_path / "promo"
    entered = threading.Event()
    order = []

    def holder():
        with promotion_lock(promo):
            entered.set()
            time.sleep(0.5)
            order.append("holder done")

    t = threading.Thread(target=holder)
    t.start()
    entered.wait(5)
    decide_and_promote(promo, _drafter(tmp_path, "a"), "v1", {"acceptance_length": 2.0}, None, {})
    order.append("promoted")
    t.join()
    assert order == ["holder done", "promoted"]


def test_serving_arguments_ask_for_per_request_metrics_where_vllm_has_them():
    assert vllm_has_per_request_metrics()  # vLLM 0.32 (the test stack) has them
    args = with_per_request_metrics(["--max-num-seqs", "8"])
    assert args == ["--max-num-seqs", "8", PER_REQUEST_METRICS, "summary"]
    assert with_per_request_metrics(args) == args  # not twice
    assert with_per_request_metrics([f"{PER_REQUEST_METRICS}=detailed"]) == [f"{PER_REQUEST_METRICS}=detailed"]


def test_with_no_untrained_drafter_served_the_floor_is_the_baseline():
    """The default serves no untrained drafter (its figure is the floor, 1.0): a trained drafter whose drafts are
    never accepted is compared with that floor, warned about and not promoted; one clearly above it passes."""
    rng = random.Random(3)
    zero = [{"drafts": n, "accepted": 0, "per_pos": [0, 0, 0]} for n in (rng.randint(5, 30) for _ in range(20))]
    results = {"trained": _measured(zero, "trained")}
    comparisons = compare_drafters(results)
    assert comparisons["floor"]["difference"] == 0 and not comparisons["floor"]["clearly_better"]
    [warning] = baseline_warnings(results, comparisons)
    assert "not clearly better than no drafter at all" in warning
    ok, why = decide({**results["trained"], "versus": comparisons}, None)
    assert not ok and "no drafter" in why
    good = {"trained": _measured(_requests(rng, [0.6] * 20, [r["drafts"] for r in zero]), "trained")}
    comparisons = compare_drafters(good)
    assert comparisons["floor"]["clearly_better"] and baseline_warnings(good, comparisons) == []
    assert decide({**good["trained"], "versus": comparisons}, None)[0]
