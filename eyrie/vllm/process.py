"""vLLM servers' lives: command line, start, health, reuse, stop.

Two kinds: the extraction server (`extract_hidden_states` + Eyrie's connector) and, for export and evaluation, the
target served with an EAGLE-3 drafter. One server per extraction, started detached in its own process group so
that a killed flow leaves it running and the next run with the same settings reuses it instead of loading the
target again (27 minutes on the real node).
Its state lives in `server.json` beside its log; settings are compared by fingerprint. When several nodes share one
run folder, each node has its own server folder (`extract/nodes/<node>/`, see `server_folder`), so that no two
servers share a `server.json`.

A recorded pid is trusted only with its fingerprint: `server.json` records the process's start time (field 22 of
/proc/<pid>/stat, in clock ticks since boot) and the boot id, and a pid whose start time or boot differs is some
other process (pid reuse, a reboot) that is never signalled. A recorded server that is alive but not yet answering
is awaited up to its start-up timeout rather than killed, and one that answered once is declared dead only after
several consecutive failed health probes.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from eyrie.errors import ExtractionError
from eyrie.run.files import atomic_write_json, private_dir, read_json
from eyrie.vllm.client import ServerClient
from eyrie.vllm.phases import START_MARK
from eyrie.vllm.phases import phases as start_phases
from eyrie.vllm.spec import ServerSpec, free_port

if TYPE_CHECKING:
    pass  # typing.Self is 3.11+; the package supports 3.10

# How many consecutive failed /health probes, this far apart, make a server that answered once count as dead: a
# server busy with a long prefill, or a dropped connection, may miss one.
HEALTH_PROBES = 3
PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 5.0
STARTUP_POLL_S = 1.0  # how often a starting server is probed
# States written before start times were recorded: the process must have started within this many seconds of the
# recorded `started_at` (the same instant, give or take the clock's adjustments since).
LEGACY_START_TOLERANCE_S = 30.0
# An exception's own line, behind vLLM's "(Worker pid=N) ERROR 12-03 07:44:49 [file.py:953] " prefix where it has one.
EXCEPTION_LINE = re.compile(
    r"^(?:\(\S+ pid=\d+\) )?(?:ERROR \S+ \S+ \[[^\]]*\] )?((?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception): .+)$"
)
# What vLLM's API server raises for any engine core that failed: the engine core's own exception is the cause.
WRAPPERS = ("RuntimeError: Engine core initialization failed",)


def start_error(log_text: str) -> str | None:
    """The exception that ended the last start recorded in a server log, with the indented lines that carry on its
    message: the first raised after Eyrie's start mark that is not vLLM's wrapper of it (the worker's ValueError, not
    the API server's "Engine core initialization failed"), which a log's last lines, the API server's traceback,
    usually leave out."""
    last_start = log_text.rfind(START_MARK)
    lines = log_text[max(last_start, 0) :].splitlines()
    found = None
    for i, line in enumerate(lines):
        m = EXCEPTION_LINE.match(line.strip())
        if m:
            error = " ".join([m[1], *_continuation(lines[i + 1 :])])
            if not m[1].startswith(WRAPPERS):
                return error
            found = found or error
    return found


def _continuation(lines: list[str], most: int = 2) -> list[str]:
    """The indented lines that carry on an exception's message (pydantic's "1 validation error for ModelConfig" puts
    its reason on the next line), up to `most`; a traceback's frames are not one."""
    out = []
    for line in lines[:most]:
        if not line[:1].isspace() or line.lstrip().startswith("File "):
            break
        out.append(line.strip())
    return out


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3 onwards of /proc/<pid>/stat (state, ppid, pgrp, session, ...; field 22 is at index 19), or None when
    there is no such process. The command name (field 2) may hold spaces and parentheses: split after the last ')'."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return text[text.rindex(")") + 2 :].split()


def process_start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (field 22 of /proc/<pid>/stat); None if there is none."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def _alive(pid: int) -> bool:
    """Whether some process (not a zombie) has this pid; says nothing about which process it is (see `owns`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0): check its state.
    fields = _proc_stat(pid)
    return fields is None or fields[0] not in ("Z", "X")


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group, read from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            fields = _proc_stat(int(d.name))
            if fields and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                out.append(int(d.name))
    return out


def _reap(pid: int) -> None:
    """Collect the exit status if the pid is our own child (a server this process started), so it is no zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


