"""The `eyrie` command: run the flow, run only the checks, show a run folder's state, verify its files, stop its
servers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from eyrie.errors import EyrieError


def _run(args) -> int:
    from eyrie.config import load_config

    config = load_config(args.config)  # a bad config fails here, before Prefect starts
    run_dir = args.run_dir or f"runs/{config.name}"
    from flows import finished

    # Nothing changed since the run that finished this folder: its outputs, without Prefect (flows/finished.py).
    always_flow = args.always_flow or os.environ.get("EYRIE_ALWAYS_FLOW") == "1"
    outputs = None if always_flow else finished.finished_outputs(config, run_dir, args.until)
    if outputs is not None:
        print(f"\nNothing to do: {run_dir} finished (through {args.until}) and nothing changed since. Outputs:")
    else:
        from flows.pipeline import pipeline_flow

        outputs = pipeline_flow(config=config, run_dir=run_dir, until=args.until)
        finished.record(config, run_dir, args.until, outputs)
        print(f"\nEyrie run complete (through {args.until}). Outputs:")
    for k, v in outputs.items():
        print(f"  {k:<14} {v}")
    return 0


def _preflight(args) -> int:
    from eyrie.config import load_config
    from eyrie.stages.preflight import run_preflight

    config = load_config(args.config)
    report = run_preflight(config, Path(args.run_dir or f"runs/{config.name}"), raise_on_failure=False)
    print(json.dumps(report.as_dict(), indent=2))
    if report.failures:
        print(f"\npreflight FAILED ({len(report.failures)}):", file=sys.stderr)
        for f in report.failures:
            print(f"  - {f}", file=sys.stderr)
        return 1
    print(
        f"\npreflight passed: {report.architecture} via the {report.eagle3_path} EAGLE-3 path, "
        f"capturing layers {report.captured_layer_ids}"
    )
    return 0


def _status(args) -> int:
    from eyrie.ops.status import format_status, run_status
    from eyrie.run.folder import RunFolder

    print(format_status(run_status(RunFolder(args.run_dir))))
    return 0


def _verify(args) -> int:
    from eyrie.ops.verify import verify_run

    report = verify_run(args.run_dir, workers=args.workers, report_only=args.report_only)
    print(report.summary())
    return 0 if report.ok else 1


def _stop_server(args) -> int:
    from eyrie.run.folder import RunFolder, run_server_folders
    from eyrie.vllm.process import VllmServer

    # Every server recorded under the run folder: extraction's (and each node's when nodes share the folder),
    # export's and evaluation's. Servers of other hosts, and pids that are no longer the recorded server, are left.
    stopped = sum(VllmServer(f).stop() for f in run_server_folders(RunFolder(args.run_dir).root))
    print(f"stopped {stopped} vLLM server(s)" if stopped else "no vLLM server was running")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from eyrie.stages import UNTIL

    p = argparse.ArgumentParser(prog="eyrie", description="Raise EAGLE-3 drafters for vLLM-served targets.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the pipeline flow")
    r.add_argument("--config", required=True)
    r.add_argument("--run-dir")
    r.add_argument(
        "--until", choices=UNTIL, default="evaluate", help="stop after this stage (default: the whole pipeline)"
    )
    r.add_argument(
        "--always-flow",
        action="store_true",
        help="run the Prefect flow even when the folder finished and nothing changed since (it then reuses every "
        "stage by its key); also EYRIE_ALWAYS_FLOW=1",
    )
    r.set_defaults(func=_run)
    c = sub.add_parser("preflight", help="run only the checks (no weights load)")
    c.add_argument("--config", required=True)
    c.add_argument("--run-dir")
    c.set_defaults(func=_preflight)
    s = sub.add_parser("status", help="each stage's and shard's state from the manifests on disk")
    s.add_argument("--run-dir", required=True)
    s.set_defaults(func=_status)
    v = sub.add_parser(
        "verify",
        help="re-hash every file the manifests list; remove damaged ones so the next run redoes them (exit 1)",
    )
    v.add_argument("--run-dir", required=True)
    v.add_argument("--workers", type=int, help="files hashed at a time (default: 2 per CPU, at most 32)")
    v.add_argument("--report-only", action="store_true", help="change nothing, only report")
    v.set_defaults(func=_verify)
    k = sub.add_parser("stop-server", help="stop every vLLM server of a run folder (extraction, export, evaluation)")
    k.add_argument("--run-dir", required=True)
    k.set_defaults(func=_stop_server)
    return p


# Where no Prefect server is configured, `eyrie run` starts Prefect's temporary one, which must answer within
# PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (Prefect's default: 20) or the run fails before its first stage.
# A first start creates and migrates its database: 15 s and 23 s on a loaded 2-core machine. The Makefile used to set
# the longer wait; `eyrie run` alone did not. An operator's own value wins.
EPHEMERAL_STARTUP_TIMEOUT = ("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault(*EPHEMERAL_STARTUP_TIMEOUT)  # before Prefect reads its settings
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EyrieError as err:
        print(f"eyrie: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
