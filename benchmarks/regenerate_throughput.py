"""Regeneration throughput: Eyrie's client against a bare asynchronous client of the same vLLM server.

Both clients answer the same prepared conversations on one running extraction server (the regenerate stage's
server: `RegenerationPlan`'s spec, which is `ServerSpec.for_extraction`, with the `extract_hidden_states` method and
Eyrie's connector; served model "target"):

- eyrie: `eyrie.stages.regenerate.regenerate_shard` over every shard, in this process, into a fresh stage folder per
  repeat, two shards at a time as the regenerate flow's task runner runs them (flows/regenerate.py), each with its
  own `ServerClient` built as tasks/regenerate.py builds it; the shards share the server's window (one asyncio loop,
  one session: `eyrie.stages.regenerate.window`), `regenerate.concurrency` slots each. Timed wall, from the first
  shard's start to the last shard's manifest: the rows and manifests written, as the stage writes them.
- bare: the server's pace for the same requests. One asyncio loop and one aiohttp session replay exactly the
  request bodies Eyrie's client sent (recorded, body for body, during an untimed first Eyrie pass: token-id
  prompt, max_tokens, temperature, top_p, seed, cache salt, the hidden-states skip), each conversation's turns in
  order and one at a time (turn k's prompt holds Eyrie's answers of the earlier turns), and read `token_ids` from
  each answer, nothing else: no template, no row, no parquet, no manifest.

Requests in flight: two shards run at once, each bringing `concurrency` slots to the window, so Eyrie holds up to
the sum of min(`concurrency`, the shard's rows) over its first two shards (32 at the demo's concurrency 16 and
shards of 16 or more). The bare client keeps exactly that many conversations going all pass long, each worker
taking the next conversation when its last turn is answered. It is Eyrie's peak, not its mean: whatever leaves
slots idle in Eyrie (a shard's start, its loop waiting for the GIL) the bare client does not give away, so it is part
of the ratio.

Agreement: the share of the bare client's answers whose generated token ids equal the ones Eyrie's recorded pass
got for the same body, of their first tokens, and of generated tokens before the first difference. Greedy (or
seeded) answers repeat on CPU; on a GPU, batches of other sizes may flip a token (a bf16 target of random weights,
whose top logits lie close, more often than a trained one), and every later token of the answer follows from the
flip: reported, not failed. First tokens depend on the prompt alone: under half of them equal means the replay sends
other prompts, and the benchmark fails.

Untimed set-up, as `benchmarks/extract_throughput.py` does it (whose `synthetic_source` this reuses): build the tiny
target if the config names one, prepare, preflight, start the server, then one whole Eyrie pass that records the
bodies and warms the server (with prefix caching on, vLLM's default, every timed pass then finds the same prompts
cached; `--no-prefix-caching` computes every token each pass). Each repeat rotates which client goes first;
every pass starts after an untimed `sync` (Eyrie fsyncs its rows and manifests: none should wait for another pass's
writeback). Figures are medians over repeats; the server is always stopped at the end.

Run from the repository root (make sets the cache and offline variables the server needs):

    .venv/bin/python benchmarks/regenerate_throughput.py --config configs/demo.yaml --max-samples 32 --repeats 2
    .venv/bin/python benchmarks/regenerate_throughput.py --max-samples 128 --shard-size 32 --max-tokens 128

Prints both clients' wall, requests, generated tokens, generated tokens/s and CPU seconds, the ratio eyrie/bare
(generated tokens/s), the requests in flight (time-weighted mean and peak, each counted while its POST is open) and
the agreement; writes `<work-dir>/bench.json` (with each Eyrie pass's shard spans and in-flight steps).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import _cache_env  # noqa: F401  (before vLLM or transformers are imported)
from extract_throughput import FLOW_SHARD_TASKS, synthetic_source

import eyrie.stages.regenerate.shard as shard_module
from eyrie.config import load_config
from eyrie.run.folder import RunFolder
from eyrie.stages.extract import clean_staging
from eyrie.stages.preflight import run_preflight
from eyrie.stages.prepare import load_shards, prepare
from eyrie.stages.regenerate import RegenerationPlan, regenerate_shard, shared_tokenizer
from eyrie.stages.regenerate.shard import conversations_digest, load_conversations
from eyrie.target.tiny import build_target
from eyrie.vllm.client import ServerClient
from eyrie.vllm.process import VllmServer

# Minimum agreement of the bare replay with Eyrie's answers: below it the replay sends something else.
MIN_AGREEMENT = 0.5


def first_rows(prepare_dir: Path, shards, n: int):
    """The shards that hold the first `n` rows, the last one cut at `n` with the digest of the rows it keeps (what
    `load_conversations` checks)."""
    out = []
    for s in shards:
        if s.start >= n:
            break
        if s.stop > n:
            cut = replace(s, stop=n)
            s = replace(cut, conversations=conversations_digest(load_conversations_unchecked(prepare_dir, cut)))
        out.append(s)
    return out


def load_conversations_unchecked(prepare_dir: Path, shard) -> list[list[dict]]:
    rows = []
    with open(prepare_dir / "conversations.jsonl", "rb") as f:
        f.seek(shard.conversations_offset)
        for _ in range(shard.stop - shard.start):
            rows.append(json.loads(f.readline())["messages"])
    return rows


class InFlight:
    """Requests in flight over a pass, time-weighted: what a client keeps the server busy with. `mean` is the
    integral of the count over the pass's wall, divided by it; `peak` the most at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self.start()

    def start(self) -> None:
        """The pass starts now: nothing counted before."""
        with self._lock:
            self.count = self.peak = 0
            self.area = 0.0
            self.steps: list[tuple[float, int]] = []  # (seconds into the pass, requests in flight from then)
            self.t0 = self._last = time.perf_counter()

    def _move(self, by: int) -> None:
        with self._lock:
            now = time.perf_counter()
            self.area += self.count * (now - self._last)
            self._last = now
            self.count += by
            self.peak = max(self.peak, self.count)
            if by:
                self.steps.append((round(now - self.t0, 4), self.count))

    def __enter__(self) -> None:
        self._move(1)

    def __exit__(self, *exc) -> None:
        self._move(-1)

    def summary(self) -> dict:
        self._move(0)
        wall = self._last - self.t0
        return {"in_flight_mean": self.area / wall if wall > 0 else 0.0, "in_flight_peak": self.peak}

    def wrap_client(self, client: ServerClient) -> ServerClient:
        return wrap_generate(client, self._counted)

    def _counted(self, generate):
        async def counted(*args, **kw):
            with self:
                return await generate(*args, **kw)

        return counted


