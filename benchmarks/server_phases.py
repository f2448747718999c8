"""Where a vLLM server's start goes, phase by phase, on this machine: Eyrie's extraction server beside a plain
`vllm serve` of the same target (the reference), eager and compiled, with a cold and a warm compile cache, and with
the Kimi preset's `--safetensors-load-strategy=prefetch`.

Each variant is started (and stopped) once through Eyrie's VllmServer; its phases are read from its own log by
eyrie/vllm/phases.py, exactly as `eyrie status` reports them. On a tiny target the weights take no time: what this
shows is the fixed cost of a start (imports, engine, compile) and that a warm compile cache removes the compile.
Each server then answers one request (one generated token): its latency is the `first request` phase.

    .venv/bin/python benchmarks/server_phases.py --config configs/demo.yaml

Writes `<work-dir>/phases.json`. Every server is stopped at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import _cache_env  # noqa: E402, F401  (before vLLM or transformers are imported)

from eyrie.config import load_config  # noqa: E402
from eyrie.run.folder import RunFolder  # noqa: E402
from eyrie.stages.extract import ExtractionPlan  # noqa: E402
from eyrie.stages.preflight import run_preflight  # noqa: E402
from eyrie.stages.prepare import load_dataset_rows, load_shards, prepare  # noqa: E402
from eyrie.target.tiny import build_target  # noqa: E402
from eyrie.vllm import phases  # noqa: E402
from eyrie.vllm.client import watch_first_answer  # noqa: E402
from eyrie.vllm.process import VllmServer  # noqa: E402
from eyrie.vllm.spec import ServerSpec  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--work-dir", default=".cache/server-phases-bench")
    parser.add_argument("--variants", default="all", help="comma-separated names of VARIANTS, or all")
    args = parser.parse_args(argv)

    config = load_config(args.config)
    if config.target.tiny and not Path(config.target.model, "config.json").exists():
        build_target(config.target.tiny, config.target.model)
    work = Path(args.work_dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    run = RunFolder(work / "run")
    run.ensure()
    prepare(config.target, config.data.model_copy(update={"max_samples": 16}), run.prepare)
    report = run_preflight(config, run.root, serve=False)
    extraction = ExtractionPlan(config, run, report, load_shards(run.prepare)).spec
    first_prompt = load_dataset_rows(run.prepare, 0, 1)[0]
    cache = work / "compile-cache"
    variants: dict[str, ServerSpec] = {
        "plain vllm serve (eager)": ServerSpec.from_config(config),
        "extraction (eager)": extraction,
        "extraction, compiled, cold cache": dataclasses.replace(
            extraction, enforce_eager=False, server_env={**extraction.server_env, "VLLM_CACHE_ROOT": str(cache)}
        ),
        "extraction, compiled, warm cache": dataclasses.replace(
            extraction, enforce_eager=False, server_env={**extraction.server_env, "VLLM_CACHE_ROOT": str(cache)}
        ),
        "extraction (eager), prefetch": dataclasses.replace(
            extraction, server_args=[*extraction.server_args, "--safetensors-load-strategy=prefetch"]
        ),
    }
    if args.variants != "all":
        wanted = args.variants.split(",")
        variants = {k: v for k, v in variants.items() if k in wanted}
    results: dict[str, dict[str, float]] = {}
    for i, (name, spec) in enumerate(variants.items()):
        server = VllmServer(work / f"server-{i}")
        try:
            client = server.ensure(spec, config.extraction.startup_timeout_s, log=lambda *_: None)
            # One request once ready, as a stage's first: its latency joins the phases (`first request`).
            watch_first_answer(client.base_url, server.state_path)
            client.generate(first_prompt, 1, 0.0, 1.0, 0, config.extraction.request_timeout_s)
            results[name] = server.state.get("phases") or {}
        finally:
            server.stop(log=lambda *_: None)
        print(f"{name}: {phases.summary(results[name])}; total {results[name].get('total', 0):.0f} s", file=sys.stderr)
    (work / "phases.json").write_text(json.dumps(results, indent=2) + "\n")
    names = list(results)
    print("| phase (s) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for phase in phases.PHASES:
        if any(phase in r for r in results.values()):
            digits = 1 if phase in phases.AFTER_READY else 0  # a first request on a tiny target takes under 1 s
            cells = [f"{results[n][phase]:.{digits}f}" if phase in results[n] else "" for n in names]
            print(f"| {phase} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
