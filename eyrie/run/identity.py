"""What each keyed output depends on, declared once; every stage's key is computed from this declaration.

A key is a promise: two runs with the same key produce interchangeable outputs, so the second reuses the first's. It
breaks two ways. An input that shapes the output but is in no key gives a wrong reuse (a drafter built from stale
parts ships silently); an input that shapes nothing but is in a key throws finished work away (days of GPU time for a
changed log interval). So for every keyed output (`STAGES`) this module names, explicitly:

- `config`: the `PipelineConfig` fields (dotted paths) that shape it; for the output stages (not the servers) the
  vLLM server arguments and environment enter only through what changes what the target computes or generates
  (`output_server_args`, `output_server_env`): scheduling-only flags (`SCHEDULING_FLAGS`) are left out;
- `upstream`: what it is made from that another stage or the stage itself computed (an upstream key, a shard's
  content fingerprint, the layer ids preflight resolved), named, so a key function that passes another set fails;
- `files`: the identities of files it reads (`FILE_KINDS`): the target's weights, its tokenizer files, its generation
  config, a drafter's weights;
- `versions`: the installed distributions whose version changes it.

Every config field is either declared by the stages it shapes or listed in `NOT_SHAPING` with the reason it shapes
none; `tests/unit/test_identity.py` walks `PipelineConfig`, changes each field (and each kind of file) alone and
checks that exactly the declared keys change, so a new field without a declaration fails it.

Every key also holds `FORMAT_VERSION`, the run folder's one format stamp (`eyrie.run.folder.RunFolder.ensure`
refuses a folder of another format, saying what to do).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from eyrie import FORMAT_VERSION
from eyrie.config import TrainSpeedConfig
from eyrie.run.files import atomic_write_json, read_json, sha256_json

# ---------------------------------------------------------------------------------------------------------------
# The declaration


@dataclass(frozen=True)
class Inputs:
    config: tuple[str, ...] = ()
    upstream: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    versions: tuple[str, ...] = ()
    # Servers: the spec built from the config is the input (eyrie.vllm.spec), and every field of it counts as it is
    # (two servers are interchangeable only when started alike); `config` then lists the fields the spec reads.
    from_spec: bool = False
    # Server arguments and environment count only by what changes outputs (`OUTPUT_PICKS`). False for the servers'
    # own identity, where every argument counts.
    outputs_only: bool = True
    # Whole config sections, every field of them counting as it is: for a check's verdict (`VERDICTS`), which reads
    # most of each section it looks at, so that a field it reads can never be left out of its key.
    sections: tuple[str, ...] = ()
    # What a vLLM server computes also depends on the variables it inherits (`output_environment`: the child
    # allow-list's computing libraries, less the scheduling-only ones); True where a server computes the output.
    environment: bool = False


FILE_KINDS = {
    "target": "the target's weights (each file by its whole content, `file_digest`), config.json and its own Python "
    "model code; a hub target: the commit its revision is pinned to",
    "tokenizer": "the target's tokenizer and processor files, chat template included (every file of the folder that "
    "is no weight, no model or generation config and no documentation: tokenizer_config.json, "
    "chat_template.jinja/.json, vocabularies...) and their own Python code (`code_kinds`: the modules a "
    "tokenizer or processor config's auto_map names or transformers' file names mark as such, and the folder's "
    "modules they import); a hub target: its pinned commit",
    "generation_config": "the target's generation_config.json (vLLM's default sampling parameters and end tokens)",
    "drafter": "a drafter's weights and config (a warm start's base, a served drafter)",
}

_SERVER_COMMON = (
    "target.model",
    "target.revision",
    "target.trust_remote_code",
    "target.tensor_parallel_size",
    "target.dtype",
    "target.max_model_len",
    "data.max_length",  # the default max_model_len
    "extraction.host",
    "extraction.api_key_env",
    "extraction.enforce_eager",
    "extraction.gpu_memory_utilization",
    "extraction.server_args",
    "extraction.server_env",
)

STAGES: dict[str, Inputs] = {
    # The tokenized, truncated, sharded conversations. The source enters by content (local files' sha256, a hub
    # dataset's pinned commit), the tokenizer by what it does (template, vocabulary, backend) and by its files.
    "prepare": Inputs(
        config=(
            "data.split",
            "data.subset",
            "data.max_length",
            "data.max_samples",
            "data.shard_size",
            "data.eval_fraction",
        ),
        upstream=("source", "tokenizer"),
        files=("tokenizer",),
    ),
    # One regenerated shard: the target's answers to the prepared conversations. What the target generates depends
    # on its weights, dtype, generation config, output-shaping server arguments and the sampling; the context limit
    # cuts answers short.
    "regenerate.shard": Inputs(
        config=(
            "target.dtype",
            "target.max_model_len",
            "data.max_length",
            "regenerate.temperature",
            "regenerate.temperature_mix",
            "regenerate.template_mix",  # each conversation rendered with its variant's switches
            "regenerate.top_p",
            "regenerate.seed",
            "regenerate.max_tokens",
            "extraction.server_args",
            "extraction.server_env",
        ),
        upstream=("shard", "template"),
        files=("target", "tokenizer", "generation_config"),
        environment=True,
    ),
    "regenerate": Inputs(config=("regenerate.length_capped",), upstream=("shards",)),
    # One shard's hidden states, by content: what the target computes (weights, dtype, output-shaping arguments),
    # which layers, which rows, how the values are encoded. Training keys on these.
    "extract": Inputs(
        config=(
            "target.dtype",
            "extraction.hidden_states_dtype",
            "extraction.server_args",
            "extraction.server_env",
        ),
        upstream=("captured", "shard"),
        files=("target",),
        environment=True,
    ),
    # The same hidden states as laid out on disk (a shard's manifest): a change of layout repacks or extracts
    # again, and changes nothing downstream.
    "extract.layout": Inputs(config=("extraction.storage",), upstream=("content",)),
    "vocab": Inputs(
        config=("vocab.draft_vocab_size",),
        upstream=("data", "target_vocab_size"),
        files=("drafter",),  # a warm start keeps its base's mapping
    ),
    # The checkpoints' lineage: what determines the weights. Devices, logging, checkpoint frequency and where the
    # hidden states are read from do not; a change of them resumes from the newest checkpoint.
    "train": Inputs(
        config=(
            "train.epochs",
            "train.lr",
            "train.ttt_steps",
            "train.max_seq_len",
            "train.num_layers",
            "train.val_fraction",
            "train.mask_token_id",
            "train.seed",
            "train.optimizer",
            "train.target_transform",  # the labels: the target's own transform, or speculators' approximation
            "vocab.draft_vocab_size",
            "promotion.warm_start_lr_scale",
        ),
        upstream=("data", "vocab", "aux"),
        files=("target", "drafter"),  # the verifier's embedding, norm and head; a warm start's base
        versions=("speculators",),
    ),
    # Which of the lineage's checkpoints ships: the plateau rule. A change of it keeps the checkpoints (the
    # train key is the lineage's key and this one's, `eyrie.stages.train.trainer.train_key`) and re-decides.
    "train.stop": Inputs(
        config=("train.stop_on_plateau", "train.plateau_patience", "train.plateau_min_delta"),
        upstream=("lineage",),
    ),
    "untrained": Inputs(
        config=("train.num_layers", "train.ttt_steps", "train.max_seq_len", "train.seed", "vocab.draft_vocab_size"),
        upstream=("vocab", "aux"),
        files=("target",),
        versions=("speculators",),
    ),
    # The exported drafter and its vLLM proof: the checkpoint, the layers it reads, the verifier it names (the
    # target's path or hub id) and what the proving server computes (`server`: `ServerSpec.output_identity`).
    "export": Inputs(config=("target.model",), upstream=("train", "aux", "server")),
    # One drafter's measurement: which drafter, on which prompts, generating how much, on what its server computes
    # (target identity, drafter content, draft tokens, output-shaping arguments, vLLM version).
    "evaluate": Inputs(
        config=(
            "evaluate.num_prompts",
            "evaluate.max_tokens",
            "evaluate.sweep_draft_tokens",  # the trained drafter's measurement then includes throughput
            "evaluate.throughput_concurrency",
            "evaluate.template_variants",  # each variant is also measured, rendered with its switches
        ),
        upstream=("label", "drafter_id", "prompts", "server"),
    ),
    "draft_tokens": Inputs(
        config=("evaluate.sweep_draft_tokens", "evaluate.throughput_concurrency", "evaluate.max_tokens"),
        upstream=("trained",),
    ),
    # What a serving server computes (`ServerSpec.output_identity`): the `server` of export's and evaluation's keys.
    # Not the host, key, parallelism, memory or scheduling-only settings; the drafter by content.
    "server.outputs": Inputs(
        config=(
            "target.dtype",
            "target.max_model_len",
            "data.max_length",  # the default max_model_len
            "extraction.server_args",
            "extraction.server_env",
            "evaluate.num_speculative_tokens",
        ),
        upstream=("spec",),
        files=("target", "tokenizer", "generation_config", "drafter"),
        versions=("vllm",),
        from_spec=True,
        outputs_only=True,
        environment=True,
    ),
    # Servers: whether a running one may be reused (eyrie.vllm.process.VllmServer.ensure): started alike.
    "server.extraction": Inputs(
        config=(*_SERVER_COMMON, "extraction.hidden_states_dtype"),
        upstream=("spec",),
        files=("target", "tokenizer", "generation_config"),
        versions=("vllm",),
        from_spec=True,
        outputs_only=False,
        environment=True,
    ),
    "server.serving": Inputs(
        config=(*_SERVER_COMMON, "evaluate.num_speculative_tokens"),
        upstream=("spec",),
        files=("target", "tokenizer", "generation_config", "drafter"),
        versions=("vllm",),
        from_spec=True,
        outputs_only=False,
        environment=True,
    ),
}

# Verdicts: keyed results of checks, not stage outputs. Preflight's verdict on the target, the installed vLLM and the
# config (eyrie.stages.preflight.verdict): whole sections, since a field it reads but its key missed would let a
# config it refuses pass on a cached verdict; the target's files and tokenizer; the libraries whose classes, parsers
# and registries it inspects; `checks`: the source of the checks themselves; `environment`: the variables they read;
# `serve`: whether the serving server was checked too. The node's checks (GPUs, flock, /dev/shm, disk, the promotion
# folder) are not in it: they run on every call.
VERDICTS: dict[str, Inputs] = {
    "preflight": Inputs(
        sections=("target", "data", "extraction", "regenerate", "vocab", "train", "evaluate"),
        upstream=("serve", "checks", "environment"),
        files=("target", "tokenizer"),
        versions=("vllm", "transformers", "torch", "speculators"),
    ),
}

# Config fields that shape no keyed output, each with the reason.
NOT_SHAPING: dict[str, str] = {
    "name": "the run's name: where its folder is",
    "target.tiny": "how a missing target folder is built; what was built enters through the target's files",
    "target.vllm_version": "a check of the installed vLLM; the installed version itself is in the keys it shapes",
    "target.recurrent_layers": "whether preflight lets a target with recurrent layers load; what is extracted "
    "from it is the same (preflight's verdict holds the whole section)",
    "data.source": "enters by content: local files' sha256, a hub dataset's id and pinned commit (`source`)",
    "data.revision": "enters through the source's pinned commit (`source`)",
    "extraction.layer_ids": "enters as the layer ids preflight resolves from it and the target (`captured`)",
    "extraction.port": "where a server listens: a running server is reused on the port it has",
    "extraction.concurrency": "requests in flight: scheduling",
    "extraction.startup_timeout_s": "how long to wait for a server",
    "extraction.request_timeout_s": "how long to wait for a request",
    "extraction.min_free_disk_gib": "preflight's head-room check",
    "extraction.verify_checksums": "how completeness is checked, not what is made",
    "extraction.keep_server_after_failure": "whether a server outlives a failure",
    "extraction.startup.language_model_only": "enters the servers' keys through their spec "
    "(`ServerSpec.language_model_only`: true only where the flag is applied, a multimodal wrapper on a vLLM that "
    "has it); no output key: the text a wrapper computes is its language model's either way",
    **{
        f"extraction.startup.{name}": "how fast a server starts (eyrie.vllm.levers: VLLM_ENABLE_STARTUP_PLAN, "
        "VLLM_CACHE_ROOT, --load-format ipc_cache, none in a server's fingerprint); a lever that cannot work is "
        "refused by preflight"
        for name in ("startup_plan", "compile_cache", "weight_cache", "snapshot")
    },
    "extraction.unproven_aux_layers": "whether a run whose capture the proof cannot fully check goes on; what is "
    "extracted is the same (preflight's verdict holds the whole section)",
    "regenerate.enabled": "which data extraction reads: enters through the upstream data keys",
    "regenerate.concurrency": "requests in flight: scheduling",
    "regenerate.request_timeout_s": "how long to wait for an answer",
    "regenerate.retries": "how often a failed request is retried; a row lost to errors is not written as done",
    "train.save_every_steps": "checkpoint frequency: a resume point, not the weights",
    "train.devices": "GPUs: a change resumes from the newest checkpoint (approximate: the data is dealt to ranks "
    "anew; the trainer warns)",
    "train.device": "where to train: a change resumes (the trainer warns)",
    "train.log_every_steps": "logging",
    "train.loggers": "where the metrics are also sent",
    "train.still_improving_warning": "a warning's threshold, recomputed from the saved validation history",
    "train.hidden_states": "where the same hidden states are read from (files, or the server online)",
    **{
        f"train.speed.{name}": "how fast the trainer runs on GPUs (eyrie.config.TrainSpeedConfig): a change resumes"
        for name in TrainSpeedConfig.model_fields
    },
    "evaluate.max_train_serve_gap": "the report's flag threshold",
    "evaluate.untrained_baseline": "which drafters are measured, not what one measurement is",
    "evaluate.prompt_sets": "its prompts enter the evaluate key by content, as `prompts` "
    "(eyrie.stages.evaluate.evaluate_key's `sets`)",
    "promotion.dir": "where drafters are promoted: the current drafter enters by its content (`drafter`)",
    "promotion.warm_start": "whether a base is used: enters through the base's content (`drafter`)",
    **{
        f"tracking.{name}": "where a finished run is exported to (MLflow, W&B), after every stage"
        for name in (
            "mlflow",
            "mlflow_tracking_uri",
            "mlflow_experiment",
            "mlflow_artifact_location",
            "wandb",
            "wandb_project",
            "wandb_entity",
            "run_name",
            "log_drafter",
        )
    },
}

# ---------------------------------------------------------------------------------------------------------------
# vLLM arguments and environment that change nothing the target computes or generates. Anything not listed counts
# (quantization, KV-cache dtype, generation config overrides, attention backend...): an unknown flag is assumed to
# shape outputs, so a wrong guess costs a recompute, never a wrong reuse.

SCHEDULING_FLAGS = frozenset(
    {
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-num-partial-prefills",
        "--max-long-partial-prefills",
        "--long-prefill-token-threshold",
        "--scheduling-policy",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--gpu-memory-utilization",
        "--kv-cache-memory-bytes",
        "--swap-space",
        "--cpu-offload-gb",
        "--block-size",
        "--num-gpu-blocks-override",
        "--max-parallel-loading-workers",
        "--distributed-executor-backend",
        "--disable-log-requests",
        "--enable-log-requests",
        "--disable-log-stats",
        "--uvicorn-log-level",
        "--disable-uvicorn-access-log",
        "--download-dir",
        "--load-format",
        "--safetensors-load-strategy",
        "--cuda-graph-sizes",
        "--max-seq-len-to-capture",
        "--compilation-config",
        "-O",
        "--api-server-count",
        "--data-parallel-size",
        "--disable-frontend-multiprocessing",
        "--max-log-len",
        "--otlp-traces-endpoint",
        "--collect-detailed-traces",
    }
)
SCHEDULING_ENV = frozenset(
    {
        "VLLM_LOGGING_LEVEL",
        "VLLM_CONFIGURE_LOGGING",
        "VLLM_LOG_STATS_INTERVAL",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_NUM_OF_RESERVED_CPU",
        "VLLM_ENGINE_ITERATION_TIMEOUT_S",  # read by vLLM 0.26 (the GPU build measured), gone from 0.32
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_CACHE_ROOT",
        "VLLM_ENABLE_STARTUP_PLAN",  # a kept memory-profiling result reused at start-up (eyrie.vllm.levers)
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
        "VLLM_HOST_IP",
        "VLLM_PORT",
        "VLLM_SERVER_DEV_MODE",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "EYRIE_CPU_ENGINE_FORK",  # how the engine core's process is made, not what it computes
        "TORCHINDUCTOR_CACHE_DIR",
        "HF_HOME",
        "HF_HUB_OFFLINE",
        # Set by vLLM's own import in the process that imports it (so also in the flow): threads, caches, how CUDA
        # is probed; none of them changes a value computed.
        "TORCHINDUCTOR_COMPILE_THREADS",
        "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "TRITON_CACHE_AUTOTUNING",
        "TRITON_CACHE_DIR",
        "TOKENIZERS_PARALLELISM",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "KMP_AFFINITY",
        "KMP_BLOCKTIME",
        "PYTORCH_CUDA_ALLOC_CONF",
        "CUDA_DEVICE_ORDER",
        "CUDA_MODULE_LOADING",
        "NCCL_DEBUG",
        "NCCL_SOCKET_IFNAME",
        "VLLM_RPC_BASE_PATH",
        "VLLM_USAGE_SOURCE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
    }
)

# The variables a server inherits (the child allow-list, `eyrie.run.environment`) under these prefixes are read by
# the libraries that compute its outputs (vLLM, torch and its compilers, the accelerator's libraries, the tokenizer
# and math libraries): each counts, unless named in SCHEDULING_ENV (an unknown one counts, as an unknown flag does).
OUTPUT_ENV_PREFIXES = (
    "VLLM_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "CUDA_",
    "CUBLAS",
    "CUDNN_",
    "NVTE_",
    "NCCL_",
    "NVSHMEM_",
    "ROCM_",
    "HIP_",
    "HSA_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "SAFETENSORS_",
    "ATEN_",
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "ONEDNN_",
    "DNNL_",
)
# The rest of the allow-list, each with why it shapes no output: `tests/unit/test_identity.py` checks that every
# prefix of `eyrie.run.environment.PREFIXES` is in one of the two.
PROCESS_ENV_PREFIXES: dict[str, str] = {
    "NVIDIA_": "the container runtime's device selection (NVIDIA_VISIBLE_DEVICES), not what a device computes",
    "UCX_": "a fabric's transport settings: how bytes move between nodes",
    "FI_": "a fabric's transport settings: how bytes move between nodes",
    "GLOO_": "the CPU collective backend's transport",
    "HF_": "where the hub's files are cached and how they are fetched: the files enter by content",
    "HUGGINGFACE_": "where the hub's files are cached and how they are fetched: the files enter by content",
    "PYTHON": "the interpreter's switches (bytecode, buffering, paths)",
    "LD_": "the loader's search path",
    "LC_": "the locale",
    "XDG_": "where caches and configuration live",
    "SLURM_": "the job scheduler's description of the allocation",
    "COVERAGE_": "test coverage",
    "EYRIE_": "Eyrie's own switches: what reaches a server's outputs is in its spec (`server_env`)",
}


def output_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The inherited variables that shape what a server computes: the child allow-list's variables
    (`eyrie.run.environment.child_environment`, without a spec's own `server_env`) under `OUTPUT_ENV_PREFIXES`,
    less SCHEDULING_ENV. A variable such as VLLM_ATTENTION_BACKEND exported in the shell that starts the flow is
    in the keys of what the servers compute, as it is when given in `extraction.server_env`."""
    from eyrie.run.environment import child_environment

    env = child_environment(environ=environ)
    return {k: v for k, v in sorted(env.items()) if k.startswith(OUTPUT_ENV_PREFIXES) and k not in SCHEDULING_ENV}