def wrap_generate(client: ServerClient, wrap) -> ServerClient:
    """`client.async_generator` (what regeneration's window sends every request through) yielding `wrap(generate)`."""
    original = client.async_generator

    @contextlib.asynccontextmanager
    async def async_generator():
        async with original() as generate:
            yield wrap(generate)

    client.async_generator = async_generator  # type: ignore[method-assign]
    return client


class Recorder:
    """Records, per conversation and in turn order, every body Eyrie's client posted for a generation and the token
    ids of its answer: `regenerate_conversation` (one conversation, in one of the window's workers) is wrapped
    to open a conversation in its context, and each client's generation coroutine to add the answered bodies to it
    (the body rebuilt from the call's arguments by the client's own `_generate_body`)."""

    def __init__(self):
        self.conversations: list[list[dict]] = []
        self._turns: contextvars.ContextVar[list[dict] | None] = contextvars.ContextVar("turns", default=None)

    def wrap_conversation(self, original):
        async def regenerate_conversation(*args, **kw):
            turns: list[dict] = []
            self.conversations.append(turns)
            token = self._turns.set(turns)
            try:
                return await original(*args, **kw)
            finally:
                self._turns.reset(token)

        return regenerate_conversation

    def wrap_client(self, client: ServerClient) -> ServerClient:
        return wrap_generate(client, self._recording)

    def _recording(self, generate):
        async def recording(token_ids, max_tokens, temperature, top_p, seed, *args, **kw):
            body = ServerClient._generate_body(list(token_ids), max_tokens, temperature, top_p, seed)
            out = await generate(token_ids, max_tokens, temperature, top_p, seed, *args, **kw)
            turns = self._turns.get()
            if turns is not None:
                turns.append({"body": body, "token_ids": list(out["token_ids"])})
            return out

        return recording


