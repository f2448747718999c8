"""Extraction throughput: Eyrie's client, a bare asynchronous client and speculators' `generate-offline-data`, on
one vLLM server.

The three clients read the same prepared dataset (`<work-dir>/prepare/dataset`) and send the same first N samples
with the same concurrency to the same running extraction server (Eyrie's ServerSpec: the `extract_hidden_states`
method and Eyrie's connector, served model "target"). Eyrie and speculators write `hs_<i>.safetensors` files into
their own folder:

- Eyrie: `eyrie.stages.extract.extract_shard` over every shard, in this process, into `<work-dir>/eyrie_hs`, two shards
at
  a time as the extraction flow's task runner runs them (their requests share one window of `--concurrency`).
- speculators: its CLI as a subprocess, timed end to end, into `<work-dir>/spec_hs`. It runs with
  `--validate-outputs` (Eyrie always loads and checks each file) and `--fail-on-error` (it skips failed samples
  otherwise). Its own in-process time (its "Timing: ...s elapsed" log line) is reported too: the difference from
  the wall time is its start-up (imports, dataset load, model check). Eyrie's pass runs with its imports already
  paid, so the end-to-end ratio charges speculators' start-up and the in-process ratio compares request loops.
- bare: the server's pace. One asyncio loop and one aiohttp session in this process send each sample's ids with
  the request Eyrie sends and read the hidden-states path from the answer, nothing else: no waiting for the
  writer, no validation, no checksum, no rename, no fsync, no manifest. The files it leaves in the server's
  staging folder are removed after its pass, untimed, once their writer is done.
- bare-written: the same, each request counted done only once the connector's writer has finished its file (the
  lock it holds until then): the server's extraction rate with its writes, which the answers alone run ahead of.
  Eyrie against it is what Eyrie's own per-file work costs.

`--synthetic-tokens N` builds longer samples than the demo's (its conversations are about 40 tokens): each sample
joins randomly drawn conversations of the config's local .jsonl source, turn after turn, until its chat-template
rendering reaches N tokens; `data.max_length` becomes N + 256 and the shard size `--shard-size` (default 256, the
config default). The config file is not changed; the joined conversations are written to
`<work-dir>/synthetic_<N>.jsonl` and prepared from there.

Untimed set-up: build the tiny target if the config names one, prepare the data, preflight, start the server, and
warm it up with one batch of requests from Eyrie's client and every sample once from the bare one. With vLLM's
prefix caching on (its default; the server keeps the blocks and their hidden states), every timed pass then finds
all its samples cached: the server's work per request is small and the figures compare the clients' own costs,
as a server many times faster than this CPU one would. `--no-prefix-caching` starts the server without it (as
the Kimi preset does): every pass computes every token and the server is the bound. Each repeat empties the output
folders and rotates which client goes first (each goes first once in three repeats); every pass starts after an
untimed `sync`, so that none pays for the writeback of the files an earlier pass left dirty. After the first repeat
Eyrie's and speculators' outputs are compared: the same file names, and a few files with equal token ids and equal
(or allclose) hidden states. Figures are medians over repeats; the server is always stopped at the end.

Run from the repository root (make sets the cache and offline variables the server needs):

    make bench
    .venv/bin/python benchmarks/extract_throughput.py --config configs/demo.yaml --max-samples 128 --repeats 3
    .venv/bin/python benchmarks/extract_throughput.py --work-dir runs/bench-500 --synthetic-tokens 500 \
        --max-samples 400 --concurrency 32 --repeats 3

Prints a side-by-side table and the ratios eyrie/bare, eyrie/bare-written and eyrie/speculators; writes
`<work-dir>/bench.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyrie.config import load_config
from eyrie.run.folder import RunFolder
from eyrie.stages.extract import ExtractionPlan, _wait_and_release, clean_staging, extract_shard
from eyrie.stages.preflight import run_preflight
from eyrie.stages.prepare import load_dataset_rows, load_shards, prepare
from eyrie.target.metadata import load_tokenizer
from eyrie.target.tiny import build_target
from eyrie.vllm.client import ServerClient
from eyrie.vllm.process import VllmServer


def quiet(*_args, **_kw) -> None:
    pass


def output_size(folder: Path) -> tuple[int, int]:
    files = list(folder.glob("hs_*.safetensors"))
    return len(files), sum(p.stat().st_size for p in files)


# The extraction flow's task runner runs this many shard tasks at once (flows/extract.py); their requests share one
# window of `concurrency` (eyrie.stages.extract._Window), so the server sees as many in flight as from the other
# clients.
FLOW_SHARD_TASKS = 2


def run_eyrie(
    client,
    plan: ExtractionPlan,
    shards,
    prepare_dir: Path,
    out: Path,
    concurrency: int,
    timeout_s: float,
    shard_tasks: int = FLOW_SHARD_TASKS,
) -> dict:
    def one(s) -> dict:
        return extract_shard(
            client,
            prepare_dir,
            s,
            plan.keys[s.name],
            out,
            out.with_name(out.name + "_manifests") / f"{s.name}.json",
            len(plan.captured_ids),
            plan.hidden_size,
            concurrency,
            timeout_s,
            log=quiet,
        )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=shard_tasks) as tasks:
        manifests = list(tasks.map(one, shards))  # in shard order, two at a time, as the flow submits them
    wall = time.perf_counter() - t0
    # Each shard's own account of its time (the manifest's phases_s), summed over the pass's shards.
    phases: dict[str, float] = {}
    for m in manifests:
        for name, s in m.get("phases_s", {}).items():
            phases[name] = phases.get(name, 0.0) + s
    return {"wall_s": wall, "phases_s": {k: round(v, 3) for k, v in phases.items()}}


async def _bare_pass(
    url: str, api_key: str | None, samples, concurrency: int, timeout_s: float, wait_writers: bool = False
) -> list[str]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    todo = iter(samples)
    paths: list[str] = []

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency),
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as session:

        async def worker() -> None:
            for ids in todo:  # one shared iterator: each worker takes the next sample when its request is answered
                body = {"model": "target", "prompt": ids, "max_tokens": 1, "return_token_ids": True}  # as Eyrie's
                async with session.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"vLLM answered {r.status}: {(await r.text())[:300]}")
                    path = (await r.json())["kv_transfer_params"]["hidden_states_path"]
                if wait_writers:  # the file whole on disk, as the server's extraction is only done then
                    await asyncio.to_thread(_wait_and_release, path)
                paths.append(path)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return paths


def run_bare(
    url: str, api_key: str | None, samples, concurrency: int, timeout_s: float, wait_writers: bool = False
) -> dict:
    t0 = time.perf_counter()
    paths = asyncio.run(_bare_pass(url, api_key, samples, concurrency, timeout_s, wait_writers))
    wall = time.perf_counter() - t0
    for p in paths:  # untimed: wait for each file's writer, then drop the file, so no write spills into the next pass
        _wait_and_release(p)
        Path(p).unlink(missing_ok=True)
    return {"wall_s": wall, "files": len(paths), "bytes": 0}


def synthetic_source(config, n_conversations: int, min_tokens: int, out: Path, seed: int = 0) -> Path:
    """Write `n_conversations` conversations of at least `min_tokens` template tokens to `out`: each joins randomly
    drawn conversations of the config's local .jsonl source (system turns dropped), one after another."""
    src = Path(config.data.source)
    if src.suffix != ".jsonl":
        raise SystemExit(f"--synthetic-tokens needs a local .jsonl data source, not {src}")
    convs = []
    for line in src.read_text(encoding="utf-8").splitlines():
        if line.strip():
            msgs = [m for m in json.loads(line).get("messages", []) if m["role"] != "system"]
            if msgs and msgs[0]["role"] == "user" and msgs[-1]["role"] == "assistant":
                convs.append(msgs)
    tok = load_tokenizer(config.target)
    rng = random.Random(seed)
    with open(out, "w", encoding="utf-8") as f:
        for i in range(n_conversations):
            msgs: list[dict] = []
            while not msgs or len(tok(tok.apply_chat_template(msgs, tokenize=False))["input_ids"]) < min_tokens:
                msgs += rng.choice(convs)
            f.write(json.dumps({"id": f"synthetic-{i:05d}", "messages": msgs}) + "\n")
    return out


