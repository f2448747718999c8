"""The `eyrie` command's own behaviour: its version, its help, how an error reaches the terminal, the environment
it gives Prefect's temporary server, and `eyrie submit`."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

from eyrie.errors import PreflightError
from flows import cli
from tests.conftest import REPO, write_config

EYRIE = REPO / ".venv" / "bin" / "eyrie"


def _eyrie(*argv: str) -> subprocess.CompletedProcess:
    cmd = [str(EYRIE)] if EYRIE.exists() else [sys.executable, "-m", "flows.cli"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_version_names_eyrie_and_what_it_runs_on():
    out = _eyrie("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("eyrie 0.1.0 (") and "speculators" in out.stdout and "prefect" in out.stdout


def test_every_option_has_help_and_says_its_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction))
    for name, command in sub.choices.items():
        for action in command._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"eyrie {name} {action.option_strings[0]} has no help"
            text = command.format_help()
            assert action.option_strings[0] in text
        # An option that is not required says its default, in words where it is derived (the run folder).
        helps = command.format_help()
        if "--run-dir" in helps and name in ("run", "preflight", "submit"):
            assert "default: runs/<the config's name>" in " ".join(helps.split())
    run_help = " ".join(sub.choices["run"].format_help().split())
    assert "default: evaluate" in run_help and "--debug" in run_help
    assert "default: eyrie-pipeline/production" in " ".join(sub.choices["submit"].format_help().split())


class _ApiLike(logging.Handler):
    """Stands for Prefect's API handler: on the run logger itself, it must keep each record whole."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def emit(self, record):
        self.seen.append((record.getMessage(), record.exc_info is not None))


def _failing_flow(args):
    # What Prefect's engines log when a task raises, then the error the flow re-raises.
    err = PreflightError(["extraction.layer_ids [99] outside 0..7", "max_model_len too long"])
    try:
        raise err
    except PreflightError:
        logging.getLogger("prefect.task_runs").error(f"Task run failed with exception: {err!r}", exc_info=True)
    logging.getLogger("prefect.task_runs").error(f"Finished in state Failed({str(err)!r})")
    raise err


@pytest.fixture
def console(monkeypatch):
    """A console handler as the root logger's only one, as Prefect's logging config puts it (the session's own,
    whose streams earlier tests' captures may have closed, set aside), and an API-like handler on the task run
    logger."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    api = _ApiLike()
    root, task_log, prefect_log = (logging.getLogger(n) for n in ("", "prefect.task_runs", "prefect"))
    saved = root.handlers[:], prefect_log.handlers[:], task_log.handlers[:]
    root.handlers[:], prefect_log.handlers[:], task_log.handlers[:] = [handler], [], [api]
    yield stream, api
    root.handlers[:], prefect_log.handlers[:], task_log.handlers[:] = saved


def test_a_refused_run_prints_its_error_once_without_tracebacks(console, monkeypatch, tmp_path, capsys):
    stream, api = console
    monkeypatch.setattr(cli, "_run", _failing_flow)
    config = tmp_path / "c.yaml"
    config.write_text("name: x\n")
    assert cli.main(["run", "--config", str(config)]) == 2
    shown = stream.getvalue() + capsys.readouterr().err
    assert "Traceback" not in shown
    assert shown.count("max_model_len too long") == 1, shown  # once: in the error `main` prints last
    assert shown.rstrip().endswith("  - max_model_len too long")
    assert len(shown.splitlines()) <= 6, shown
    # Prefect's API handler (the UI's log) still got the traceback and the whole message.
    assert api.seen[0][1] and "max_model_len too long" in api.seen[0][0]


def test_debug_keeps_the_tracebacks(console, monkeypatch, tmp_path, capsys):
    stream, api = console
    monkeypatch.setattr(cli, "_run", _failing_flow)
    config = tmp_path / "c.yaml"
    config.write_text("name: x\n")
    with pytest.raises(PreflightError):
        cli.main(["run", "--debug", "--config", str(config)])
    assert "Traceback" in stream.getvalue()


def test_an_unexpected_error_is_one_line_unless_debug(monkeypatch, tmp_path, capsys):
    def broken(args):
        raise KeyError("oops")

    monkeypatch.setattr(cli, "_status", broken)
    assert cli.main(["status", "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("eyrie: error: KeyError: 'oops'") and "Traceback" not in err and "--debug" in err
    with pytest.raises(KeyError):
        cli.main(["status", "--debug", "--run-dir", str(tmp_path)])


@pytest.mark.parametrize("operator", [None, "true"])
def test_the_temporary_servers_telemetry_is_off_unless_the_operator_set_it(operator, monkeypatch, tmp_path):
    seen = {}
    if operator is None:
        monkeypatch.delenv("PREFECT_SERVER_ANALYTICS_ENABLED", raising=False)
    else:
        monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", operator)
    monkeypatch.setattr(
        cli, "_status", lambda args: seen.setdefault("v", cli.os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED"))
    )
    cli.main(["status", "--run-dir", str(tmp_path)])
    assert seen["v"] == (operator or "false")


def test_submit_checks_the_config_here_then_starts_the_deployment(tiny_llama, tmp_path, monkeypatch, capsys):
    import prefect.deployments

    calls = []

    class FlowRun:
        name, id = "brave-eagle", "0000"

    def run_deployment(name, parameters, timeout, tags):
        calls.append((name, parameters, timeout))
        return FlowRun()

    monkeypatch.setattr(prefect.deployments, "run_deployment", run_deployment)
    good, config = write_config(tmp_path / "good.yaml", tiny_llama)
    assert cli.main(["submit", "--config", str(good), "--until", "train"]) == 0
    name, parameters, timeout = calls[0]
    assert name == "eyrie-pipeline/production" and timeout == 0
    assert parameters == {"config": config.model_dump(mode="json"), "run_dir": "runs/test", "until": "train"}
    assert "brave-eagle" in capsys.readouterr().out

    broken = tmp_path / "broken.yaml"
    broken.write_text(good.read_text().replace("shard_size", "shard_sise"))
    assert cli.main(["submit", "--config", str(broken), "--deployment", "x/y"]) == 2
    assert len(calls) == 1  # nothing created for a config that does not load
    assert "shard_sise" in capsys.readouterr().err
