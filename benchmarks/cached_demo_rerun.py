"""A fully cached `eyrie run`, end to end, against the floor of what any run pays before it does anything.

Times, each in a fresh process (as `make demo` runs them), with the demo config by default:

- the import floor: `import flows.cli, flows.pipeline` (what `eyrie run` imports before its first step; no vLLM);
- vLLM's import, for reference (what preflight paid on every run before its verdict was a keyed result);
- the cached re-run through the Prefect flow (`--always-flow`, every stage reused by its key; this also records
  the state the fast path checks), for reference;
- the cached re-run: `eyrie run --config ... --run-dir ...` on a run folder a first run finished (run it first, or
  pass --first to run it here and time it), with whether vLLM was imported and where the time went (the flow's
  start, i.e. Prefect's temporary server, from the first log line).

Prints a table and the ratio cached re-run / import floor; writes
`benchmarks/results/cached-demo-rerun-<UTC time>.json`.

    .venv/bin/python benchmarks/cached_demo_rerun.py                       # runs/demo, made by `make demo`
    .venv/bin/python benchmarks/cached_demo_rerun.py --first --repeats 3   # the first run too
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _cache_env  # noqa: E402,F401 (the cache locations `make demo` uses)

RUN = """
import sys, time
t0 = time.perf_counter()
from flows.cli import main
imported = time.perf_counter() - t0
rc = main(sys.argv[1:])
print("EYRIE-BENCH " + __import__("json").dumps(
    {"rc": rc, "imports_s": imported, "inner_s": time.perf_counter() - t0, "vllm": "vllm" in sys.modules}
))
"""


def timed(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"{' '.join(args[:4])}... exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return wall, out.stdout + out.stderr


def run_once(config: str, run_dir: str, env: dict[str, str], always_flow: bool = False) -> dict:
    extra = ["--always-flow"] if always_flow else []
    wall, text = timed([sys.executable, "-c", RUN, "run", "--config", config, "--run-dir", run_dir, *extra], env)
    line = next(ln for ln in reversed(text.splitlines()) if ln.startswith("EYRIE-BENCH "))
    # The "nothing to do" fast path (flows/finished.py): no Prefect flow, no temporary server.
    fast = any(ln.startswith("Nothing to do:") for ln in text.splitlines())
    return {"wall_s": wall, "fast_path": fast, **json.loads(line.removeprefix("EYRIE-BENCH "))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--first", action="store_true", help="run (and time) the first run here")
    p.add_argument(
        "--flow-repeats",
        type=int,
        default=1,
        help="cached re-runs through the Prefect flow too (--always-flow: each stage reused by its key), for reference",
    )
    args = p.parse_args()
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    py = sys.executable
    results: dict = {"config": args.config, "run_dir": args.run_dir, "machine": platform.node()}
    results["load_average"] = os.getloadavg()
    if args.first:
        results["first_run"] = run_once(args.config, args.run_dir, env)
        print(f"first run: {results['first_run']['wall_s']:.1f} s")
    floor = [timed([py, "-c", "import flows.cli, flows.pipeline"], env)[0] for _ in range(args.repeats)]
    vllm = [timed([py, "-c", "import vllm"], env)[0] for _ in range(args.repeats)]
    # Through the flow first: it also writes the record the fast path checks (a first run made before it had none).
    flowed = [run_once(args.config, args.run_dir, env, always_flow=True) for _ in range(args.flow_repeats)]
    cached = [run_once(args.config, args.run_dir, env) for _ in range(args.repeats)]
    results.update(
        import_floor_s=floor,
        vllm_import_s=vllm,
        cached_runs=cached,
        flow_runs=flowed,
        ratio=statistics.median(c["wall_s"] for c in cached) / statistics.median(floor),
    )
    rows = [
        ("import floor (flows.cli, flows.pipeline)", statistics.median(floor)),
        ("import vllm (reference)", statistics.median(vllm)),
        ("cached re-run, wall", statistics.median(c["wall_s"] for c in cached)),
        ("  of which its imports", statistics.median(c["imports_s"] for c in cached)),
        *(
            [("cached re-run through the flow (--always-flow)", statistics.median(c["wall_s"] for c in flowed))]
            if flowed
            else []
        ),
    ]
    print(f"{'':<44}{'median s':>10}   (of {args.repeats})")
    for name, value in rows:
        print(f"{name:<44}{value:>10.1f}")
    print(f"vLLM imported by a cached re-run: {any(c['vllm'] for c in cached)}")
    print(f"fast path (nothing to do, no Prefect) taken: {sum(c['fast_path'] for c in cached)} of {len(cached)}")
    print(f"ratio cached re-run / import floor: {results['ratio']:.2f}")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M%S")  # one file per measurement
    out = ROOT / "benchmarks" / "results" / f"cached-demo-rerun-{stamp}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
