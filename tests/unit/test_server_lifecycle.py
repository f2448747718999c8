"""The lives of the servers a run folder records, without vLLM: a tiny HTTP server stands in for it, started the way
`VllmServer` starts and records servers (its `ServerSpec.command` is replaced, nothing else).

- A recorded pid is the server only with the recorded start time and boot id: a pid that is now another process
  (reused, or recorded before a reboot) is reported not running and never signalled.
- A server that is still loading is awaited up to its start-up timeout, not killed; one failed health probe is not
  death.
- `eyrie status` and `eyrie stop-server` see every server of a run folder: extraction's, each node's, export's and
  evaluation's, and the processes of a server's group that outlived it.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import eyrie.vllm.process as server_mod
from eyrie.errors import ExtractionError
from eyrie.ops.status import format_status, run_status
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.folder import RunFolder
from eyrie.vllm.process import HEALTH_PROBES, VllmServer, _alive, _group_members
from eyrie.vllm.spec import ExtractionSpec, ServerSpec, ServingSpec, free_port
from flows.cli import main

# Listens only after --delay seconds, as vLLM does once its target is loaded; /health fails the next N probes when
# <--flaky>/<its pid> holds N; --child leaves a process in its group, as vLLM's engine core is.
FAKE_VLLM = r"""
import argparse, http.server, os, subprocess, time
ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--delay", type=float, default=0.0)
ap.add_argument("--flaky")
ap.add_argument("--child", action="store_true")
ap.add_argument("--vllm-log", action="store_true")  # the lines of vLLM's log that name its start-up's phases
ap.add_argument("--fail")  # exits 1 as a failed vLLM start does: the worker's error, then the API server's wrapper
a, _ = ap.parse_known_args()
if a.child:
    subprocess.Popen(["sleep", "300"])
time.sleep(a.delay)
if a.fail:
    print(f"(Worker pid={os.getpid()}) ERROR 12-03 07:44:49 [multiproc_executor.py:953] {a.fail}")
    print("Traceback (most recent call last):")
    for _ in range(40):
        print('  File "vllm/v1/engine/core_client.py", line 682, in __init__')
    print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}", flush=True)
    raise SystemExit(1)
if a.vllm_log:
    now = time.strftime("%m-%d %H:%M:%S")
    for line in ("version 0.32.0", "Starting to load model fake-target...", "Loading weights took 0.01 seconds",
                 "init engine (profile, create kv cache, warmup model) took 0.50 s"):
        print(f"(Worker pid={os.getpid()}) INFO {now} [fake.py:1] {line}", flush=True)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200 if self.path == "/health" else 404
        flaky = os.path.join(a.flaky, str(os.getpid())) if a.flaky else None
        if code == 200 and flaky and os.path.exists(flaky):
            n = int(open(flaky).read() or 0)
            if n > 0:
                open(flaky, "w").write(str(n - 1))
                code = 503
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", a.port), Health).serve_forever()
"""


def quiet(*_):
    pass


def start_ticks(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[19])


def real_boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def banners(folder: Path) -> int:
    return (folder / "server.log").read_text().count("eyrie: starting vLLM")


def cli(*argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(list(argv)) == 0
    return buf.getvalue()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """`fake.spec(*args, drafter=None)`: a spec whose server is FAKE_VLLM with `args`; every folder a test starts a
    server in (`fake.folder(path)`) is stopped at the end, and every stray process killed."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    monkeypatch.setattr(
        ServerSpec, "command", lambda self, port: [sys.executable, str(script), "--port", str(port), *self.server_args]
    )
    monkeypatch.setattr(server_mod, "PROBE_INTERVAL_S", 0.05)
    monkeypatch.setattr(server_mod, "STARTUP_POLL_S", 0.1)

    class Fake:
        def __init__(self):
            self.folders: list[Path] = []
            self.procs: list[subprocess.Popen] = []

        @staticmethod
        def spec(*args: str, drafter: str | None = None) -> ServerSpec:
            # An extraction server's spec unless a drafter is given (a serving one).
            layer_ids = None if drafter else [2, 4]
            return ServerSpec(model="fake-target", drafter=drafter, layer_ids=layer_ids, server_args=list(args))

        def folder(self, path: Path) -> Path:
            self.folders.append(Path(path))
            return Path(path)

        def sleeper(self) -> subprocess.Popen:
            """An unrelated process, in a session and group of its own (as a server's would be)."""
            proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
            self.procs.append(proc)
            return proc

    f = Fake()
    yield f
    for folder in f.folders:
        with contextlib.suppress(Exception):
            VllmServer(folder).stop(timeout_s=5, log=quiet)
    for proc in f.procs:
        proc.kill()
        proc.wait()


