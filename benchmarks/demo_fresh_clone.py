"""`make demo` on a fresh clone, install included: where the minutes go.

    .venv/bin/python benchmarks/demo_fresh_clone.py [--clone /tmp/eyrie-demo-clone] [--installer uv|pip]
        [--uv-cache cold|warm] [--skip-install]

Clones this repository (its committed HEAD, as a new user gets it) into --clone, then times, each as a child
process: the install (`make .venv/.installed`) and the run (`make demo`). For each it records the wall time, the
CPU seconds of the process tree (user + system, from the children's rusage: unlike the wall clock, little moved by
other jobs on the machine) and the machine's load average sampled every 5 s while it ran. After the run it reads
Prefect's own task-run times from the run's Prefect database (.cache/prefect/prefect.db, the temporary server's
SQLite) and the vLLM server starts from the run folder's server logs. `--uv-cache cold` (the default) gives uv an
empty cache, as on a fresh machine. Prints a table; writes benchmarks/results/demo-fresh-clone-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> dict:
    """Run `cmd`; its wall time, CPU seconds (its process tree's), the load while it ran, its exit status."""
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(os.getloadavg()[0])
            stop.wait(5)

    sampler = threading.Thread(target=sample, daemon=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    sampler.start()
    with log.open("w") as out:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "cmd": " ".join(cmd),
        "rc": rc,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "load_mean": round(sum(samples) / len(samples), 2) if samples else None,
        "load_max": round(max(samples), 2) if samples else None,
        "log": str(log),
    }


def task_runs(db: Path) -> list[dict]:
    """Prefect's task runs of the run (name, state, seconds), in start order."""
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT name, state_type, start_time, end_time FROM task_run ORDER BY start_time").fetchall()
    out = []
    for name, state, start, end in rows:
        seconds = None
        if start and end:
            fmt = datetime.datetime.fromisoformat
            seconds = (fmt(str(end)) - fmt(str(start))).total_seconds()
        out.append({"task": name, "state": state, "s": round(seconds, 1) if seconds is not None else None})
    return out


def server_starts(run: Path) -> list[str]:
    return sorted(str(p.parent.relative_to(run)) for p in run.rglob("server.log") if "starting vLLM" in p.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clone", type=Path, default=Path(tempfile.gettempdir()) / "eyrie-demo-clone")
    ap.add_argument("--installer", choices=["uv", "pip"], default="uv")
    ap.add_argument("--uv-cache", choices=["cold", "warm"], default="cold")
    ap.add_argument("--skip-install", action="store_true", help="time the run only, in an existing clone")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PREFECT_", "HF_", "VLLM_"))}
    env["INSTALLER"] = args.installer
    uv_cache = None
    if args.uv_cache == "cold":
        uv_cache = tempfile.mkdtemp(prefix="eyrie-uv-cache-")
        env["UV_CACHE_DIR"] = uv_cache
    steps: dict[str, dict] = {}
    if not args.skip_install:
        shutil.rmtree(args.clone, ignore_errors=True)
        subprocess.run(["git", "clone", "-q", str(ROOT), str(args.clone)], check=True)
        steps["install"] = timed(["make", ".venv/.installed"], args.clone, env, args.clone.parent / "install.log")
    if steps.get("install", {}).get("rc", 0) == 0:
        steps["run"] = timed(["make", "demo"], args.clone, env, args.clone.parent / "demo.log")
    tasks = task_runs(args.clone / ".cache" / "prefect" / "prefect.db")
    run_dir = args.clone / "runs" / "demo"
    result = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=args.clone, capture_output=True, text=True
        ).stdout.strip(),
        "installer": args.installer,
        "uv_cache": args.uv_cache,
        "cpus": os.cpu_count(),
        "steps": steps,
        "total_wall_s": round(sum(s["wall_s"] for s in steps.values()), 1),
        "total_cpu_s": round(sum(s["cpu_s"] for s in steps.values()), 1),
        "tasks": tasks,
        "vllm_starts": server_starts(run_dir) if run_dir.exists() else [],
    }
    for name, s in steps.items():
        print(
            f"{name:8s} rc {s['rc']}  wall {s['wall_s']:7.1f} s  cpu {s['cpu_s']:7.1f} s  load {s['load_mean']}"
            f" (max {s['load_max']})"
        )
    print(f"total    wall {result['total_wall_s']:.1f} s  cpu {result['total_cpu_s']:.1f} s")
    for t in tasks:
        print(f"  {t['task']:40s} {t['state']:10s} {t['s']}")
    print("vLLM starts:", ", ".join(result["vllm_starts"]) or "none")
    stamp = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H%M%S}"
    out = ROOT / "benchmarks" / "results" / f"demo-fresh-clone-{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", out)
    if uv_cache:
        shutil.rmtree(uv_cache, ignore_errors=True)
    sys.exit(max(s["rc"] for s in steps.values()) if steps else 0)


if __name__ == "__main__":
    main()
