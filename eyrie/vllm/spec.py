"""What a vLLM server of the target is started with: the spec (its two kinds, extraction and serving), its
fingerprint, and the command line built from it."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eyrie.config import is_loopback
from eyrie.errors import ExtractionError
from eyrie.hidden_states.encoding import ENV as HIDDEN_STATES_DTYPE_ENV
from eyrie.run.environment import child_environment
from eyrie.run.vllm_python import vllm_cpu_build as run_vllm_cpu_build
from eyrie.run.vllm_python import vllm_environment_id, vllm_python
from eyrie.vllm.levers import LANGUAGE_MODEL_ONLY_FLAG
from eyrie.vllm.plugin import CONNECTOR_NAME
from eyrie.vllm.plugin.auth import MIDDLEWARE as AUTH_MIDDLEWARE

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; the package supports 3.10

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# On vLLM's CPU build a server's KV cache gets this many GiB unless the operator sizes it (see `environment`).
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_CACHE_GIB = "1"
GENERATION_CACHE_SALT = "eyrie-regenerate"  # see ServerClient.generate


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
    # The start-up levers (`eyrie.vllm.levers`): --language-model-only changes what the server builds (in the
    # fingerprint); the others only how fast it starts (`startup_args`, `startup_env`: not in the fingerprint).
    language_model_only: bool = False
    startup_args: list[str] = field(default_factory=list)
    startup_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.drafter and self.layer_ids is not None:
            raise ValueError("a server either extracts hidden states (layer_ids) or serves a drafter, not both")

    @staticmethod
    def for_extraction(config, layer_ids: list[int], storage_path: str) -> ExtractionSpec:
        spec = ExtractionSpec.from_config(config, layer_ids=layer_ids, storage_path=storage_path)
        # The connector reads how to encode the hidden states from its environment.
        spec.server_env = {**spec.server_env, HIDDEN_STATES_DTYPE_ENV: config.extraction.hidden_states_dtype}
        return spec

    @staticmethod
    def for_serving(config, drafter: str | None = None) -> ServingSpec:
        return ServingSpec.from_config(
            config, drafter=drafter, num_speculative_tokens=config.evaluate.num_speculative_tokens
        )

    @classmethod
    def from_config(cls, config, **kw) -> Self:
        """The target as the pipeline config serves it; `kw` picks extraction or drafter serving."""
        from eyrie.vllm.levers import plan_for

        t, x = config.target, config.extraction
        model = str(Path(t.model).resolve()) if Path(t.model).exists() else t.model
        kind = "serving" if kw.get("drafter") else "extraction" if kw.get("layer_ids") is not None else "target"
        plan = plan_for(config, kind, child_environment())
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
            language_model_only=plan.language_model_only,
            startup_args=[a for a in plan.args if a != LANGUAGE_MODEL_ONLY_FLAG],
            startup_env=plan.env,
            **kw,
        )

    @property
    def kind(self) -> str:
        """`serving` (target plus an EAGLE-3 drafter), `extraction` (layer ids to capture) or `target` (the target
        alone: evaluation's baseline for throughput)."""
        return "serving" if self.drafter else "extraction" if self.layer_ids is not None else "target"

    def _target(self):
        from eyrie.config import TargetConfig

        return TargetConfig(model=self.model, revision=self.revision, trust_remote_code=self.trust_remote_code)

    def fingerprint(self) -> str:
        """What makes two servers interchangeable (`eyrie.run.identity.STAGES["server.*"]`): every setting it is
        started with but the port (never the key's value), the target's identity (its weights at that path, or the
        hub commit), its tokenizer files and code with the chat template, its generation_config.json, the
        output-shaping variables it inherits (`eyrie.run.identity.output_environment`), the drafter's content (a
        re-export at the same path is another server), the vLLM version and the environment that runs it
        (`eyrie.run.vllm_python.vllm_environment_id`: two environments holding the same vLLM version may differ in
        what else they hold, so a server another environment started is not reused)."""
        from eyrie.target.metadata import stage_key

        d = asdict(self)
        d.pop("port")
        d.pop("startup_args")  # start-up speed only (eyrie.vllm.levers)
        d.pop("startup_env")
        d["vllm_environment"] = vllm_environment_id()
        stage = "server.serving" if self.kind != "extraction" else "server.extraction"
        return stage_key(stage, None, target=self._target(), drafter=self.drafter, spec=d)

    def output_identity(self) -> str:
        """What this server computes, for the keys of what it measures or proves (evaluation, export): the target's
        identity and dtype, its tokenizer files and code, chat template and generation_config.json (the prompts a
        chat request renders, the default sampling and end tokens), the context limit, what it drafts with (the
        drafter's content, draft tokens) or captures, the output-shaping server arguments and environment, its
        own (`eyrie.run.identity.output_server_args`, `output_server_env`: not scheduling-only ones such as
        --max-num-seqs) and inherited (`output_environment`: VLLM_ATTENTION_BACKEND exported in the shell), and the
        vLLM version. Not the host, port, key, parallelism or memory settings. A change of any of them gives the
        current drafter's measurement a new key, so it is measured again before a promotion compares with it."""
        from eyrie.run.identity import output_server_args, output_server_env
        from eyrie.target.metadata import stage_key

        spec = {
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "layer_ids": self.layer_ids,
            "num_speculative_tokens": self.num_speculative_tokens if self.drafter else None,
            "server_args": output_server_args(self.server_args),
            "server_env": output_server_env(self.server_env),
        }
        return stage_key("server.outputs", None, target=self._target(), drafter=self.drafter, spec=spec)

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
        """The server's command line, run by the interpreter that runs vLLM ($EYRIE_VLLM_PYTHON, else this one:
        `eyrie.run.vllm_python`). `python -m` because the `vllm` console script fails under the vllm-cpu
        distribution name."""
        return [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", *self.arguments(port)]

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
        if self.api_key_env:
            # vLLM's key guards a few path prefixes only: Eyrie's middleware guards every route (plugin/auth.py).
            cmd += ["--middleware", AUTH_MIDDLEWARE]
        if self.language_model_only:
            cmd.append(LANGUAGE_MODEL_ONLY_FLAG)
        return cmd + list(self.startup_args) + list(self.server_args)

    def environment(self, environ: dict[str, str] | None = None, cpu_build: bool | None = None) -> dict[str, str]:
        """The server's environment: the allow-listed one (`eyrie.run.environment`) with `server_env` over it.

        On vLLM's CPU build, with no KV-cache size chosen (VLLM_CPU_KVCACHE_SPACE, `--kv-cache-memory-bytes` or
        `extraction.gpu_memory_utilization`), the KV cache gets CPU_KV_CACHE_GIB GiB. vLLM's own default there is
        `--gpu-memory-utilization` 0.92 of the machine's memory, which its worker refuses to start without
        ("Available memory on node 0 (19.0/21.09 GiB) on startup is less than desired CPU memory utilization")
        wherever the flow, the Prefect server and vLLM's own API server already hold more than 8% of it, and which
        would leave nothing for a trainer beside an online server. 1 GiB holds 419,328 tokens of the demo's target."""
        env = child_environment({**self.startup_env, **self.server_env}, environ=environ)
        sized = env.get(CPU_KV_CACHE_ENV, "") != "" or self.gpu_memory_utilization is not None  # vLLM: '' is unset
        sized = sized or any(a.split("=")[0] == "--kv-cache-memory-bytes" for a in self.server_args)
        if not sized and (vllm_cpu_build() if cpu_build is None else cpu_build):
            env[CPU_KV_CACHE_ENV] = CPU_KV_CACHE_GIB
        return env

    def check_bind(self) -> None:
        """A server listens beyond loopback only with an API key, which then guards every route (`arguments`)."""
        if not is_loopback(self.host) and not self.api_key_env:
            raise ExtractionError(
                f"a vLLM server on {self.host!r} would answer anyone on the network, and vLLM without a key "
                "authenticates nothing: keep extraction.host on loopback (127.0.0.1), or set "
                "extraction.api_key_env to the name of a variable holding an API key"
            )


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


def vllm_cpu_build() -> bool:
    """The vLLM that runs the servers is its CPU build: the `vllm-cpu` distribution, or a source build versioned
    `+cpu`, in the environment of the interpreter that runs them (`eyrie.run.vllm_python`)."""
    return run_vllm_cpu_build()


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