def record(folder: Path, proc: subprocess.Popen, spec: ServerSpec, **override) -> dict:
    """A server.json for `proc`, as `launch` writes it, with `override` applied (None removes a key)."""
    state = {
        "pid": proc.pid,
        "start_ticks": start_ticks(proc.pid),
        "boot_id": real_boot_id(),
        "host": "127.0.0.1",
        "port": free_port("127.0.0.1"),
        "fingerprint": spec.fingerprint(),
        "kind": spec.kind,
        "model": spec.model,
        "started_at": time.time(),
        "hostname": socket.gethostname(),
    }
    state.update(override)
    state = {k: v for k, v in state.items() if v is not None}
    atomic_write_json(folder / "server.json", state)
    return state


def test_server_json_records_the_process_start_time_and_boot_id(tmp_path, fake):
    run = RunFolder(tmp_path / "run")
    folder = fake.folder(run.extract)
    client = VllmServer(folder).ensure(fake.spec(), startup_timeout_s=30, log=quiet)
    state = read_json(folder / "server.json")
    assert state["start_ticks"] == start_ticks(state["pid"])  # field 22 of /proc/<pid>/stat
    assert state["boot_id"] == real_boot_id()
    assert state["kind"] == "extraction" and state["ready_at"] >= state["started_at"]
    assert client.base_url == f"http://127.0.0.1:{state['port']}"
    assert VllmServer.owns(state)
    assert run_status(run)["server"] == f"running pid {state['pid']} at {client.base_url}"


@pytest.mark.parametrize("mismatch", ["start_time", "boot_id", "legacy_start"])
def test_a_recorded_pid_that_is_now_another_process_is_never_signalled(tmp_path, fake, mismatch):
    """The recorded pid is alive, but it is a process the server's record does not describe: pid reuse (another
    start time), a reboot (another boot id), or a record written before start times were kept whose `started_at`
    is not the process's start."""
    run = RunFolder(tmp_path / "run")
    folder = fake.folder(run.extract)
    other = fake.sleeper()
    spec = fake.spec()
    override = {
        "start_time": {"start_ticks": start_ticks(other.pid) + 1},
        "boot_id": {"boot_id": "00000000-0000-0000-0000-000000000000"},
        "legacy_start": {"start_ticks": None, "boot_id": None, "started_at": time.time() - 3600},
    }[mismatch]
    state = record(folder, other, spec, **override)

    server = VllmServer(folder)
    assert not server.owns(state) and not server.healthy() and server.orphans(state) == []
    assert run_status(run)["server"] == "not running"
    out = cli("stop-server", "--run-dir", str(run.root))
    assert f"records pid {other.pid}, which is now another process" in out and "not signalled" in out
    assert out.strip().endswith("no vLLM server was running")
    assert other.poll() is None, "an unrelated process was signalled"
    assert not (folder / "server.json").exists()  # a stale record is dropped

    # A run needing this server starts its own and leaves the other process alone.
    record(folder, other, spec, **override)
    server.ensure(spec, startup_timeout_s=30, log=quiet)
    assert server.state["pid"] != other.pid and other.poll() is None
    assert banners(folder) == 1


