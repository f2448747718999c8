"""Where a vLLM server's start-up went, read from its own log: the minutes of a 27-minute load, phase by phase.

vLLM prefixes its log lines with the time (`INFO 12-01 10:22:04 [file.py:N] ...`, to the second) and reports some
phases' own durations. The phases, in the order a start goes through them:

- `imports`: from Eyrie's launch (its `===== eyrie: starting vLLM at ... =====` line) to vLLM's first line;
- `engine start`: from there to the first worker's "Starting to load model" (the config, the engine core and its
  workers spawned, tensor-parallel groups formed);
- `weights`: from "Starting to load model" to the end of the last weight load (the target, then the drafter or the
  extraction head) — timed by the lines' stamps, since vLLM's own "Loading weights took" is wrong for the drafter of
  `extract_hidden_states` (1,581 s reported for a load that took none, vLLM 0.32 CPU);
- `engine init`: vLLM's own "init engine (profile, create kv cache, warmup model) took X s", of which `compile`
  (its "(compilation: X s)" or "torch.compile took X s in total") and `CUDA graphs` ("Graph capturing finished in
  X secs"), the rest being the memory profile, the KV cache and the warm-up;
- `API server`: from the engine's end to the first answered health probe (`ready_at` in server.json);
- `first request`: the latency of the first request the server answered once ready (a first request pays for what
  vLLM leaves to it: lazily compiled kernels, allocator growth, cold caches), and `ready to first answer`: from ready
  to that answer. vLLM's log has no request lines, so these are recorded by Eyrie's client when that answer comes
  (`with_first_answer`, through `eyrie.vllm.client.watch_first_answer`), beside the others in server.json.

Only the last start in the log is read (a server folder's log holds every start). A phase whose lines are missing
(an older or newer vLLM worded them otherwise) is left out rather than guessed.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

START_MARK = "===== eyrie: starting vLLM at "  # the line Eyrie writes into a server's log before each launch
EYRIE_START = re.compile(re.escape(START_MARK) + r"(\d{4})-(\d\d-\d\d \d\d:\d\d:\d\d) =====")
STAMP = re.compile(r"\b(?:INFO|WARNING|ERROR|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d) ")
LOAD_START = "Starting to load model"
LOAD_END = re.compile(r"Loading weights took|Model loading took")
ENGINE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
COMPILE = (re.compile(r"\(compilation: ([\d.]+) s"), re.compile(r"torch\.compile took ([\d.]+) s in total"))
GRAPHS = re.compile(r"Graph capturing finished in ([\d.]+) secs")

FIRST_REQUEST, FIRST_ANSWER = "first request", "ready to first answer"
AFTER_READY = (FIRST_REQUEST, FIRST_ANSWER)  # after the start's `total`, not part of it
PHASES = (
    "imports",
    "engine start",
    "weights",
    "engine init",
    "compile",
    "CUDA graphs",
    "API server",
    "total",
    *AFTER_READY,
)


def _stamp(year: str, month_day_time: str) -> float:
    return datetime.strptime(f"{year}-{month_day_time}", "%Y-%m-%d %H:%M:%S").timestamp()


def last_start(log_text: str) -> tuple[str, float | None, str]:
    """The text of the log's last start, the launch time Eyrie wrote before it, and that line's year."""
    starts = list(EYRIE_START.finditer(log_text))
    if not starts:
        return log_text, None, time.strftime("%Y")
    m = starts[-1]
    return log_text[m.end() :], _stamp(m.group(1), m.group(2)), m.group(1)


def phases(log_text: str, ready_at: float | None = None) -> dict[str, float]:
    """Seconds per phase of the log's last start (names in PHASES; `compile` and `CUDA graphs` are parts of
    `engine init`). `ready_at` (epoch seconds) closes the `API server` phase and the `total`."""
    text, launched, year = last_start(log_text)
    first = load_start = load_end = engine_end = None
    init = compile_s = graphs = None
    for line in text.splitlines():
        m = STAMP.search(line)
        if not m:
            continue
        t = _stamp(year, m.group(1))
        first = first if first is not None else t
        if LOAD_START in line and load_start is None:
            load_start = t
        if LOAD_END.search(line):
            load_end = t  # the last one: the drafter's or extraction head's load follows the target's
        if g := ENGINE_INIT.search(line):
            init, engine_end = float(g.group(1)), t
        for pattern in COMPILE:
            if c := pattern.search(line):
                compile_s = max(compile_s or 0.0, float(c.group(1)))
        if g := GRAPHS.search(line):
            graphs = max(graphs or 0.0, float(g.group(1)))
    out: dict[str, float] = {}

    def span(name: str, a: float | None, b: float | None) -> None:
        if a is not None and b is not None and b >= a:
            out[name] = b - a

    span("imports", launched, first)
    span("engine start", first, load_start)
    span("weights", load_start, load_end)
    if init is not None:
        out["engine init"] = init
    if compile_s is not None:
        out["compile"] = compile_s
    if graphs is not None:
        out["CUDA graphs"] = graphs
    span("API server", engine_end, ready_at)
    span("total", launched, ready_at)
    return out


def with_first_answer(state: dict, sent_at: float, answered_at: float) -> dict | None:
    """`state` (a server.json) with the first answer after ready among its phases: `first request` (that request's
    latency, `answered_at - sent_at`) and `ready to first answer`. None when there is nothing to record: the server
    is not ready yet, its first answer is recorded already, or this request was sent before it became ready (an
    answer of the start before, or of a wait that raced the health probe)."""
    ready = state.get("ready_at")
    measured = dict(state.get("phases") or {})
    if not ready or FIRST_REQUEST in measured or sent_at < ready or answered_at < sent_at:
        return None
    measured[FIRST_REQUEST] = answered_at - sent_at
    measured[FIRST_ANSWER] = answered_at - ready
    return {**state, "phases": measured}


def first_answer_recorded(state: dict | None) -> bool:
    return bool(state) and FIRST_REQUEST in ((state or {}).get("phases") or {})


def _seconds(name: str, value: float) -> str:
    return f"{value:.1f}" if name in AFTER_READY else f"{value:.0f}"


def table(measured: dict[str, float]) -> str:
    """A markdown table of the phases, with each one's share of the total."""
    total = measured.get("total")
    rows = ["| phase | seconds | share |", "|---|---:|---:|"]
    for name in PHASES:
        if name in measured:
            share = f"{measured[name] / total:.0%}" if total and name not in AFTER_READY else ""
            label = f"  of which {name}" if name in ("compile", "CUDA graphs") else name
            rows.append(f"| {label} | {_seconds(name, measured[name])} | {share} |")
    return "\n".join(rows)


def summary(measured: dict[str, float]) -> str:
    """One line: `weights 1581 s, engine init 212 s (compile 95 s, CUDA graphs 40 s), ...; first request 2.1 s,
    answered 30.5 s after ready`."""
    parts = []
    for name in PHASES:
        if name in measured and name not in ("compile", "CUDA graphs", "total", *AFTER_READY):
            part = f"{name} {measured[name]:.0f} s"
            if name == "engine init":
                inner = [f"{n} {measured[n]:.0f} s" for n in ("compile", "CUDA graphs") if n in measured]
                part += f" ({', '.join(inner)})" if inner else ""
            parts.append(part)
    line = ", ".join(parts)
    if FIRST_REQUEST in measured:
        after = f"first request {measured[FIRST_REQUEST]:.1f} s"
        if FIRST_ANSWER in measured:
            after += f", answered {measured[FIRST_ANSWER]:.1f} s after ready"
        line = f"{line}; {after}" if line else after
    return line
