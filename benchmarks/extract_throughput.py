"""Extraction throughput: Eyrie's client against speculators' `generate-offline-data`, on one vLLM server.

Both clients read the same prepared dataset (`<work-dir>/prepare/dataset`), send the same first N samples with the
same concurrency to the same running extraction server (Eyrie's ServerSpec: the `extract_hidden_states` method and
Eyrie's connector, served model "target"), and write `hs_<i>.safetensors` files into their own folder:

- Eyrie: `eyrie.extract.extract_shard` over every shard, in this process, into `<work-dir>/eyrie_hs`.
- speculators: its CLI as a subprocess, timed end to end, into `<work-dir>/spec_hs`. It runs with
  `--validate-outputs` (Eyrie always loads and checks each file) and `--fail-on-error` (it skips failed samples
  otherwise). Its own in-process time (its "Timing: ...s elapsed" log line) is reported too: the difference from
  the wall time is its start-up (imports, dataset load, model check). Eyrie's pass runs with its imports already
  paid, so the end-to-end ratio charges speculators' start-up and the in-process ratio compares request loops.

Untimed set-up: build the tiny target if the config names one, prepare the data, preflight, start the server, and
warm it up with one batch of requests. Each repeat empties both output folders and alternates which client goes
first. After the first repeat the outputs are compared: the same file names, and a few files with equal token ids
and equal (or allclose) hidden states. Figures are medians over repeats; the server is always stopped at the end.

Run from the repository root (make sets the cache and offline variables the server needs):

    make bench
    .venv/bin/python benchmarks/extract_throughput.py --config configs/demo.yaml --max-samples 128 --repeats 3

Prints a side-by-side table and the ratio eyrie/speculators; writes `<work-dir>/bench.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyrie.config import load_config
from eyrie.extract import ExtractionPlan, clean_staging, extract_shard
from eyrie.preflight import run_preflight
from eyrie.prepare import load_dataset_rows, load_shards, prepare
from eyrie.server import ExtractionServer
from eyrie.store import RunFolder
from eyrie.tiny import build_target


def quiet(*_args, **_kw) -> None:
    pass


def output_size(folder: Path) -> tuple[int, int]:
    files = list(folder.glob("hs_*.safetensors"))
    return len(files), sum(p.stat().st_size for p in files)


def run_eyrie(
    client, plan: ExtractionPlan, shards, prepare_dir: Path, out: Path, concurrency: int, timeout_s: float
) -> dict:
    t0 = time.perf_counter()
    for s in shards:
        extract_shard(
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
    return {"wall_s": time.perf_counter() - t0}


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
    args = ap.parse_args()

    config = load_config(args.config)
    work = Path(args.work_dir).resolve()
    run = RunFolder(work)
    if config.target.tiny:
        build_target(config.target.tiny, config.target.model)
    prepare(config.target, config.data, run.prepare)
    report = run_preflight(config, work)
    plan = ExtractionPlan(config, run, report, load_shards(run.prepare))
    total = plan.shards[-1].stop
    n = min(args.max_samples or total, total)
    shards = [replace(s, stop=min(s.stop, n)) for s in plan.shards if s.start < n]
    tokens = sum(map(len, load_dataset_rows(run.prepare, 0, n)))
    concurrency = args.concurrency or config.extraction.concurrency
    timeout_s = config.extraction.request_timeout_s
    eyrie_out, spec_out = work / "eyrie_hs", work / "spec_hs"

    server = ExtractionServer(run.extract)
    if not server.healthy():
        clean_staging(plan.staging)
    runs = {"eyrie": [], "speculators": []}
    try:
        client = server.ensure(plan.spec, config.extraction.startup_timeout_s)
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
        for r in range(args.repeats):
            for p in (eyrie_out, spec_out, work / "eyrie_hs_manifests"):
                shutil.rmtree(p, ignore_errors=True)
            order = ["eyrie", "speculators"] if r % 2 == 0 else ["speculators", "eyrie"]
            for name in order:
                print(f"repeat {r + 1}/{args.repeats}: {name} ...", flush=True)
                if name == "eyrie":
                    res = run_eyrie(client, plan, shards, run.prepare, eyrie_out, concurrency, timeout_s)
                else:
                    res = run_speculators(endpoint, run.prepare / "dataset", spec_out, n, concurrency, timeout_s)
                res["files"], res["bytes"] = output_size(eyrie_out if name == "eyrie" else spec_out)
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

    print(
        f"\n{n} samples, {tokens} tokens, concurrency {concurrency}, {args.repeats} repeat(s) (medians); "
        f"model {plan.spec.model}"
    )
    print(f"{'':24}{'eyrie':>14}{'speculators':>14}")
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
        cells = [format(rows[c][key], fmt) if key in rows[c] else "-" for c in ("eyrie", "speculators")]
        print(f"{key:24}{cells[0]:>14}{cells[1]:>14}")
    print(f"ratio eyrie/speculators (tokens/s, end to end): {ratio:.2f}x")
    if inproc:
        print(
            f"ratio eyrie/speculators (tokens/s, speculators in-process): "
            f"{rows['eyrie']['tokens_per_s'] / rows['speculators']['in_process_tokens_per_s']:.2f}x"
        )
    print(
        f"outputs agree: {agreement['files']} files each; files {agreement['checked']} "
        f"{'identical' if agreement['identical'] else 'allclose'} (max abs diff {agreement['max_abs_diff']:.3g})"
    )

    result = {
        "config": args.config,
        "samples": n,
        "tokens": tokens,
        "concurrency": concurrency,
        "repeats": args.repeats,
        "results": rows,
        "ratio_tokens_per_s": ratio,
        "runs": runs,
        "agreement": agreement,
    }
    (work / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {work / 'bench.json'}")


if __name__ == "__main__":
    main()