@pytest.mark.parametrize("kind", ["fingerprint", "legacy"])
def test_the_recorded_process_itself_is_stopped(tmp_path, fake, kind):
    """The control for the test above: with a record that does describe it, the same process is stopped."""
    folder = fake.folder(tmp_path / "run" / "extract")
    proc = fake.sleeper()
    override = {"start_ticks": None, "boot_id": None} if kind == "legacy" else {}
    state = record(folder, proc, fake.spec(), **override)
    assert VllmServer.owns(state)
    assert VllmServer(folder).stop(timeout_s=5, log=quiet) is True
    assert not _alive(proc.pid)  # stopped (and reaped: it is this process's child)
    assert not (folder / "server.json").exists()


def test_a_loading_server_is_awaited_not_killed(tmp_path, fake):
    """A run died while its server loaded; the next run with the same settings waits for that server."""
    run = RunFolder(tmp_path / "run")
    folder = fake.folder(run.extract)
    spec = fake.spec("--delay", "2")
    state, _ = VllmServer(folder).launch(spec, log=quiet)
    assert run_status(run)["server"].startswith(f"starting: pid {state['pid']}")
    assert not VllmServer(folder).healthy()  # not answering yet: not healthy, and not harmed either

    logs: list[str] = []
    t0 = time.monotonic()
    client = VllmServer(folder).ensure(spec, startup_timeout_s=60, log=logs.append)
    assert time.monotonic() - t0 > 0.5  # it did wait
    assert read_json(folder / "server.json")["pid"] == state["pid"] and _alive(state["pid"])
    assert any("still starting" in line for line in logs), logs
    assert any(f"reusing vLLM server pid {state['pid']}" in line for line in logs), logs
    assert not any("started vLLM server" in line for line in logs), logs
    assert banners(folder) == 1
    assert client.base_url == VllmServer(folder).url(state)
    assert read_json(folder / "server.json")["ready_at"]


def test_a_loading_server_past_its_start_up_timeout_is_replaced(tmp_path, fake):
    folder = fake.folder(tmp_path / "run" / "extract")
    spec = fake.spec("--delay", "600")  # never answers
    stuck, _ = VllmServer(folder).launch(spec, log=quiet)
    logs: list[str] = []
    with pytest.raises(ExtractionError, match="did not become healthy within 1 s"):
        VllmServer(folder).ensure(spec, startup_timeout_s=1, log=logs.append)
    assert not _alive(stuck["pid"])
    assert any("did not become healthy within 1 s of its start" in line for line in logs), logs
    assert banners(folder) == 2  # the stuck one, then one fresh start that timed out too
    assert not (folder / "server.json").exists()  # the fresh one was stopped as well


def test_one_failed_health_probe_is_not_death(tmp_path, fake):
    folder = fake.folder(tmp_path / "run" / "extract")
    flaky = tmp_path / "flaky"
    flaky.mkdir()
    spec = fake.spec("--flaky", str(flaky))
    server = VllmServer(folder)
    server.ensure(spec, startup_timeout_s=30, log=quiet)
    pid = server.state["pid"]

    # Fewer failures in a row than HEALTH_PROBES: still healthy, and reused as it is.
    (flaky / str(pid)).write_text(str(HEALTH_PROBES - 1))
    logs: list[str] = []
    server.ensure(spec, startup_timeout_s=30, log=logs.append)
    assert server.state["pid"] == pid and banners(folder) == 1
    assert any(f"reusing vLLM server pid {pid}" in line for line in logs), logs
    assert (flaky / str(pid)).read_text() == "0"

    # HEALTH_PROBES failures in a row: not healthy (after exactly that many probes), and a run replaces it.
    (flaky / str(pid)).write_text("100")
    assert not server.healthy()
    assert (flaky / str(pid)).read_text() == str(100 - HEALTH_PROBES)
    logs.clear()
    server.ensure(spec, startup_timeout_s=30, log=logs.append)
    assert server.state["pid"] != pid and not _alive(pid) and banners(folder) == 2
    assert any(f"failed {HEALTH_PROBES} health probes in a row" in line for line in logs), logs