def run_speculators(endpoint: str, dataset: Path, out: Path, n: int, concurrency: int, timeout_s: float) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "speculators",
        "generate-offline-data",
        "--endpoint",
        endpoint,
        "--model",
        "target",
        "--preprocessed-data",
        str(dataset),
        "--output",
        str(out),
        "--max-samples",
        str(n),
        "--concurrency",
        str(concurrency),
        "--request-timeout",
        str(timeout_s),
        "--validate-outputs",
        "--fail-on-error",
    ]
    t0 = time.perf_counter()
    # A wide console, so that its rich log handler does not wrap the "Timing:" line.
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, COLUMNS="250"))
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    out.with_name(out.name + ".log").write_text(" ".join(cmd) + "\n\n" + log)
    if proc.returncode:
        raise RuntimeError(f"speculators exited with {proc.returncode}:\n" + "\n".join(log.splitlines()[-20:]))
    m = re.search(r"Timing:\s+([\d.]+)s\s+elapsed", log)
    return {"wall_s": wall, "in_process_s": float(m.group(1)) if m else None, "command": cmd}


def compare(a: Path, b: Path, n: int) -> dict:
    """Same file names in both folders; a few files with equal token ids and (all)close hidden states."""
    names_a = sorted(p.name for p in a.glob("hs_*.safetensors"))
    names_b = sorted(p.name for p in b.glob("hs_*.safetensors"))
    want = sorted(f"hs_{i}.safetensors" for i in range(n))
    if names_a != want or names_b != want:
        raise AssertionError(f"file sets differ: eyrie {len(names_a)}, speculators {len(names_b)}, expected {n}")
    checked, max_diff, identical = [], 0.0, True
    for i in sorted({0, n // 2, n - 1}):
        x, y = load_file(str(a / f"hs_{i}.safetensors")), load_file(str(b / f"hs_{i}.safetensors"))
        if not torch.equal(x["token_ids"], y["token_ids"]) or x["hidden_states"].shape != y["hidden_states"].shape:
            raise AssertionError(f"hs_{i}: token ids or shapes differ between the two outputs")
        hx, hy = x["hidden_states"].float(), y["hidden_states"].float()
        identical &= torch.equal(hx, hy)
        max_diff = max(max_diff, (hx - hy).abs().max().item())
        if not torch.allclose(hx, hy, rtol=2e-2, atol=2e-2):
            raise AssertionError(f"hs_{i}: hidden states differ (max abs diff {max_diff:.3g})")
        checked.append(i)
    return {"files": n, "checked": checked, "identical": identical, "max_abs_diff": max_diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--work-dir", default="runs/bench")
    ap.add_argument("--max-samples", type=int, help="samples to extract (default: all prepared)")
    ap.add_argument("--concurrency", type=int, help="requests in flight (default: extraction.concurrency)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--synthetic-tokens",
        type=int,
        help="samples of about this many tokens, joined from the source's conversations (see the module's help)",
    )
    ap.add_argument("--no-prefix-caching", action="store_true", help="serve with --no-enable-prefix-caching")
    ap.add_argument(
        "--shard-size", type=int, help="rows per shard (default: the config's; 256 with --synthetic-tokens)"
    )
    ap.add_argument(
        "--shard-tasks",
        default="",
        help="also Eyrie with this many shard tasks at once (comma-separated; the flow runs 2): clients eyrie-N",
    )
    args = ap.parse_args()

    config = load_config(args.config)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run = RunFolder(work)
    if config.target.tiny:
        build_target(config.target.tiny, config.target.model)
    if args.synthetic_tokens:
        want = args.max_samples or 256
        # Held-out rows leave prepare's dataset: draw enough for `want` train rows.
        count = int(want / (1 - config.data.eval_fraction)) + 32
        source = work / f"synthetic_{args.synthetic_tokens}.jsonl"
        synthetic_source(config, count, args.synthetic_tokens, source)
        config.data.source = str(source)
        config.data.max_length = args.synthetic_tokens + 256
        config.data.max_samples = None
        config.data.shard_size = args.shard_size or 256
        config.target.max_model_len = max(config.target.max_model_len or 0, config.data.max_length + 1)
    elif args.shard_size:
        config.data.shard_size = args.shard_size
    prepare(config.target, config.data, run.prepare)
    report = run_preflight(config, work)
    plan = ExtractionPlan(config, run, report, load_shards(run.prepare))
    if args.no_prefix_caching:
        plan.spec.server_args = [*plan.spec.server_args, "--no-enable-prefix-caching"]
    total = plan.shards[-1].stop
    n = min(args.max_samples or total, total)
    shards = [replace(s, stop=min(s.stop, n)) for s in plan.shards if s.start < n]
    tokens = sum(map(len, load_dataset_rows(run.prepare, 0, n)))
    concurrency = args.concurrency or config.extraction.concurrency
    timeout_s = config.extraction.request_timeout_s
    eyrie_out, spec_out = work / "eyrie_hs", work / "spec_hs"

    server = VllmServer(run.extract)
    if not server.healthy():
        clean_staging(plan.staging)
    samples = load_dataset_rows(run.prepare, 0, n)
    variants = {f"eyrie-{k}": int(k) for k in args.shard_tasks.split(",") if k and int(k) != FLOW_SHARD_TASKS}
    clients = ["eyrie", *variants, "bare", "bare-written", "speculators"]
    runs: dict[str, list[dict]] = {c: [] for c in clients}
    try:
        server.ensure(plan.spec, config.extraction.startup_timeout_s)
        # As the extraction task builds it (tasks/extract.py): one pooled connection per request in flight.
        client = ServerClient(server.url(), plan.spec.api_key(), max(10, concurrency))
        endpoint = server.url() + "/v1"
        warm = work / "warmup"  # first requests pay one-off costs; neither client should
        run_eyrie(
            client,
            plan,
            [replace(shards[0], stop=min(shards[0].stop, concurrency))],
            run.prepare,
            warm,
            concurrency,
            timeout_s,
        )
        # Every sample once, untimed: with prefix caching on (vLLM's default) a sample's second pass reuses its
        # blocks, so without this the client that happened to go first in a repeat would pay for all the others.
        run_bare(server.url(), plan.spec.api_key(), samples, concurrency, timeout_s)
        for r in range(args.repeats):
            for p in (eyrie_out, spec_out, work / "eyrie_hs_manifests"):
                shutil.rmtree(p, ignore_errors=True)
            order = clients[r % len(clients) :] + clients[: r % len(clients)]  # a different client first each repeat
            for name in order:
                print(f"repeat {r + 1}/{args.repeats}: {name} ...", flush=True)
                # Untimed: the previous pass's files written out, so no pass pays for another's writeback (Eyrie's
                # fsyncs waited for speculators' 100 MB when they ran next).
                os.sync()
                if name == "eyrie" or name in variants:
                    shutil.rmtree(eyrie_out, ignore_errors=True)
                    shutil.rmtree(eyrie_out.with_name(eyrie_out.name + "_manifests"), ignore_errors=True)
                    tasks = variants.get(name, FLOW_SHARD_TASKS)
                    res = run_eyrie(client, plan, shards, run.prepare, eyrie_out, concurrency, timeout_s, tasks)
                    res["files"], res["bytes"] = output_size(eyrie_out)
                elif name in ("bare", "bare-written"):
                    written = name == "bare-written"
                    res = run_bare(server.url(), plan.spec.api_key(), samples, concurrency, timeout_s, written)
                else:
                    res = run_speculators(endpoint, run.prepare / "dataset", spec_out, n, concurrency, timeout_s)
                    res["files"], res["bytes"] = output_size(spec_out)
                print(f"  {res['wall_s']:.2f} s, {tokens / res['wall_s']:,.0f} tokens/s", flush=True)
                runs[name].append(res)
            if r == 0:
                agreement = compare(eyrie_out, spec_out, n)
    finally:
        server.stop()
        shutil.rmtree(work / "warmup", ignore_errors=True)
        shutil.rmtree(work / "warmup_manifests", ignore_errors=True)

    rows = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        rows[name] = {
            "samples": n,
            "tokens": tokens,
            "wall_s": wall,
            "samples_per_s": n / wall,
            "tokens_per_s": tokens / wall,
            "bytes_written": rs[-1]["bytes"],
            "files": rs[-1]["files"],
        }
    inproc = [r["in_process_s"] for r in runs["speculators"] if r["in_process_s"] is not None]
    if inproc:
        s = statistics.median(inproc)
        rows["speculators"] |= {
            "in_process_s": s,
            "in_process_tokens_per_s": tokens / s,
            "startup_s": rows["speculators"]["wall_s"] - s,
        }
    ratio = rows["eyrie"]["tokens_per_s"] / rows["speculators"]["tokens_per_s"]
    ratio_bare = rows["eyrie"]["tokens_per_s"] / rows["bare"]["tokens_per_s"]
    ratio_written = rows["eyrie"]["tokens_per_s"] / rows["bare-written"]["tokens_per_s"]
    ratio_inproc = rows["eyrie"]["tokens_per_s"] / rows["speculators"]["in_process_tokens_per_s"] if inproc else None
    ratio_variants = {name: rows[name]["tokens_per_s"] / rows["bare-written"]["tokens_per_s"] for name in variants}

    print(
        f"\n{n} samples, {tokens} tokens ({tokens / n:.0f} per sample), concurrency {concurrency}, "
        f"{args.repeats} repeat(s) (medians); model {plan.spec.model}"
    )
    print(f"{'':24}" + "".join(f"{c:>14}" for c in clients))
    for key, fmt in [
        ("wall_s", ".2f"),
        ("samples_per_s", ".1f"),
        ("tokens_per_s", ".0f"),
        ("bytes_written", ",d"),
        ("files", "d"),
        ("in_process_s", ".2f"),
        ("in_process_tokens_per_s", ".0f"),
        ("startup_s", ".2f"),
    ]:
        cells = [format(rows[c][key], fmt) if key in rows[c] else "-" for c in clients]
        print(f"{key:24}" + "".join(f"{cell:>14}" for cell in cells))
    print(f"ratio eyrie/bare (tokens/s): {ratio_bare:.3f}x")
    print(f"ratio eyrie/bare-written (tokens/s, the bare client waiting for each file's writer): {ratio_written:.3f}x")
    print(f"ratio eyrie/speculators (tokens/s, end to end): {ratio:.2f}x")
    if ratio_inproc is not None:
        print(f"ratio eyrie/speculators (tokens/s, speculators in-process): {ratio_inproc:.2f}x")
    for name, r in ratio_variants.items():
        print(f"ratio {name}/bare-written (Eyrie with {variants[name]} shard tasks at once): {r:.3f}x")
    # Eyrie's time by phase (the median pass's shard manifests, summed over shards; the file phases are summed over
    # the file threads, so they can exceed the wall): where a shortfall against bare-written comes from.
    median_pass = sorted(runs["eyrie"], key=lambda r: r["wall_s"])[len(runs["eyrie"]) // 2]
    print(f"eyrie's phases (s, summed over {len(shards)} shard(s), the median pass of {median_pass['wall_s']:.2f} s):")
    for name, s in median_pass["phases_s"].items():
        print(f"  {name:32}{s:9.3f}")
    print(
        f"outputs agree: {agreement['files']} files each; files {agreement['checked']} "
        f"{'identical' if agreement['identical'] else 'allclose'} (max abs diff {agreement['max_abs_diff']:.3g})"
    )

    result = {
        "config": args.config,
        "command": [sys.executable, *sys.argv],
        "synthetic_tokens": args.synthetic_tokens,
        "prefix_caching": not args.no_prefix_caching,
        "shard_size": config.data.shard_size,
        "samples": n,
        "tokens": tokens,
        "concurrency": concurrency,
        "repeats": args.repeats,
        "results": rows,
        "ratio_tokens_per_s": ratio,
        "ratio_eyrie_bare": ratio_bare,
        "ratio_eyrie_bare_written": ratio_written,
        "ratio_eyrie_speculators_in_process": ratio_inproc,
        "eyrie_phases_s": median_pass["phases_s"],
        "ratio_variants_bare_written": ratio_variants,
        "runs": runs,
        "agreement": agreement,
    }
    (work / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {work / 'bench.json'}")


if __name__ == "__main__":
    main()