class VllmServer:
    """A handle on the vLLM server recorded in `folder/server.json` (log in `folder/server.log`): an extraction server
    or one serving target plus drafter (export, evaluation); the spec given to `ensure` says which."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.state_path = self.folder / "server.json"
        self.log_path = self.folder / "server.log"

    @property
    def state(self) -> dict | None:
        return read_json(self.state_path)

    def url(self, state: dict | None = None) -> str:
        state = state or self.state
        if state is None:
            raise ExtractionError(f"no server is recorded in {self.state_path}")
        host = state["host"]
        host = "127.0.0.1" if host in ("0.0.0.0", "localhost") else host
        return f"http://[{host}]:{state['port']}" if ":" in host else f"http://{host}:{state['port']}"

    @staticmethod
    def local(state: dict) -> bool:
        """Whether the recorded server runs on this host (a shared run folder is seen from several hosts; a pid
        means nothing on another one). States written before hosts were recorded are local."""
        return state.get("hostname", socket.gethostname()) == socket.gethostname()

    @classmethod
    def owns(cls, state: dict) -> bool:
        """Whether the recorded pid is still the server that was recorded: on this host, alive (not a zombie), and
        with the recorded start time and boot id. A pid reused by another process, or recorded before a reboot, is
        not the server, is reported not running, and is never signalled."""
        if not state or not cls.local(state) or not isinstance(state.get("pid"), int):
            return False
        fields = _proc_stat(state["pid"])
        if not fields or fields[0] in ("Z", "X"):
            return False
        ticks = int(fields[19])
        if "start_ticks" in state:
            return state["start_ticks"] == ticks and state.get("boot_id") == boot_id()
        # Written before start times were recorded: the process's own start, as wall-clock time, must be the
        # recorded one.
        btime, started = _boot_time(), state.get("started_at")
        if btime is None or not isinstance(started, (int, float)):
            return False
        return abs(btime + ticks / os.sysconf("SC_CLK_TCK") - started) <= LEGACY_START_TOLERANCE_S

    @classmethod
    def orphans(cls, state: dict) -> list[int]:
        """Live processes of the recorded server's process group whose leader (the recorded pid) is gone: engine
        cores or tensor-parallel workers that outlived the API server and may still hold the accelerators. A pid
        cannot be handed out again while a process group of that number exists, so on the same boot these are the
        server's own; states without a boot id get none."""
        if (
            not state
            or not cls.local(state)
            or not state.get("boot_id")
            or state["boot_id"] != boot_id()
            or not isinstance(state.get("pid"), int)
            or _alive(state["pid"])
        ):
            return []
        since = state.get("start_ticks") or 0
        return [p for p in _group_members(state["pid"]) if (process_start_ticks(p) or -1) >= since]

    def probe(self, state: dict | None = None, headers: dict | None = None) -> bool:
        """One /health request to the recorded server, if it is still the recorded process."""
        state = state or self.state
        if not state or not self.owns(state):
            return False
        if headers is None and (key := os.environ.get(state.get("api_key_env") or "")):
            headers = {"Authorization": f"Bearer {key}"}  # a server with a key guards /health too (plugin/auth.py)
        try:
            r = requests.get(self.url(state) + "/health", timeout=PROBE_TIMEOUT_S, headers=headers)
        except requests.RequestException:
            return False
        return r.status_code == 200

    def healthy(self, state: dict | None = None, headers: dict | None = None, probes: int | None = None) -> bool:
        """Whether the recorded server answers: True at the first good probe; False at once when its process is gone
        (or is not the recorded one), else only after `probes` (HEALTH_PROBES) consecutive failed probes."""
        state = state or self.state
        probes = HEALTH_PROBES if probes is None else probes
        for i in range(max(1, probes)):
            if i:
                time.sleep(PROBE_INTERVAL_S)
            if not state or not self.owns(state):
                return False
            if self.probe(state, headers):
                return True
        return False

    def ensure(self, spec: ServerSpec, startup_timeout_s: float = 1800, log=print) -> ServerClient:
        """Reuse the recorded server when it runs these settings: if it is still loading, wait for it up to its
        start-up timeout (counted from its start); if it answered before, unless several probes in a row fail.
        Otherwise stop it and start one, and wait."""
        key = spec.api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else None
        state = self.state
        if state and state.get("fingerprint") == spec.fingerprint() and self.owns(state):
            if not state.get("ready_at"):
                if self.probe(state, headers):
                    log(f"reusing vLLM server pid {state['pid']} at {self.url(state)}")
                    self._mark_ready(state)
                    return ServerClient(self.url(state), key)
                loading = time.time() - state.get("started_at", time.time())
                log(
                    f"vLLM server pid {state['pid']} with these settings is still starting ({loading:.0f} s so far): "
                    f"waiting for it up to the start-up timeout ({startup_timeout_s:.0f} s)"
                )
                if self._wait_ready(state, headers, startup_timeout_s, log):
                    log(f"reusing vLLM server pid {state['pid']} at {self.url(state)}")
                    return ServerClient(self.url(state), key)
                if self.owns(state):
                    log(
                        f"vLLM server pid {state['pid']} did not become healthy within {startup_timeout_s:.0f} s of "
                        "its start: stopping it and starting a new one"
                    )
                else:
                    log(
                        f"vLLM server pid {state['pid']} exited while starting{self.start_error()}; the end of its log "
                        f"({self.log_path}):\n{self.log_tail()}\nstarting a new one"
                    )
            elif self.healthy(state, headers):
                log(f"reusing vLLM server pid {state['pid']} at {self.url(state)}")
                return ServerClient(self.url(state), key)
            else:
                log(f"vLLM server pid {state['pid']} failed {HEALTH_PROBES} health probes in a row: replacing it")
        self.stop(log=log)

        state, proc = self.launch(spec, log=log)
        if self._wait_ready(state, headers, startup_timeout_s, log, proc=proc):
            return ServerClient(self.url(state), key)
        if proc.poll() is not None:
            raise ExtractionError(
                f"the vLLM server exited with code {proc.returncode} while starting{self.start_error()}; the "
                f"end of its log ({self.log_path}):\n{self.log_tail()}"
            )
        self.stop(log=log)
        raise ExtractionError(
            f"the vLLM server did not become healthy within {startup_timeout_s:.0f} s "
            f"(extraction.startup_timeout_s); see {self.log_path}"
        )

    def launch(self, spec: ServerSpec, log=print) -> tuple[dict, subprocess.Popen]:
        """Start a server for `spec` detached, in its own session and process group, and record it with its process
        fingerprint (start time, boot id); does not wait for it to load."""
        spec.check_bind()
        key = spec.api_key()
        self.folder.mkdir(parents=True, exist_ok=True)
        if spec.storage_path:  # where the connector writes hidden states in flight: this user's alone
            private_dir(Path(spec.storage_path))
        port = spec.port or free_port(spec.host)
        # An allow-list, not the flow's environment (no Prefect key, no hub token: eyrie/run/environment.py), then the
        # operator's extraction.server_env over it.
        env = spec.environment()
        if key:
            env["VLLM_API_KEY"] = key  # through the environment: a command line shows in `ps` and in logs
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n{START_MARK}{time.strftime('%F %T')} =====\n".encode())
            logf.flush()
            proc = subprocess.Popen(
                spec.command(port),
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        state = {
            "pid": proc.pid,
            "start_ticks": process_start_ticks(proc.pid),
            "boot_id": boot_id(),
            "host": spec.host,
            "port": port,
            "fingerprint": spec.fingerprint(),
            "api_key_env": spec.api_key_env,  # the variable's name, never the key: probes read it from there
            "kind": spec.kind,
            "model": spec.model,
            "layer_ids": spec.layer_ids,
            "drafter": spec.drafter,
            "started_at": time.time(),
            "hostname": socket.gethostname(),
        }
        atomic_write_json(self.state_path, state)
        log(f"started vLLM server pid {proc.pid} on {self.url(state)}; log: {self.log_path}")
        return state, proc

    def _wait_ready(
        self, state: dict, headers: dict | None, startup_timeout_s: float, log, proc: subprocess.Popen | None = None
    ) -> bool:
        """Poll until the server answers (True), exits, or `startup_timeout_s` after its recorded start has passed."""
        deadline = time.monotonic() + state.get("started_at", time.time()) + startup_timeout_s - time.time()
        while True:
            if proc is not None and proc.poll() is not None:
                return False
            if not self.owns(state):
                return False
            if self.probe(state, headers):
                log(f"vLLM server ready after {time.time() - state['started_at']:.0f} s")
                self._mark_ready(state)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(STARTUP_POLL_S, max(0.05, deadline - time.monotonic())))

    def _mark_ready(self, state: dict) -> None:
        """Record that the server answered once: from then on, failed probes mean trouble, not loading."""
        if state.get("ready_at"):
            return
        state["ready_at"] = time.time()
        try:
            # Where the start-up went (weights, compile, CUDA graphs...), for `eyrie status` and the flow's artifact.
            state["phases"] = start_phases(self.log_path.read_text(errors="replace"), state["ready_at"])
        except OSError:
            pass
        try:
            atomic_write_json(self.state_path, state)
        except OSError:  # advisory (a full disk must not fail a server that runs)
            pass

    def start_error(self) -> str:
        """`: <the exception that ended the last start>` (see `start_error`), or nothing."""
        try:
            found = start_error(self.log_path.read_text(errors="replace"))
        except OSError:
            return ""
        return f": {found}" if found else ""

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30, log=print) -> bool:
        """Stop the recorded server's whole process group (engine core, TP workers); True if one was running.

        Only a process that is provably the recorded server is signalled (see `owns`), or, once that process is
        gone, the live rest of its process group (see `orphans`). A record whose pid is now someone else's, or
        is gone, is removed without a signal."""
        state = self.state
        if not state:
            return False
        if not self.local(state):
            # Never signal a pid recorded on another host: here it is some unrelated process, or none.
            log(f"{self.state_path} records a server on host {state['hostname']}, not this one: left alone")
            return False
        pid = state.get("pid")
        if not isinstance(pid, int):
            self.state_path.unlink(missing_ok=True)
            return False

        def ours() -> bool:
            return self.owns(state) or bool(self.orphans(state))

        if not ours():
            if _alive(pid):
                log(
                    f"{self.state_path} records pid {pid}, which is now another process (its start time or boot "
                    "differs): not signalled; the record is removed"
                )
            self.state_path.unlink(missing_ok=True)
            return False
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not ours():
                break
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 10)
            while time.monotonic() < deadline:
                _reap(pid)
                if not ours():
                    break
                time.sleep(0.2)
        _reap(pid)
        log(f"stopped vLLM server pid {pid} ({self.folder})")
        self.state_path.unlink(missing_ok=True)
        return True