def test_status_and_stop_server_see_every_server_of_a_run(tmp_path, fake):
    run = RunFolder(tmp_path / "run")
    folders = {
        "extract": run.extract,
        "node": run.extract / "nodes" / "n1",
        "export/server-trained": run.export / "server-trained",
        "evaluate/server-current": run.evaluate / "server-current",
        "evaluate/server-untrained": run.evaluate / "server-untrained",
    }
    states = {}
    for name, folder in folders.items():
        spec = fake.spec(drafter=None if name in ("extract", "node") else f"/drafters/{name}")
        states[name], _ = VllmServer(fake.folder(folder)).launch(spec, log=quiet)
    for name, folder in folders.items():  # each is awaited (it is loading), none is restarted
        VllmServer(folder).ensure(
            fake.spec(drafter=None if name in ("extract", "node") else f"/drafters/{name}"),
            startup_timeout_s=30,
            log=quiet,
        )
        assert VllmServer(folder).state["pid"] == states[name]["pid"]
    assert states["export/server-trained"]["kind"] == "serving" and states["extract"]["kind"] == "extraction"

    status = run_status(run)
    assert status["server"].startswith(f"running pid {states['extract']['pid']}")
    assert status["node_servers"]["n1"].startswith(f"running pid {states['node']['pid']}")
    assert set(status["serving_servers"]) == {
        "export/server-trained",
        "evaluate/server-current",
        "evaluate/server-untrained",
    }
    text = format_status(status)
    for where in status["serving_servers"]:
        assert f"serving server {where}: running pid {states[where]['pid']}" in text
    assert cli("status", "--run-dir", str(run.root)).strip() == text

    assert cli("stop-server", "--run-dir", str(run.root)).strip().endswith("stopped 5 vLLM server(s)")
    assert not any(_alive(s["pid"]) for s in states.values())
    status = run_status(run)
    assert status["server"] == "not running" and status["node_servers"] == {"n1": "not running"}
    assert set(status["serving_servers"].values()) == {"not running"}
    assert cli("stop-server", "--run-dir", str(run.root)).strip() == "no vLLM server was running"