def run_eyrie(base_url, api_key, tokenizer, prepare_dir, out: Path, shards, keys, cfg, max_length, variants, rec=None):
    """Eyrie's pass: every shard through `regenerate_shard`, two at a time as the flow runs them, each with its own
    client (tasks/regenerate.py); `rec` records the bodies (the untimed first pass)."""

    meter = InFlight()
    spans: list[tuple[str, float, float]] = []  # each shard task's start and return, seconds into the pass

    def one(s) -> dict:
        client = meter.wrap_client(ServerClient(base_url, api_key))
        if rec is not None:
            rec.wrap_client(client)
        started = time.perf_counter() - meter.t0
        m = regenerate_shard(client, tokenizer, prepare_dir, out, s, keys[s.name], cfg, max_length, None, variants)
        spans.append((s.name, round(started, 3), round(time.perf_counter() - meter.t0, 3)))
        return m

    shutil.rmtree(out, ignore_errors=True)
    original = shard_module.regenerate_conversation
    if rec is not None:
        shard_module.regenerate_conversation = rec.wrap_conversation(original)
    try:
        t0, cpu0 = time.perf_counter(), time.process_time()
        meter.start()
        with ThreadPoolExecutor(max_workers=FLOW_SHARD_TASKS) as tasks:
            manifests = list(tasks.map(one, shards))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        shard_module.regenerate_conversation = original
    stats = [m["stats"] for m in manifests]
    failed: dict[str, int] = {}
    for s in stats:
        for reason, k in s["failed"].items():
            failed[reason] = failed.get(reason, 0) + k
    return {
        "wall_s": wall,
        "client_cpu_s": cpu,
        "requests": sum(s["requests"] for s in stats),
        "generated_tokens": sum(s["generated_tokens"] for s in stats),
        "rows_in": sum(s["rows_in"] for s in stats),
        "rows_out": sum(s["rows_out"] for s in stats),
        "length_capped": sum(s["length_capped"] for s in stats),
        "failed": failed,
        "shards_s": [m["seconds"] for m in manifests],  # each shard's own time (its manifest)
        **meter.summary(),
        "shard_spans": spans,
        "in_flight_steps": meter.steps,
    }


async def _bare_pass(url: str, api_key: str | None, conversations, window: int, timeout_s: float):
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    todo = iter(enumerate(conversations))
    answers: list[list[list[int]]] = [[] for _ in conversations]
    meter = InFlight()

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=window),
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as session:

        async def worker() -> None:
            for i, turns in todo:  # one shared iterator: a worker takes the next conversation when its own is done
                for turn in turns:  # in order: turn k's prompt holds the answers of the earlier turns
                    with meter:
                        async with session.post(url + "/v1/completions", json=turn["body"]) as r:
                            if r.status != 200:
                                raise RuntimeError(f"vLLM answered {r.status}: {(await r.text())[:300]}")
                            answers[i].append((await r.json())["choices"][0]["token_ids"])

        meter.start()
        await asyncio.gather(*(worker() for _ in range(window)))
    return answers, meter.summary()