def output_server_args(args: list[str], dropped: Collection[str] = SCHEDULING_FLAGS) -> list[str]:
    """`server_args` without the scheduling-only flags (or the `dropped` ones) and their values: what changes
    outputs."""
    out: list[str] = []
    skip_value = False
    for i, a in enumerate(args):
        if skip_value:
            skip_value = False
            continue
        flag = a.split("=", 1)[0]
        if flag in dropped:
            # `--flag value` takes the next item unless it is a flag itself (or the value came with `=`)
            nxt = args[i + 1] if i + 1 < len(args) else None
            skip_value = "=" not in a and nxt is not None and not nxt.startswith("-")
            continue
        out.append(a)
    return out


def output_server_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in SCHEDULING_ENV}


OUTPUT_PICKS: dict[str, Callable[[Any], Any]] = {
    "extraction.server_args": output_server_args,
    "extraction.server_env": output_server_env,
}

# ---------------------------------------------------------------------------------------------------------------
# Computing a key


def config_value(config, path: str) -> Any:
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [v.model_dump(mode="json") if hasattr(v, "model_dump") else v for v in value]
    return value


def key(stage: str, config, files: dict[str, Any], **upstream: Any) -> str:
    """The key of `stage`'s output, from exactly its declared inputs: the config's declared fields, the named
    `upstream` values and `files`, the identities of its declared files (all of them, no other:
    `eyrie.target.metadata.stage_key` computes them), and the declared versions."""
    decl = STAGES[stage] if stage in STAGES else VERDICTS[stage]
    if set(upstream) != set(decl.upstream):
        raise TypeError(f"the {stage} key is made of {sorted(decl.upstream)}, got {sorted(upstream)}")
    if set(files) != set(decl.files):
        raise TypeError(f"the {stage} key reads the files {sorted(decl.files)}, got {sorted(files)}")
    body: dict[str, Any] = {"stage": stage, "format": FORMAT_VERSION, "upstream": upstream, "files": files}
    if not decl.from_spec:
        body["config"] = {p: OUTPUT_PICKS.get(p, lambda v: v)(config_value(config, p)) for p in decl.config}
    if decl.sections:
        body["sections"] = {s: config_value(config, s) for s in decl.sections}
    body["versions"] = {d: installed_version(d) for d in decl.versions}
    if decl.environment:
        body["environment"] = output_environment()
    return sha256_json(body)[:16]


