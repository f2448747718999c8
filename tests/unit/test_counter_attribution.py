"""Per-request counts that add up to the pooled figure (the "Seen" item of issue 25: pooled 1056 drafts / 2581
accepted against 1067 / 2570 summed over requests). Two causes, each shown on a stand-in server:

- a read of the counters right after an answer may not hold that request's last step yet (vLLM answers once the
  output is queued and records the step's counts afterwards): the next request's window then gets them. Reads wait
  until the server's metrics count the answered requests finished (`vllm:request_success`);
- the per-request counts came from a second pass of the prompts, each sent alone, while the pooled figure was the
  first pass's, sent concurrently: another batch (and a prefix-cache hit) generates other tokens. Without per-request
  metrics every prompt is now sent alone once, and the pooled figure is that traffic's.
"""

from __future__ import annotations

import threading
import time

from test_acceptance_statistics import spec_decode_lines

from eyrie.stages.evaluate import measure, request_counts, spec_counters
from eyrie.stages.evaluate.counters import settled_counters


def _response(hist: list[int] | None) -> dict:
    out: dict = {"usage": {"completion_tokens": 8}, "choices": [{"message": {"content": "x"}}]}
    if hist is not None:
        out["metrics"] = {"speculative_decoding": {"acceptance_histogram": hist}}
    return out


class StandIn:
    """A server's two surfaces `measure` reads, chat answers and Prometheus counters, with what vLLM may do:
    `lag` metrics reads pass before an answered request's counts show (0: at once); `batched`: a request sent while
    another is in flight is generated otherwise (other counts, `batched_hist`), as another batch on the CPU can."""

    def __init__(self, hists: dict[str, list[int]], per_request: bool, lag: int = 0, batched_hist=None):
        self.hists, self.per_request, self.lag, self.batched_hist = hists, per_request, lag, batched_hist
        self.totals = {"drafts": 0, "accepted": 0, "per_pos": [0, 0, 0], "finished": 0}
        self.pending: list[list] = []  # [reads left, counts]
        self.lock = threading.Lock()
        self.in_flight = 0
        self.sent = 0

    def _publish(self, c: dict) -> None:
        t = self.totals
        t["drafts"] += c["drafts"]
        t["accepted"] += c["accepted"]
        t["per_pos"] = [a + b for a, b in zip(t["per_pos"], c["per_pos"], strict=True)]
        t["finished"] += 1

    def chat(self, messages, max_tokens):
        with self.lock:
            self.in_flight += 1
            self.sent += 1
        hist = self.hists[messages[0]["content"]]
        if self.batched_hist:
            time.sleep(0.05)  # generating: requests sent together are in flight together
            with self.lock:
                if self.in_flight > 1:
                    hist = self.batched_hist(hist)
        c = request_counts(_response(hist))
        with self.lock:
            self.in_flight -= 1
            if self.lag:
                self.pending.append([self.lag, c])
            else:
                self._publish(c)
        return _response(hist if self.per_request else None)

    def metrics(self) -> str:
        with self.lock:
            for p in self.pending:
                p[0] -= 1
            for p in [p for p in self.pending if p[0] < 0]:
                self._publish(p[1])
                self.pending.remove(p)
            t = dict(self.totals)
        lines = [
            "# HELP vllm:request_success Count of successfully processed requests.",
            f'vllm:request_success_total{{engine="0",finished_reason="length"}} {t["finished"]}',
            'vllm:request_success_total{engine="0",finished_reason="stop"} 0.0',
            'vllm:request_success_created{engine="0",finished_reason="length"} 1.7e9',
            *spec_decode_lines(t),
        ]
        return "\n".join(lines)


HISTS = {f"p{i}": [i % 3, 1 + i % 2, 2, i % 4] for i in range(10)}
PROMPTS = [[{"role": "user", "content": f"p{i}"}] for i in range(10)]
WANT = [request_counts(_response(HISTS[f"p{i}"])) for i in range(10)]


def _sums(result: dict) -> tuple[int, int]:
    return sum(r["drafts"] for r in result["requests"]), sum(r["accepted"] for r in result["requests"])


def test_the_finished_requests_are_read_beside_the_spec_decode_counters():
    server = StandIn(HISTS, per_request=False)
    assert spec_counters(server.metrics())["finished"] == 0.0  # `_created` samples are not counts
    server.chat(PROMPTS[0], 8)
    assert spec_counters(server.metrics())["finished"] == 1.0
    assert spec_counters('vllm:spec_decode_num_drafts_total{engine="0"} 3')["finished"] is None


def test_counts_that_show_late_are_given_to_the_request_that_made_them():
    """Each answered request's counts reach the metrics two reads later: read at once, every window would hold
    the request before it (and the last request's counts none at all)."""
    result = measure(StandIn(HISTS, per_request=False, lag=2), PROMPTS, 8)
    assert result["requests_source"] == "counters around each prompt sent alone"
    assert result["requests"] == WANT
    assert (result["drafts"], result["accepted_tokens"]) == _sums(result)
    assert "counters_settled" not in result


def test_without_per_request_metrics_the_pooled_figure_is_the_same_traffic_as_the_requests():
    """A server that generates otherwise when requests share a batch: the pooled counters and the per-request ones
    come from one pass, every prompt alone, so they add up (the pass sent concurrently would not)."""

    def other(hist):  # batched: one more draft accepted nothing
        return [hist[0] + 1, *hist[1:]]

    server = StandIn(HISTS, per_request=False, batched_hist=other)
    result = measure(server, PROMPTS, 8, concurrency=4)
    assert server.sent == len(PROMPTS)  # one pass, not a concurrent one and then a second
    assert result["requests"] == WANT
    assert (result["drafts"], result["accepted_tokens"]) == _sums(result)
    assert result["statistics"]["pooled"]["acceptance_length"]["value"] == result["acceptance_length"]


def test_with_per_request_metrics_the_rest_go_concurrently_and_the_pooled_read_waits_for_all():
    server = StandIn(HISTS, per_request=True, lag=1)
    result = measure(server, PROMPTS, 8, concurrency=4)
    assert result["requests_source"] == "vllm per-request metrics" and result["requests"] == WANT
    assert (result["drafts"], result["accepted_tokens"]) == _sums(result)


def test_a_read_that_never_settles_gives_up_and_says_so(monkeypatch):
    import eyrie.stages.evaluate.counters as counters

    server = StandIn(HISTS, per_request=False, lag=10**9)  # never shows
    since = spec_counters(server.metrics())
    server.chat(PROMPTS[0], 8)
    read = settled_counters(server, since, 1, timeout_s=0.1)
    assert read["settled"] is False
    monkeypatch.setattr(counters, "SETTLE_TIMEOUT_S", 0.05)
    result = measure(server, PROMPTS[:2], 8)
    assert result["counters_settled"] is False


def test_a_server_without_finished_counts_is_read_at_once():
    class Bare(StandIn):
        def metrics(self):
            return "\n".join(line for line in super().metrics().splitlines() if "request_success" not in line)

    result = measure(Bare(HISTS, per_request=False), PROMPTS, 8)
    assert result["requests"] == WANT
