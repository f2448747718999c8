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
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from eyrie import FORMAT_VERSION
from eyrie.run.files import sha256_file, sha256_json

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


FILE_KINDS = {
    "target": "the target's weights (each file's header, size and sampled data), config.json and its own Python "
    "code; a hub target: the commit its revision is pinned to",
    "tokenizer": "the target's tokenizer and processor files (every file of the folder that is no weight, no model "
    "or generation config and no documentation); a hub target: its pinned commit",
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
        files=("target", "drafter"),
        versions=("vllm",),
        from_spec=True,
        outputs_only=True,
    ),
    # Servers: whether a running one may be reused (eyrie.vllm.process.VllmServer.ensure): started alike.
    "server.extraction": Inputs(
        config=(*_SERVER_COMMON, "extraction.hidden_states_dtype"),
        upstream=("spec",),
        files=("target",),
        versions=("vllm",),
        from_spec=True,
        outputs_only=False,
    ),
    "server.serving": Inputs(
        config=(*_SERVER_COMMON, "evaluate.num_speculative_tokens"),
        upstream=("spec",),
        files=("target", "drafter"),
        versions=("vllm",),
        from_spec=True,
        outputs_only=False,
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
    "regenerate.enabled": "which data extraction reads: enters through the upstream data keys",
    "regenerate.concurrency": "requests in flight: scheduling",
    "regenerate.request_timeout_s": "how long to wait for an answer",
    "regenerate.retries": "how often a failed request is retried; a row lost to errors is not written as done",
    "train.save_every_steps": "checkpoint frequency: a resume point, not the weights",
    "train.devices": "GPUs: a change resumes from the newest checkpoint (approximate: the data is dealt to ranks "
    "anew; the trainer warns)",
    "train.device": "where to train: a change resumes (the trainer warns)",
    "train.log_every_steps": "logging",
    "train.still_improving_warning": "a warning's threshold, recomputed from the saved validation history",
    "train.hidden_states": "where the same hidden states are read from (files, or the server online)",
    "evaluate.max_train_serve_gap": "the report's flag threshold",
    "evaluate.untrained_baseline": "which drafters are measured, not what one measurement is",
    "evaluate.prompt_sets": "its prompts enter the evaluate key by content, as `prompts` "
    "(eyrie.stages.evaluate.evaluate_key's `sets`)",
    "promotion.dir": "where drafters are promoted: the current drafter enters by its content (`drafter`)",
    "promotion.warm_start": "whether a base is used: enters through the base's content (`drafter`)",
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
        "VLLM_ENGINE_ITERATION_TIMEOUT_S",
        "VLLM_RPC_TIMEOUT",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_CACHE_ROOT",
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
    }
)


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
    return sha256_json(body)[:16]


def installed_version(dist: str) -> str | None:
    names = {"vllm": ("vllm", "vllm-cpu")}.get(dist, (dist,))
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


# ---------------------------------------------------------------------------------------------------------------
# File identities

SAMPLES_PER_FILE = 16  # evenly spaced 64 KiB reads of each weight file's data
SAMPLE_BYTES = 1 << 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
MODEL_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
DOC_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf")
DOC_STEMS = ("readme", "license", "licence", "notice", "use_policy", "copying")

_CACHE: dict[tuple, str] = {}


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


def sampled_fingerprint(path: Path) -> str:
    """A weight file's identity without reading it all: a safetensors file's header (every tensor's name, dtype,
    shape and offset), its size, and 16 evenly spaced 64 KiB samples of its data (1 MiB per file, so a fine-tune of
    the same architecture, which changes nearly every weight, gets a new identity; hashing terabytes would take
    hours). Cached per process by the file's stat."""
    sk = ("weights", *_stat_key(path))
    if sk in _CACHE:
        return _CACHE[sk]
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = 0
        if path.suffix == ".safetensors":
            head = f.read(8)
            (header_len,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            header_len = min(header_len, max(size - 8, 0))
            h.update(head + f.read(header_len))
            start = 8 + header_len
        h.update(str(size).encode())
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES_PER_FILE):
            f.seek(start + span * i // max(SAMPLES_PER_FILE - 1, 1))
            h.update(f.read(SAMPLE_BYTES))
    _CACHE[sk] = h.hexdigest()[:16]
    return _CACHE[sk]


def _whole(path: Path) -> str:
    sk = ("file", *_stat_key(path))
    if sk not in _CACHE:
        _CACHE[sk] = sha256_file(path)
    return _CACHE[sk]


def classify(rel: Path) -> str | None:
    """Which identity a file of a model folder belongs to: target, generation_config, tokenizer, or None
    (documentation, hidden files, bytecode)."""
    name = rel.name.lower()
    if any(p.startswith(".") or p == "__pycache__" for p in rel.parts) or name.endswith((".pyc", ".pyo")):
        return None  # hidden files, and bytecode Python compiled from the folder's own code (counted as source)
    if name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json") or name == MODEL_CONFIG or name.endswith(".py"):
        return "target"  # the weights, the model's config, its own code
    if name == GENERATION_CONFIG:
        return "generation_config"
    if name.endswith(DOC_SUFFIXES) or name.split(".")[0] in DOC_STEMS:
        return None
    return "tokenizer"


def folder_identity(folder: Path, kind: str) -> list:
    out = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(folder)
        if classify(rel) != kind:
            continue
        heavy = p.name.lower().endswith(WEIGHT_SUFFIXES)
        out.append((rel.as_posix(), sampled_fingerprint(p) if heavy else _whole(p)))
    return out


def drafter_identity(drafter: str | Path | None) -> list | None:
    """A drafter folder's weights (sampled) and config (whole); None for no drafter."""
    if drafter is None:
        return None
    folder = Path(drafter)
    return [
        (p.relative_to(folder).as_posix(), sampled_fingerprint(p) if p.suffix in WEIGHT_SUFFIXES else _whole(p))
        for p in sorted(folder.rglob("*"))
        if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == MODEL_CONFIG)
    ]