def installed_version(dist: str) -> str | None:
    if dist == "vllm":  # the vLLM that runs the servers: $EYRIE_VLLM_PYTHON's environment's (eyrie.run.vllm_python)
        from eyrie.run.vllm_python import vllm_version

        return vllm_version()
    names = (dist,)
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


# ---------------------------------------------------------------------------------------------------------------
# File identities: every file by its whole content, each version of it read once

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
MODEL_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
DOC_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf")
DOC_STEMS = ("readme", "license", "licence", "notice", "use_policy", "copying")
# Python files of a model folder that are tokenizer or processor code by transformers' naming (the modules an
# auto_map names count whatever their name, `tokenizer_modules`).
TOKENIZER_CODE_PREFIXES = (
    "tokenization_",
    "processing_",
    "image_processing_",
    "video_processing_",
    "feature_extraction_",
)
MODEL_CODE_PREFIXES = ("modeling_", "configuration_")

# Where whole-file digests are kept between processes: one small JSON file per file version, named by the file's
# (device, inode, size, mtime, ctime). Under the user's cache home, not a run folder: identities are computed where
# no run folder is known (a server's fingerprint, preflight), and a target shared by many runs is read once for all
# of them. $EYRIE_DIGEST_STORE names another folder; set empty, nothing is kept (each process hashes again).
DIGEST_STORE_ENV = "EYRIE_DIGEST_STORE"
STORE_MIN_BYTES = 16 << 20  # smaller files are hashed again by each process (milliseconds), and not kept
HASH_BUFFER = 16 << 20

