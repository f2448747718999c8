"""Regeneration on the extraction server against a second, plain vLLM server: what one target load for both stages
costs, and whether the extraction server answers as the target does.

Both servers serve the config's target with its extraction settings; the first is the extraction server the
pipeline starts (`extract_hidden_states` plus Eyrie's connector), the second the same target without them. Each is
started (timed), warmed up with one request of a prompt from the data, then answers the same prepared conversations
through `eyrie.stages.regenerate.regenerate_shard` (timed; the median of `--repeats`). Reported per server: start-up
seconds, generated tokens per second, and the hidden-state files it wrote meanwhile; then how many rows came out
identical on both.

Run from the repository root (caches default to `.cache/`, as the Makefile sets them):

    .venv/bin/python benchmarks/regenerate_servers.py --config configs/demo.yaml --max-samples 128

Writes `<work-dir>/bench.json`. The servers are always stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import _cache_env  # noqa: E402, F401  (before vLLM or transformers are imported)
import pyarrow.parquet as pq  # noqa: E402

from eyrie.config import load_config  # noqa: E402
from eyrie.run.folder import RunFolder  # noqa: E402
from eyrie.stages.preflight import run_preflight  # noqa: E402
from eyrie.stages.prepare import load_dataset_rows, load_shards, prepare  # noqa: E402
from eyrie.stages.regenerate import RegenerationPlan, regenerate_shard, shard_paths, shared_tokenizer  # noqa: E402
from eyrie.target.tiny import build_target  # noqa: E402
from eyrie.vllm.process import VllmServer  # noqa: E402
from eyrie.vllm.spec import ServerSpec  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--max-samples", type=int, default=128)
    parser.add_argument("--work-dir", default=".cache/regenerate-bench")
    parser.add_argument("--repeats", type=int, default=3, help="regenerations per server; the median is reported")
    args = parser.parse_args(argv)

    config = load_config(args.config)
    data = config.data.model_copy(update={"max_samples": args.max_samples, "shard_size": args.max_samples})
    config = config.model_copy(update={"data": data})
    if config.target.tiny and not Path(config.target.model, "config.json").exists():
        build_target(config.target.tiny, config.target.model)
    work = Path(args.work_dir).resolve()
    run = RunFolder(work / "run")
    run.ensure()
    prepare(config.target, config.data, run.prepare)
    report = run_preflight(config, run.root, serve=False)
    plan = RegenerationPlan(config, run, report)
    shard = load_shards(run.prepare)[0]
    tokenizer = shared_tokenizer(config.target)
    warm = load_dataset_rows(run.prepare, 0, 1)[0][:32]  # a real prompt: see "Known limits" in the README
    servers = {
        "extraction": (plan.spec, plan.server_dir),
        "plain": (ServerSpec.from_config(config), work / "plain-server"),
    }
    results, rows = {}, {}
    for name, (spec, folder) in servers.items():
        server = VllmServer(folder)
        try:
            t0 = time.perf_counter()
            client = server.ensure(spec, config.extraction.startup_timeout_s, log=lambda *_: None)
            start_s = time.perf_counter() - t0
            client.generate(warm, 8, 0.0, 1.0, None, 60)
            before = _files(plan.staging)
            out = work / f"regenerated-{name}"
            times = []
            for _ in range(args.repeats):
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                m = regenerate_shard(
                    client, tokenizer, run.prepare, out, shard, name, config.regenerate, config.data.max_length
                )
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
            results[name] = {
                "start_s": round(start_s, 1),
                "regenerate_s": round(seconds, 2),
                "requests": m["stats"]["requests"],
                "generated_tokens": m["stats"]["generated_tokens"],
                "tokens_per_s": round(m["stats"]["generated_tokens"] / seconds, 1),
                "hidden_state_files_written": len(_files(plan.staging) - before),
            }
            table = pq.read_table(shard_paths(out, shard)[0])
            rows[name] = dict(zip(table.column("row").to_pylist(), table.column("input_ids").to_pylist()))
        finally:
            server.stop(log=lambda *_: None)
    same = sum(rows["extraction"][k] == rows["plain"].get(k) for k in rows["extraction"])
    summary = {"conversations": shard.stop - shard.start, "identical_rows": same, **results}
    (work / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'':<32}{'extraction server':>20}{'plain server':>16}")
    measures = ("start_s", "regenerate_s", "requests", "generated_tokens", "tokens_per_s", "hidden_state_files_written")
    for key in measures:
        print(f"{key:<32}{results['extraction'][key]:>20}{results['plain'][key]:>16}")
    print(f"rows identical on both: {same} of {len(rows['extraction'])}")
    return 0


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*")} if folder.exists() else set()


if __name__ == "__main__":
    sys.exit(main())