def run_bare(url: str, api_key: str | None, conversations, window: int, timeout_s: float) -> dict:
    t0, cpu0 = time.perf_counter(), time.process_time()
    answers, in_flight = asyncio.run(_bare_pass(url, api_key, conversations, window, timeout_s))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    pairs = [(a, t["token_ids"]) for conv, got in zip(conversations, answers) for t, a in zip(conv, got)]
    return {
        "wall_s": wall,
        "client_cpu_s": cpu,
        "requests": len(pairs),
        "generated_tokens": sum(len(a) for a, _ in pairs),
        **in_flight,
        **agreement(pairs),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def agreement(pairs: list[tuple[list[int], list[int]]]) -> dict:
    """How far the bare client's answers (first of each pair) equal Eyrie's recorded ones: whole answers, first
    tokens (which only the prompt decides: a replay that sends other prompts loses these), and generated tokens
    before the first difference (a flip ends an answer's agreement: every later token follows from it)."""
    n = max(1, len(pairs))
    return {
        "agreement": sum(a == b for a, b in pairs) / n,
        "first_token_agreement": sum(a[:1] == b[:1] for a, b in pairs) / n,
        "token_agreement": sum(common_prefix(a, b) for a, b in pairs) / max(1, sum(len(b) for _, b in pairs)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--work-dir", default="runs/bench-regen")
    ap.add_argument("--max-samples", type=int, help="conversations to regenerate (default: all prepared)")
    ap.add_argument("--concurrency", type=int, help="conversations in flight per shard (default: regenerate's)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--synthetic-tokens",
        type=int,
        help="conversations of about this many tokens, joined from the source's (benchmarks/extract_throughput.py)",
    )
    ap.add_argument("--no-prefix-caching", action="store_true", help="serve with --no-enable-prefix-caching")
    ap.add_argument(
        "--shard-size", type=int, help="rows per shard (default: the config's; 256 with --synthetic-tokens)"
    )
    ap.add_argument("--max-tokens", type=int, help="most tokens per answer (default: regenerate.max_tokens)")
    args = ap.parse_args()

    config = load_config(args.config)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run = RunFolder(work)
    if config.target.tiny:
        build_target(config.target.tiny, config.target.model)
    if args.synthetic_tokens:
        want = args.max_samples or 256
        count = int(want / (1 - config.data.eval_fraction)) + 32  # held-out rows leave prepare's dataset
        source = work / f"synthetic_{args.synthetic_tokens}.jsonl"
        synthetic_source(config, count, args.synthetic_tokens, source)
        config.data.source = str(source)
        config.data.max_length = args.synthetic_tokens + 256
        config.data.max_samples = None
        config.data.shard_size = args.shard_size or 256
        config.target.max_model_len = max(config.target.max_model_len or 0, config.data.max_length + 1)
    elif args.shard_size:
        config.data.shard_size = args.shard_size
    cfg = config.regenerate
    if args.concurrency:
        cfg.concurrency = args.concurrency
    if args.max_tokens:
        cfg.max_tokens = args.max_tokens
    prepare(config.target, config.data, run.prepare)
    report = run_preflight(config, work, serve=False)
    plan = RegenerationPlan(config, run, report)
    if args.no_prefix_caching:
        plan.spec.server_args = [*plan.spec.server_args, "--no-enable-prefix-caching"]
    all_shards = load_shards(run.prepare)
    total = all_shards[-1].stop
    n = min(args.max_samples or total, total)
    shards = first_rows(run.prepare, all_shards, n)
    for s in shards:
        load_conversations(run.prepare, s)  # the cut shard's digest checked before any server starts
    # Eyrie's peak of conversations in flight (its first two shards' pools, each at most its rows): the bare window.
    window = sum(min(cfg.concurrency, s.stop - s.start) for s in shards[:FLOW_SHARD_TASKS])
    tokenizer = shared_tokenizer(config.target)
    timeout_s = cfg.request_timeout_s
    api_key = plan.spec.api_key()
    stage_out = work / "eyrie_regen"

    def eyrie_pass(rec=None) -> dict:
        return run_eyrie(
            server.url(),
            api_key,
            tokenizer,
            run.prepare,
            stage_out,
            shards,
            plan.keys,
            cfg,
            config.data.max_length,
            plan.variants,
            rec,
        )

    server = VllmServer(plan.server_dir)
    if not server.healthy():
        clean_staging(plan.staging)
    clients = ["eyrie", "bare"]
    runs: dict[str, list[dict]] = {c: [] for c in clients}
    try:
        server.ensure(plan.spec, config.extraction.startup_timeout_s)
        # Untimed: one whole Eyrie pass that records every body it sends, and warms the server (first requests pay
        # one-off costs; with prefix caching on, every timed pass then finds the same prompts cached).
        print("recording pass (eyrie, untimed) ...", flush=True)
        rec = Recorder()
        recorded = eyrie_pass(rec)
        conversations = [c for c in rec.conversations if c]
        recorded_requests = sum(map(len, conversations))
        if recorded_requests != recorded["requests"]:
            raise RuntimeError(f"recorded {recorded_requests} bodies, Eyrie's manifests count {recorded['requests']}")
        for r in range(args.repeats):
            order = clients[r % len(clients) :] + clients[: r % len(clients)]  # a different client first each repeat
            for name in order:
                print(f"repeat {r + 1}/{args.repeats}: {name} ...", flush=True)
                # Untimed: the last pass's rows gone and every dirty page written out, so no pass's fsyncs (Eyrie
                # fsyncs each rows file and manifest) wait for another's writeback.
                shutil.rmtree(stage_out, ignore_errors=True)
                os.sync()
                if name == "eyrie":
                    res = eyrie_pass()
                else:
                    res = run_bare(server.url(), api_key, conversations, window, timeout_s)
                    if res["first_token_agreement"] < MIN_AGREEMENT:
                        raise RuntimeError(
                            f"the bare replay's first tokens equal Eyrie's on {res['first_token_agreement']:.1%} of "
                            "requests: it does not send what Eyrie sent"
                        )
                res["tokens_per_s"] = res["generated_tokens"] / res["wall_s"]
                print(
                    f"  {res['wall_s']:.2f} s, {res['requests']} requests, {res['generated_tokens']} tokens, "
                    f"{res['tokens_per_s']:,.0f} generated tokens/s, {res['in_flight_mean']:.1f} requests in flight "
                    f"(mean; peak {res['in_flight_peak']})",
                    flush=True,
                )
                runs[name].append(res)
    finally:
        server.stop()

    rows = {}
    for name, rs in runs.items():
        rows[name] = {
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "requests": statistics.median(r["requests"] for r in rs),
            "generated_tokens": statistics.median(r["generated_tokens"] for r in rs),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            # This process's CPU time in the pass (every thread): what the client takes from the server's cores.
            "client_cpu_s": statistics.median(r["client_cpu_s"] for r in rs),
            # Requests in flight, time-weighted over the pass's wall (mean) and at most (peak).
            "in_flight_mean": statistics.median(r["in_flight_mean"] for r in rs),
            "in_flight_peak": max(r["in_flight_peak"] for r in rs),
        }
    ratio = rows["eyrie"]["tokens_per_s"] / rows["bare"]["tokens_per_s"]
    agree = {k: [r[k] for r in runs["bare"]] for k in ("agreement", "first_token_agreement", "token_agreement")}
    turns = {}
    for c in conversations:
        turns[len(c)] = turns.get(len(c), 0) + 1

    print(
        f"\n{n} conversations in {len(shards)} shard(s) ({recorded['rows_out']} regenerated, "
        f"{recorded['length_capped']} length-capped, turns sent per conversation {dict(sorted(turns.items()))}), "
        f"max_tokens {cfg.max_tokens}, concurrency {cfg.concurrency} per shard, bare window {window}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}, {args.repeats} repeat(s) (medians); "
        f"model {plan.spec.model}"
    )
    print(f"{'':24}" + "".join(f"{c:>14}" for c in clients))
    for key, fmt in [
        ("wall_s", ".2f"),
        ("requests", ".0f"),
        ("generated_tokens", ".0f"),
        ("tokens_per_s", ",.0f"),
        ("client_cpu_s", ".2f"),
        ("in_flight_mean", ".1f"),
        ("in_flight_peak", ".0f"),
    ]:
        print(f"{key:24}" + "".join(f"{format(rows[c][key], fmt):>14}" for c in clients))
    print(f"ratio eyrie/bare (generated tokens/s): {ratio:.3f}x")
    print(
        f"agreement with Eyrie's recorded answers, min over the bare passes ({recorded_requests} requests): "
        f"answers equal {min(agree['agreement']):.1%}, first tokens equal {min(agree['first_token_agreement']):.1%}, "
        f"generated tokens before the first difference {min(agree['token_agreement']):.1%}"
    )
    if recorded["failed"]:
        print(f"rows Eyrie's recording pass failed: {recorded['failed']}")

    result = {
        "config": args.config,
        "command": [sys.executable, *sys.argv],
        "synthetic_tokens": args.synthetic_tokens,
        "prefix_caching": not args.no_prefix_caching,
        "shard_size": config.data.shard_size,
        "shards": len(shards),
        "conversations": n,
        "turns_per_conversation": turns,
        "max_tokens": cfg.max_tokens,
        "max_length": config.data.max_length,
        "concurrency": cfg.concurrency,
        "bare_window": window,
        "repeats": args.repeats,
        "recording_pass": recorded,
        "results": rows,
        "ratio_eyrie_bare": ratio,
        "agreement_min": {k: min(v) for k, v in agree.items()},
        "runs": runs,
    }
    (work / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {work / 'bench.json'}")


if __name__ == "__main__":
    main()