def test_stop_ends_the_processes_that_outlived_their_server(tmp_path, fake):
    """The API server died, but a process of its group (vLLM's engine core, holding the accelerators) lives on:
    status says so, and stop-server ends it, although the recorded pid itself is gone."""
    run = RunFolder(tmp_path / "run")
    folder = fake.folder(run.extract)
    server = VllmServer(folder)
    server.ensure(fake.spec("--child"), startup_timeout_s=30, log=quiet)
    pid = server.state["pid"]
    deadline = time.monotonic() + 10
    while len(_group_members(pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = [p for p in _group_members(pid) if p != pid]
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert not server.healthy()
    assert server.orphans(server.state) == [child]
    assert run_status(run)["server"].startswith(
        f"not running, but 1 process(es) of its group outlived it (pids {child})"
    )
    assert cli("stop-server", "--run-dir", str(run.root)).strip().endswith("stopped 1 vLLM server(s)")
    assert not _alive(child)
    assert run_status(run)["server"] == "not running"


def test_server_env_reaches_the_server_and_is_part_of_its_identity(tmp_path, fake, monkeypatch):
    """extraction.server_env is set in the server's process, over Eyrie's own environment; a server whose env
    differs is a different server (replaced, not reused), one with the same env is reused; a spec without env keeps
    the identity it had before the setting existed, so servers started before it are still reused."""
    from conftest import config_dict

    from eyrie.config import parse_config

    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300")  # Eyrie's own environment, overridden
    env = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800", "EYRIE_TEST_MARK": "a"}
    config = parse_config(config_dict(tmp_path / "t", extraction={"server_env": env}))
    spec = ServerSpec.from_config(config, layer_ids=[1, 2], storage_path=str(tmp_path / "staging"))
    assert spec.server_env == env

    def environ(pid: int) -> dict:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)

    folder = fake.folder(tmp_path / "extract")
    server = VllmServer(folder)
    server.ensure(spec, startup_timeout_s=30, log=quiet)
    first = server.state["pid"]
    assert {k: environ(first)[k] for k in env} == env
    server.ensure(ServerSpec(**{**spec.__dict__, "server_env": dict(env)}), startup_timeout_s=30, log=quiet)
    assert server.state["pid"] == first  # the same settings: reused
    changed = ServerSpec(**{**spec.__dict__, "server_env": {**env, "EYRIE_TEST_MARK": "b"}})
    assert changed.fingerprint() != spec.fingerprint()
    server.ensure(changed, startup_timeout_s=30, log=quiet)
    assert server.state["pid"] != first and not _alive(first)
    assert environ(server.state["pid"])["EYRIE_TEST_MARK"] == "b"


def test_a_failed_start_names_the_error_that_ended_it(tmp_path, fake):
    """vLLM's API server ends a failed start with its own traceback ("Engine core initialization failed"), dozens of
    lines after the worker's error that caused it: the failure names the cause, not only the log's last lines."""
    cause = "ValueError: Available memory on node 0 (19.0/21.09 GiB) on startup is less than desired"
    folder = fake.folder(tmp_path / "extract")
    with pytest.raises(ExtractionError) as err:
        VllmServer(folder).ensure(fake.spec("--fail", cause), startup_timeout_s=30, log=quiet)
    assert f"exited with code 1 while starting: {cause}; the end of its log" in str(err.value)
    assert cause not in str(err.value).split("the end of its log", 1)[1]  # beyond the 30 lines of the tail


def test_the_error_of_a_start_is_the_first_of_the_last_start_that_is_not_vllms_wrapper():
    mark = server_mod.START_MARK
    wrapper = "RuntimeError: Engine core initialization failed. See root cause above."
    log = (
        f"{mark}2026-12-03 07:40:00 =====\n(Worker pid=1) ERROR x y [a.py:1] OSError: an earlier start's\n"
        f"{mark}2026-12-03 07:44:00 =====\n(APIServer pid=2) WARNING 12-03 07:44:14 [s.py:255] Found ulimit: "
        "`OSError: [Errno 24] Too many open files`\n"
        "(EngineCore pid=3) ERROR 12-03 07:44:49 [core.py:9] torch.OutOfMemoryError: no memory\n"
        f"{wrapper}\n"
    )
    assert server_mod.start_error(log) == "torch.OutOfMemoryError: no memory"
    assert server_mod.start_error(f"{mark}x =====\n{wrapper}\n") == wrapper  # only the wrapper: it is what there is
    assert server_mod.start_error(f"{mark}x =====\nINFO loading\n") is None
    # vLLM's config check (seen with --max-model-len past the model's): pydantic gives the reason on the next lines
    pydantic = (
        f"{mark}x =====\npydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n"
        '  File "vllm/engine/arg_utils.py", line 1, in create_model_config\n'
    )
    assert server_mod.start_error(pydantic) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig Value error, "
        "User-specified max_model_len (100000) is greater than the derived max_model_len For further information "
        "visit https://errors.pydantic.dev/2.14/v/value_error"
    )


def test_a_server_spec_is_one_kind(tmp_path):
    from eyrie.config import load_config

    config = load_config("configs/demo.yaml")
    extraction = ServerSpec.for_extraction(config, [1, 2], str(tmp_path / "staging"))
    serving = ServerSpec.for_serving(config, "/drafter")
    assert (extraction.kind, serving.kind, ServerSpec.for_serving(config).kind) == ("extraction", "serving", "target")
    assert serving.num_speculative_tokens == config.evaluate.num_speculative_tokens
    assert isinstance(extraction, ExtractionSpec) and isinstance(serving, ServingSpec)
    # One fingerprint rule for both kinds: a server recorded before the kinds were types keeps its identity.
    assert extraction.fingerprint() == ServerSpec(**extraction.__dict__).fingerprint()
    with pytest.raises(ValueError, match="either extracts hidden states"):
        ServerSpec(model="m", layer_ids=[1], drafter="/drafter")
    with pytest.raises(ValueError, match="captures no hidden states"):
        replace(serving, drafter=None, layer_ids=[1, 2])
    with pytest.raises(ValueError, match="needs the layer ids"):
        replace(extraction, storage_path=None)