_CACHE: dict[tuple, str] = {}


def _version(st: os.stat_result) -> tuple:
    """One version of a file: a rewrite in place changes mtime and ctime (ctime even under a restored mtime), a
    replacement the inode."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def digest_store() -> Path | None:
    value = os.environ.get(DIGEST_STORE_ENV)
    if value is not None:
        return Path(value).expanduser() if value else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "eyrie" / "digests"


def hash_algorithm() -> str:
    """blake3 when installed (vLLM requires it; several times sha256's speed, on several threads), else sha256.
    The name is part of every digest, so two environments never take each other's digests for their own."""
    try:
        import blake3  # noqa: F401
    except ImportError:
        return "sha256"
    return "blake3"


def _hash_whole(path: Path, algorithm: str) -> str:
    if algorithm == "blake3":
        import blake3

        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        if path.stat().st_size:
            h.update_mmap(str(path))
        return h.hexdigest()
    sha = hashlib.sha256()
    buf = bytearray(HASH_BUFFER)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            sha.update(view[:n])
    return sha.hexdigest()


def _entry(store: Path, version: tuple, algorithm: str) -> Path:
    name = sha256_json([algorithm, *version])[:40]
    return store / name[:2] / f"{name}.json"


def file_digest(path: Path) -> str:
    """`path`'s identity: a hash of its whole content (`hash_algorithm`), so that any changed byte (a few rows of
    an embedding) changes it. Computed once per file version (`_version`): kept in this process, and for files of
    STORE_MIN_BYTES or more in the digest store (`digest_store`), so a checkpoint of hundreds of GB is read once per
    version, not once per run or per process. A file that changed while it was read is hashed, not kept."""
    st = path.stat()
    algorithm = hash_algorithm()
    version = _version(st)
    memo = (algorithm, *version)
    if memo in _CACHE:
        return _CACHE[memo]
    store = digest_store() if st.st_size >= STORE_MIN_BYTES else None
    entry = _entry(store, version, algorithm) if store is not None else None
    if entry is not None:
        kept = read_json(entry)
        if isinstance(kept, dict) and kept.get("version") == list(version) and isinstance(kept.get("digest"), str):
            _CACHE[memo] = kept["digest"]
            return kept["digest"]
    digest = f"{algorithm}:{_hash_whole(path, algorithm)[:32]}"
    if _version(path.stat()) != version:
        return digest  # written to while read: not this version's digest, and not kept
    _CACHE[memo] = digest
    if entry is not None:
        try:
            atomic_write_json(entry, {"version": list(version), "digest": digest, "path": str(path.resolve())})
        except OSError:
            pass  # a read-only cache home: hashed again by the next process
    return digest


def _module(rel: Path) -> str | None:
    """The importable name of a Python file at the top of a model folder (where transformers loads remote code
    from), else None."""
    return rel.stem if rel.suffix == ".py" and len(rel.parts) == 1 else None


def _local_imports(source: Path, modules: Collection[str]) -> set[str]:
    """The folder's own modules that `source` imports (`from .x import`, `import x`, `from x import`)."""
    import ast

    try:
        tree = ast.parse(source.read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return set()
    found: set[str] = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
        elif isinstance(node, ast.ImportFrom):  # `from . import x`
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        found.update(n for n in names if n in modules)
    return found


def _closure(folder: Path, roots: set[str], modules: Collection[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m in seen or m not in modules:
            continue
        seen.add(m)
        todo.extend(_local_imports(folder / f"{m}.py", modules))
    return seen


TOKENIZER_AUTO_CLASSES = ("AutoTokenizer", "AutoProcessor", "AutoImageProcessor", "AutoFeatureExtractor", "AutoVideo")


def _auto_map_modules(config: Path) -> tuple[set[str], set[str]]:
    """The modules a config's `auto_map` names (`"AutoTokenizer": ["tokenization_x.XTokenizer", null]`,
    `"AutoModel": "modeling_x.XModel"`, or with a repo prefix `org/repo--modeling_x.XModel`): those of the tokenizer
    and processor classes, and the others (the model's)."""
    raw = read_json(config)
    auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
    tokenizer: set[str] = set()
    model: set[str] = set()
    for auto, value in auto_map.items() if isinstance(auto_map, dict) else ():
        for ref in value if isinstance(value, list) else [value]:
            if isinstance(ref, str) and "." in ref:
                (tokenizer if auto.startswith(TOKENIZER_AUTO_CLASSES) else model).add(ref.split("--")[-1].split(".")[0])
    return tokenizer, model


def code_kinds(folder: Path, files: Collection[Path]) -> dict[str, frozenset[str]]:
    """Which identity each of the folder's own Python modules belongs to: `tokenizer` for the tokenizer's and
    processor's code (the modules an auto_map names for a tokenizer or processor class, or named as transformers
    names such code, and the folder's modules they import), `target` for the rest (the model's code and whatever
    else, counted as the model's: a wrong guess costs a recompute); a module both import belongs to both."""
    modules = {m: rel for rel in files if (m := _module(rel))}
    tokenizer_roots = {m for m in modules if m.startswith(TOKENIZER_CODE_PREFIXES)}
    model_roots = {m for m in modules if m.startswith(MODEL_CODE_PREFIXES)}
    for rel in files:
        if rel.suffix == ".json" and len(rel.parts) == 1 and _file_kind(rel) is not None:
            tok, mod = _auto_map_modules(folder / rel)
            tokenizer_roots |= tok
            model_roots |= mod
    tokenizer = _closure(folder, tokenizer_roots, modules)
    model = _closure(folder, model_roots - tokenizer_roots, modules)
    return {
        m: frozenset({"tokenizer"} if m in tokenizer else set())
        | frozenset({"target"} if m not in tokenizer or m in model else set())
        for m in modules
    }


def _file_kind(rel: Path) -> str | None:
    name = rel.name.lower()
    if any(p.startswith(".") or p == "__pycache__" for p in rel.parts) or name.endswith((".pyc", ".pyo")):
        return None  # hidden files, and bytecode Python compiled from the folder's own code (counted as source)
    if name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json") or name == MODEL_CONFIG or name.endswith(".py"):
        return "target"  # the weights, the model's config, its own code (`code_kinds` sorts the code)
    if name == GENERATION_CONFIG:
        return "generation_config"
    if name.endswith(DOC_SUFFIXES) or name.split(".")[0] in DOC_STEMS:
        return None
    return "tokenizer"  # tokenizer and processor files: tokenizer_config.json (and the chat template in it),
    # chat_template.jinja/.json, vocabularies, merges, special tokens, preprocessor configs


def classify(rel: Path, code: dict[str, frozenset[str]] | None = None) -> frozenset[str]:
    """Which identities a file of a model folder belongs to (`FILE_KINDS`: target, tokenizer, generation_config;
    none for documentation, hidden files and bytecode). `code`: `code_kinds` of the folder, for its Python files
    (without it, Python counts as the target's)."""
    kind = _file_kind(rel)
    if kind is None:
        return frozenset()
    module = _module(rel)
    if module is not None and code is not None and module in code:
        return code[module]
    return frozenset({kind})


_CODE_KINDS: dict[tuple, dict[str, frozenset[str]]] = {}


def _code_kinds_cached(folder: Path, files: list[Path]) -> dict[str, frozenset[str]]:
    """`code_kinds`, kept in this process while the folder's Python and JSON files are the same versions (a run
    computes hundreds of keys)."""
    read = tuple(
        (rel.as_posix(), _version((folder / rel).stat()))
        for rel in files
        if len(rel.parts) == 1 and rel.suffix in (".py", ".json")
    )
    memo = (str(folder.resolve()), read)
    if memo not in _CODE_KINDS:
        _CODE_KINDS[memo] = code_kinds(folder, files)
    return _CODE_KINDS[memo]


def folder_identity(folder: Path, kind: str) -> list:
    """The identity of one kind of a local model folder's files (`FILE_KINDS`): each file's relative path and
    whole-content digest."""
    files = [p.relative_to(folder) for p in sorted(folder.rglob("*")) if p.is_file()]
    code = _code_kinds_cached(folder, files)
    return [(rel.as_posix(), file_digest(folder / rel)) for rel in files if kind in classify(rel, code)]


def drafter_identity(drafter: str | Path | None) -> list | None:
    """A drafter folder's weights and config, each by its whole content; None for no drafter."""
    if drafter is None:
        return None
    folder = Path(drafter)
    return [
        (p.relative_to(folder).as_posix(), file_digest(p))
        for p in sorted(folder.rglob("*"))
        if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == MODEL_CONFIG)
    ]
