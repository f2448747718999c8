"""One typed PipelineConfig for every stage, loaded from YAML. Unknown keys and wrong types are errors that
name the key; cross-field rules live here too, so a bad config fails before anything runs."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from pathlib import Path
from typing import Literal

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from eyrie.errors import ConfigError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost); 0.0.0.0
    and :: are every interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, it is not known to be loopback


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(_Section):
    model: str = Field(description="Local folder or Hugging Face hub id of the target model.")
    revision: str | None = Field(None, description="Hub revision (commit, tag or branch) of the target.")
    trust_remote_code: bool = Field(
        False, description="Run the target's own Python code (tokenizer, config). Off unless this target needs it."
    )
    tiny: (
        Literal[
            "tiny-llama",
            "tiny-llama-chat",
            "tiny-deepseek-v3",
            "tiny-kimi-k25",
            "tiny-gpt2",
            "tiny-opt",
            "tiny-qwen2",
            "tiny-qwen3",
            "tiny-qwen3-moe",
            "tiny-mistral",
            "tiny-gemma2",
            "tiny-phi3",
            "tiny-gpt-neox",
            "tiny-falcon",
            "tiny-stablelm",
        ]
        | None
    ) = Field(
        None,
        description="Build this tiny project-made target at `model` if the folder is missing: only where the demo "
        "keeps it (.cache/targets/<tiny>) or with EYRIE_BUILD_TINY=1, never at a mistyped path of a copied config.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism for extraction and evaluation.")
    dtype: Literal["bfloat16", "float16", "auto"] = Field(
        "bfloat16", description="vLLM's --dtype for the target (hidden states are stored in it)."
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="vLLM max_model_len; at least data.max_length + 1 (extraction generates one token "
        "after the longest sample). Defaults to data.max_length + 1.",
    )
    vllm_version: str | None = Field(
        None,
        description="PEP 440 version specifier the installed vLLM must meet for this target (e.g. '>=0.18'); "
        "preflight refuses another version, naming the installed one.",
    )
    recurrent_layers: Literal["refuse", "prove"] = Field(
        "refuse",
        description="A target whose layers carry recurrent state (state-space, short-convolution or "
        "gated-linear-attention layers): refuse: preflight refuses it before any load (vLLM's capture of such "
        "layers is not proven right); prove: load it and let the capture proof decide before the first shard.",
    )

    @field_validator("vllm_version")
    @classmethod
    def _specifier(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                SpecifierSet(v)
            except InvalidSpecifier:
                raise ValueError(
                    f"{v!r} is not a version specifier: write one like '>=0.18' or '>=0.18,<0.40'"
                ) from None
        return v


class DataConfig(_Section):
    source: str = Field(description="Hub dataset id, or a local .jsonl/.json/.parquet file or folder of them.")
    split: str = Field("train", description="Dataset split to read.")
    subset: str | None = Field(None, description="Hub dataset configuration name.")
    revision: str | None = Field(
        None,
        description="Hub dataset revision (commit, tag or branch; default: main). "
        "A run pins it to the commit it resolves to at the start, and "
        "keys prepare on that commit.",
    )
    max_length: int = Field(2048, ge=8, description="Samples are truncated to this many tokens.")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many training conversations.")
    shard_size: int = Field(256, ge=1, description="Samples per extraction shard (the unit of retry and resume).")
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of conversations held out for evaluation.")


class StartupConfig(_Section):
    """The vLLM start-up levers (`eyrie.vllm.levers`): what shortens a server's start without changing what it
    computes for text. Each applies only where the installed vLLM has it (else preflight names it unavailable and
    nothing is passed); preflight records, per server, each lever applied and each refused with the reason
    (docs/operations/start-up.md)."""

    language_model_only: bool = Field(
        True,
        description="For a multimodal wrapper (config.json with a `text_config` and a vision or audio config), "
        "start the servers with vLLM's --language-model-only: its vision tower is never built (Eyrie sends text "
        "only). Part of the servers' identity where it applies.",
    )
    startup_plan: bool = Field(
        True,
        description="VLLM_ENABLE_STARTUP_PLAN=1: vLLM keeps its memory-profiling result under VLLM_CACHE_ROOT and a "
        "second start of the same server on the same node skips the profiling. Start-up only.",
    )
    compile_cache: bool = Field(
        True,
        description="Pin VLLM_CACHE_ROOT for the servers to the node's persistent vLLM cache (the environment's "
        "VLLM_CACHE_ROOT, else vLLM's default under XDG_CACHE_HOME), never a temporary folder: the compile "
        "cache, its AOT artifacts and the start-up plan survive a restart. Start-up only.",
    )
    weight_cache: bool = Field(
        False,
        description="Start the servers with --load-format ipc_cache: the weights are mapped from a `vllm preload` "
        "daemon the node runs (started by the operator, same model and parallelism). Refused before any load "
        "where it cannot work: a vLLM without it, its CPU build, a quantization method that does not support "
        "pre-processed weights (compressed-tensors INT4 MoE: Kimi-K2.5).",
    )
    snapshot: bool = Field(
        False,
        description="Restore the servers from a `vllm snapshot`. Refused before any load with the reason: vLLM "
        "snapshots one tensor-parallel rank without speculative decoding, and every server Eyrie starts for "
        "extraction, export or evaluation drafts or captures through speculative decoding.",
    )


class ExtractionConfig(_Section):
    layer_ids: list[int] | None = Field(
        None,
        description="Aux layer ids in vLLM's convention (id k = input of layer k). Default: 2, L//2, L-3. "
        "The last layer's output (id L) is always captured too.",
    )
    host: str = Field("127.0.0.1", description="Interface the extraction server listens on.")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port.")
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the server's API "
        "key. Required when host is not loopback.",
    )
    concurrency: int = Field(8, ge=1, description="Requests in flight per shard.")
    startup_timeout_s: float = Field(
        1800, gt=0, description="How long a vLLM server may take to load the target before it counts as failed."
    )
    request_timeout_s: float = Field(600, gt=0, description="How long one request to vLLM may take.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vLLM's --gpu-memory-utilization (default: vLLM's own)."
    )
    enforce_eager: bool = Field(
        True, description="vLLM's --enforce-eager: no CUDA graphs (faster start-up; off for long GPU extractions)."
    )
    server_args: list[str] = Field(
        default_factory=list,
        description="Extra vLLM server arguments, for extraction and for the export and evaluation servers; "
        "preflight parses them with the installed vLLM's own parser, and refuses a flag Eyrie passes itself.",
    )
    server_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for the vLLM server processes (extraction, export, evaluation), over "
        "Eyrie's own environment; part of the server's identity, so a change starts a new server. Preflight "
        "refuses a VLLM_* name the installed vLLM does not know, or a value it cannot read.",
    )
    hidden_states_dtype: Literal["bfloat16", "float8_e4m3fn"] = Field(
        "bfloat16",
        description="How hidden-state files are stored. bfloat16: as the server computes them (the target's dtype). "
        "float8_e4m3fn: speculators' own fp8 format (its `fp8` hidden-states backend: fp8 values plus one float32 "
        "scale per token), about half the bytes per token, dequantized to bfloat16 as the trainer reads them. "
        "Part of the extraction key and of the server's identity: a change extracts again.",
    )
    storage: Literal["files", "packed"] = Field(
        "files",
        description="How hidden states are laid out. files: one safetensors file per sample (`hs_<i>.safetensors`, "
        "speculators' own layout). packed: each shard's samples in one safetensors file "
        "(`packs/<start>_<stop>.safetensors`), for runs of millions of samples, whose files would strain a "
        "directory, a shared filesystem's metadata server and every clean-up; Eyrie's trainer reads both. Part of "
        "the extraction key: a change repacks (files to packed) or extracts again (packed to files).",
    )
    min_free_disk_gib: float = Field(1.0, ge=0, description="Head-room kept free after the estimated output.")
    verify_checksums: bool = Field(
        True,
        description="Re-hash a hidden-state file whose stat (size, mtime, inode) changed since its manifest "
        "recorded it, so a file changed after its shard completed is redone, never trained on. Unchanged files "
        "are trusted by stat and never read; false trusts a changed file of the recorded size. `eyrie verify` "
        "re-hashes every file.",
    )
    keep_server_after_failure: bool = Field(
        True,
        description="Leave the server up when a shard fails, so a retry "
        "reuses the loaded target (`eyrie stop-server`).",
    )
    unproven_aux_layers: Literal["refuse", "warn"] = Field(
        "refuse",
        description="Aux layer ids the capture proof cannot recompute from the target's weights (a quantized "
        "checkpoint, or more layers before the id than the proof rebuilds: ids past the first few layers of an "
        "8B+ target): refuse: preflight refuses the run, naming them, before any load; warn: the proof checks "
        "the ids it can and the last layer through the head, and records the others as unproven in "
        "capture/proof.json and the run's warnings.",
    )

    startup: StartupConfig = Field(
        default_factory=StartupConfig,
        description="The vLLM start-up levers applied to every server (extraction, export, evaluation).",
    )

    @field_validator("server_env", mode="before")
    @classmethod
    def _env(cls, v):
        if not isinstance(v, dict):
            return v  # pydantic names the wrong type
        out = {}
        for name, value in v.items():
            if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, digits, '_')")
            if name == "VLLM_API_KEY":
                raise ValueError(
                    "VLLM_API_KEY must not be written in the config: set extraction.api_key_env to the name of "
                    "a variable that holds the key"
                )
            # YAML reads `1800` as a number: an environment holds its text. A bool has no single spelling.
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError(f'{name}: {value!r} is not a string or number: quote it (e.g. "1" or "true")')
            out[name] = str(value)
        return out


class TemperatureShare(_Section):
    temperature: float = Field(ge=0, le=2, description="A sampling temperature (0: greedy).")
    weight: float = Field(gt=0, description="Its share of the conversations (weights need not sum to 1).")


class TemplateShare(_Section):
    variant: str = Field(
        min_length=1,
        description="The name of an `evaluate.template_variants` entry, or `default` (the template's own rendering).",
    )
    weight: float = Field(gt=0, description="Its share of the conversations (weights need not sum to 1).")


class RegenerateConfig(_Section):
    """The target rewrites every assistant turn before extraction (on-policy data), on the extraction server."""

    enabled: bool = Field(
        False,
        description="Regenerate the prepared conversations' assistant turns with the target before extraction; "
        "extraction, vocab and training then read the regenerated data.",
    )
    temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature of every answer (0: greedy).")
    temperature_mix: list[TemperatureShare] | None = Field(
        None,
        min_length=1,
        description="A per-conversation temperature mix instead of `temperature`: each conversation is answered "
        "at one of these temperatures, drawn by weight from a hash of `seed` and the conversation.",
    )
    template_mix: list[TemplateShare] | None = Field(
        None,
        min_length=1,
        description="A per-conversation mix of chat-template variants: each conversation is rendered with one "
        "variant's `chat_template_kwargs` (as evaluation sends them), drawn by weight from a hash of `seed` and the "
        "conversation; each row records its variant. Unset: the template's default rendering.",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (1: off), at temperatures above 0.")
    seed: int = Field(
        0,
        description="Seeds the temperature and template draws and each request's sampling, so a re-run samples "
        "the same way.",
    )
    max_tokens: int = Field(
        2048,
        ge=1,
        description="Most tokens per answer. An answer that reaches it is length-capped: the row ends with it, "
        "and `length_capped` says whether such rows are kept.",
    )
    length_capped: Literal["keep", "drop"] = Field(
        "keep",
        description="keep: train on rows whose last answer hit max_tokens (every token is still the target's own); "
        "drop: leave them out. Counted either way in regenerate/stats.json.",
    )
    concurrency: int = Field(
        16,
        ge=1,
        description="Requests in flight per running shard (each conversation sends its turns one after another). "
        "The shards regenerating from one server at once share their slots: each adds this many while it runs, and "
        "slots one leaves idle (its last conversations, its rows being written) serve the others' conversations, the "
        "earlier shard's first. The server runs at most its --max-num-seqs at once.",
    )
    request_timeout_s: float = Field(1800, gt=0, description="Seconds one answer may take.")
    retries: int = Field(
        2, ge=0, description="Retries of a request that got no answer or a server error (5xx), 2, 4, 8 s apart."
    )


class VocabConfig(_Section):
    draft_vocab_size: int = Field(32000, ge=1, description="Capped at the target's vocabulary size.")


class TrainSpeedConfig(_Section):
    """How the trainer runs on GPUs: each choice trades start-up time against time per step, or costs nothing and
    saves time. None changes what is learned beyond rounding; none applies on CPU. Figures: one H200 at Kimi-K2.5
    width (docs/stages/train.md, Start-up and Speed)."""

    gpu_feed: bool = Field(
        True,
        description="Batches copied to the GPU ahead of their step, on a stream of their own (~4.3 ms a step of "
        "PCIe copy otherwise spent with the GPU idle). No start-up cost.",
    )
    feed_ahead: int = Field(
        2, ge=1, description="With gpu_feed: batches on the GPU, or being copied there, ahead of the step."
    )
    pinned_loader: bool = Field(True, description="With gpu_feed: the loaders pin batches before they are copied.")
    fp8_on_gpu: bool = Field(
        True, description="With gpu_feed: fp8 hidden-state files reach the GPU as fp8 and are decoded there."
    )
    quiet_progress: bool = Field(
        True, description="No progress bar in the trainer (its refresh thread competes with the step's launches)."
    )
    build_on_gpu: bool = Field(
        True,
        description="A fresh drafter is built on its GPU: saves ~16 s of each launch's start (its weights "
        "initialised on the CPU, then moved). No per-step cost.",
    )
    forkserver_workers: bool = Field(
        True,
        description="Loader workers forked from a server started first thing: the first batch 2-3 s after the "
        "loaders are built instead of 18-20 s. No per-step cost.",
    )
    sync_free_metrics: bool = Field(
        True,
        description="Accuracy counts and loss scalars made without synchronising the GPU: ~25.4k to ~31.5k "
        "tokens/s. No start-up cost.",
    )
    clip_in_adamw: bool = Field(
        True, description="The gradient clip applied by fused AdamW as it reads the gradients (one pass less)."
    )
    bf16_weights: bool = Field(
        True,
        description="One process: forward and backward on bfloat16 copies of the float32 weights, made once a step "
        "(~10 ms of a 130 ms step). Not under DDP.",
    )
    deferred_mask_compile: bool = Field(
        True,
        description="Start-up: the block mask is built eagerly from the documents' block layout, so the first step "
        "does not compile speculators' mask builder (13-16 s measured on an H200 from a cold compile cache; 0.8-4.6 s "
        "on a 2-core CPU). Its per-step cost is host time, 2.2-2.3 ms a step on an H200's host against 0.16 ms "
        "compiled, which the GPU's own step (~120 ms) hides: tokens/s on and off within noise (33,552 / 33,331).",
    )
    one_kv_length: bool | Literal["auto"] = Field(
        "auto",
        description="Start-up: every TTT step's attention at one padded key length, one compile for all: ~20 s off "
        "the first step from a cold compile cache, for 2.5-3% of tokens/s for the whole run. auto: on only when "
        "the run's expected training time (below) is shorter than what it saves pays back (~12 min).",
    )
    eager_rotary: bool = Field(
        True,
        description="Start-up: the rotary tables made eagerly, no frame compiled for them: 3.0-4.9 s off a cold "
        "first step, no measured per-step cost.",
    )
    one_pointwise_config: bool | Literal["auto"] = Field(
        "auto",
        description="Start-up: Inductor compiles one launch config per pointwise kernel instead of autotuning "
        "2-6: ~7 s off a cold first step, for ~0.5% of tokens/s. auto: on only for a run expected to train "
        "less than ~23 min. With the others on, the four start-up choices together: first step 46 s against 84 s "
        "off, at 0.947 against 0.965 of the bare step (1.8%).",
    )
    warm_compile_workers: bool = Field(
        False,
        description="Start-up: Inductor's compile workers started before the heavy imports; no gain measured.",
    )
    assumed_tokens_per_s: float = Field(
        32000,
        gt=0,
        description="For the auto choices: the training rate (tokens/s per GPU) assumed until this drafter's "
        "trainer has measured its own (a resume uses the measured one). Expected training time: the steps left x "
        "train.max_seq_len / this rate.",
    )


class TrainConfig(_Section):
    epochs: int = Field(3, ge=1, description="Epochs to train (the most, with stop_on_plateau).")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    ttt_steps: int = Field(3, ge=1, description="Training-time-test unroll steps.")
    max_seq_len: int = Field(2048, ge=8, description="Tokens per packed training sequence.")
    save_every_steps: int = Field(0, ge=0, description="Also checkpoint every N steps (0: each epoch only).")
    devices: int = Field(1, ge=1, description="GPUs for torchrun; 1 on CPU.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train; auto: cuda when present.")
    num_layers: int = Field(1, ge=1, description="Decoder layers in the drafter.")
    val_fraction: float = Field(0.1, gt=0, lt=1, description="Share of prepared samples speculators validates on.")
    mask_token_id: int | None = Field(
        None,
        description="The trainer's mask token id. Default: resolved from the "
        "target's tokenizer at preflight, as speculators would.",
    )
    seed: int = Field(0, description="Seed of the drafter's initialisation and the data order.")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="speculators' optimizer: adamw (fused on GPUs), or muon (speculators' own default). adamw won the "
        "A/B in the README: higher validation accuracy at every epoch on the demo, and at Kimi-K2.5 dimensions "
        "Muon's optimizer step (~175 ms) doubles the step time.",
    )
    target_transform: bool = Field(
        True,
        description="Make the drafter's training labels with the target's own transform where speculators' "
        "approximate it (the target's own final norm, a head bias, logit scaling or soft-capping: "
        "docs/design/labels.md); preflight names each as applied. false: speculators' labels (an RMSNorm with the "
        "final-norm weight and a head without bias), as before.",
    )
    log_every_steps: int = Field(
        50,
        ge=1,
        description="Log (and time) a training step every N steps. Logged steps synchronise the GPU; "
        "the others do not.",
    )
    loggers: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = Field(
        [],
        description="speculators' own metric loggers, passed through to its trainer (its --logger): tensorboard "
        "(event files under `<run>/train/<key>/logs/`), wandb, trackio (its files under that folder's `trackio/` "
        "unless TRACKIO_DIR is set), mlflow (a store in that folder's `mlruns/` unless MLFLOW_TRACKING_URI is set). "
        "Each needs its package installed; the variables that configure it (WANDB_*, MLFLOW_*, TRACKIO_*, "
        "TENSORBOARD_*) reach the trainer. Empty: none (the Prefect UI and `eyrie status` show the metrics anyway).",
    )
    stop_on_plateau: bool = Field(
        False,
        description="Stop once validation stops improving: after plateau_patience epochs without raising the "
        "predicted acceptance length (1 + the sum of per-position validation accuracies) by plateau_min_delta. "
        "train.epochs is then the most epochs it may run.",
    )
    plateau_patience: int = Field(2, ge=1, description="Epochs without improvement before a plateau stop.")
    plateau_min_delta: float = Field(
        0.01, ge=0, description="The smallest rise of the predicted acceptance length that counts as improvement."
    )
    still_improving_warning: float = Field(
        0.02,
        ge=0,
        description="Warn in the run summary when the last epoch still raised the predicted acceptance length "
        "by more than this: the drafter is likely undertrained.",
    )
    hidden_states: Literal["offline", "online"] = Field(
        "offline",
        description="Where the trainer gets hidden states. offline: the extract stage writes one file per sample "
        "under the run folder and training reads them (re-read every epoch, reused by later runs). online: no "
        "extract stage; the extraction server stays up during training and speculators' on-missing `generate` "
        "path asks it for each sample as it is needed, through transient files on tmpfs (/dev/shm, or "
        "$EYRIE_ONLINE_TMPFS) deleted once read, so nothing is kept on disk, at the price of one target forward "
        "pass per sample per epoch. The server and the trainer must share that tmpfs (one machine). Resumes "
        "like offline: from speculators' newest whole checkpoint, in the same data order.",
    )
    speed: TrainSpeedConfig = Field(
        default_factory=TrainSpeedConfig,
        description="GPU speed choices: each one's start-up saving and per-step cost (below); the trainer gets them "
        "in its run folder's trainer-options.json.",
    )


class PromptSetConfig(_Section):
    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="The set's name in the report."
    )
    path: str = Field(
        description="A prompt file: JSON lines (or a JSON list) whose rows hold MT-Bench-style `turns` (the first "
        "turn is sent) or `messages` (cut before the first assistant turn). A relative path is from the working "
        "folder."
    )
    category_field: str = Field("category", description="The row field that names a prompt's category, if any.")
    limit: PositiveInt | None = Field(None, description="At most this many prompts. Unset: evaluate.num_prompts.")


class TemplateVariantConfig(_Section):
    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="The variant's name in the report."
    )
    chat_template_kwargs: dict[str, bool | int | float | str | None] = Field(
        min_length=1,
        description="The chat template's switches for this variant, as production sends them in each request "
        "(vLLM's `chat_template_kwargs`), e.g. {enable_thinking: true}.",
    )


class EvaluateConfig(_Section):
    num_speculative_tokens: int = Field(3, ge=1, description="Draft tokens per step when serving the drafter.")
    num_prompts: int = Field(32, ge=1, description="Held-out prompts to measure acceptance on.")
    max_tokens: int = Field(64, ge=1, description="Tokens generated per evaluation prompt.")
    sweep_draft_tokens: int | None = Field(
        None,
        ge=2,
        le=10,
        description="Also answer 'how many draft tokens?': serve the trained drafter drafting this many (one "
        "more target load) for the acceptance length at every k up to it, and the target alone (one more) for "
        "output tokens per second with and without the drafter; a table and a plot. Unset: off.",
    )
    throughput_concurrency: list[PositiveInt] = Field(
        [1, 8],
        min_length=1,
        description="Concurrencies at which the draft-token sweep measures output tokens per second.",
    )
    max_train_serve_gap: float = Field(
        0.15,
        gt=0,
        le=1,
        description="Flag the run when, at any draft position, the trained drafter's validation accuracy and the "
        "acceptance measured in vLLM differ by more than this plus twice the measurement's standard error.",
    )
    untrained_baseline: Literal["auto", "always", "never"] = Field(
        "auto",
        description="always: also serve and measure an untrained drafter of the same shape (one more target "
        "load). auto, never: not served; the report compares with the floor it measures, 1.0 (no draft accepted).",
    )
    prompt_sets: list[PromptSetConfig] = Field(
        [],
        description="Named evaluation sets measured beside the held-out prompts, on the same servers, each "
        "reported apart (and per prompt category where its rows name one).",
    )
    template_variants: list[TemplateVariantConfig] = Field(
        [],
        description="Named chat-template variants (a `thinking` switch...): every evaluation set is also measured "
        "rendered with each, on the same servers, and reported apart. Unset: the template's default rendering only.",
    )


class PromotionConfig(_Section):
    dir: str | None = Field(
        None,
        description="Stable home of the serving drafter: `<dir>/current` links to the "
        "promoted version. Unset: no promotion.",
    )
    warm_start: bool = Field(
        True, description="Train from the current drafter (keeping its draft vocabulary) when there is one."
    )
    warm_start_lr_scale: float = Field(
        0.1,
        gt=0,
        le=1,
        description="A warm start trains at train.lr times this. At the from-scratch rate a trained drafter first "
        "loses what it learned (demo: predicted acceptance length 3.13 -> 2.81 after one epoch at 1e-2, 2.96 after "
        "five; at 1e-3 it gains: 3.15, then 3.18).",
    )


class TrackingConfig(_Section):
    mlflow: bool = Field(
        False,
        description="Export each finished run to MLflow: the config as parameters, the training curve and the "
        "evaluation as metrics, the target, its revision and fingerprint, the library versions and Eyrie's commit "
        "as tags, the drafter and the run summary as artifacts (docs/operations/tracking.md). Needs Eyrie's "
        "`tracking` extra (mlflow-skinny) where the run runs; the run refuses to start without it.",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="The MLflow tracking URI: a server's http(s) URL, or a local `sqlite:///path/mlflow.db`. "
        "Unset: $MLFLOW_TRACKING_URI, which must then be set where the run runs.",
    )
    mlflow_experiment: str = Field("eyrie", min_length=1, description="The MLflow experiment (made when missing).")
    mlflow_artifact_location: str | None = Field(
        None,
        description="Where a new MLflow experiment keeps its artifacts. Unset: the server's choice; for a local "
        "`sqlite:///` store, an `mlartifacts` folder beside the database file.",
    )
    wandb: bool = Field(
        False,
        description="Export each finished run to Weights & Biases, as to MLflow. Needs the `wandb` package "
        "(Eyrie's `tracking-wandb` extra); its login and mode from the environment (WANDB_API_KEY, WANDB_MODE...).",
    )
    wandb_project: str = Field("eyrie", min_length=1, description="The W&B project.")
    wandb_entity: str | None = Field(None, description="The W&B entity (user or team). Unset: the login's default.")
    run_name: str | None = Field(None, description="The tracked run's name. Unset: the run's `name`.")
    log_drafter: bool = Field(True, description="Upload the exported drafter folder (its config and weights).")


class PipelineConfig(_Section):
    name: str = Field("eyrie", description="The run's name: the default run folder is runs/<name>.")
    target: TargetConfig
    data: DataConfig
    regenerate: RegenerateConfig = RegenerateConfig()
    extraction: ExtractionConfig = ExtractionConfig()
    vocab: VocabConfig = VocabConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    promotion: PromotionConfig = PromotionConfig()
    tracking: TrackingConfig = TrackingConfig()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # It becomes runs/<name>: a '/' or '..' would put the run folder anywhere (`name: ../..` is the checkout's
        # parent), and a run adopts and cleans its folder.
        if not RUN_NAME.fullmatch(v) or ".." in v:
            raise ValueError(
                f"{v!r} is not a run name: use letters, digits, '.', '_' or '-', starting with a letter or digit, "
                "at most 100 characters, without '..' (it names the run folder runs/<name>)"
            )
        return v

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        ids = self.extraction.layer_ids
        if ids is not None:
            if len(ids) == 0:
                raise ValueError("extraction.layer_ids is empty: give three ids (low, middle, high) or omit the key")
            if len(set(ids)) != len(ids):
                raise ValueError(f"extraction.layer_ids {ids} has duplicates: each id must appear once")
            if any(i < 0 for i in ids):
                raise ValueError(f"extraction.layer_ids {ids} has a negative id: ids count layers from 0")
        if not is_loopback(self.extraction.host) and not self.extraction.api_key_env:
            raise ValueError(
                f"extraction.host {self.extraction.host!r} exposes the server beyond loopback: set "
                "extraction.api_key_env to the name of an environment variable holding an API key"
            )
        return self

    @model_validator(mode="after")
    def _cross_references(self) -> PipelineConfig:
        """Every name one section gives for another's entry resolves, and names meant to tell entries apart are
        unique: refused at load, not stages later (a `template_mix` naming an undeclared variant failed in
        regeneration, after the target loaded)."""
        variants = [v.name for v in self.evaluate.template_variants]
        for kind, what, names in (
            ("evaluate.template_variants", "variants", variants),
            ("evaluate.prompt_sets", "sets", [s.name for s in self.evaluate.prompt_sets]),
        ):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"{kind}: two {what} are named {', '.join(map(repr, twice))}; name each apart")
        mix = [share.variant for share in self.regenerate.template_mix or []]
        if mix and "default" in variants:
            raise ValueError(
                "evaluate.template_variants: a variant is named 'default', which regenerate.template_mix reserves "
                "for the template's own rendering: rename it"
            )
        known = ["default", *variants]
        for name in mix:
            if name not in known:
                raise ValueError(
                    f"regenerate.template_mix: {name!r} is not a template variant; known: "
                    f"{', '.join(map(repr, known))} (declare it in evaluate.template_variants with its "
                    "chat_template_kwargs)"
                )
            if mix.count(name) > 1:
                raise ValueError(
                    f"regenerate.template_mix names {name!r} twice: give each variant one entry and weight"
                )
        return self

    @property
    def max_model_len(self) -> int:
        return self.target.max_model_len or self.data.max_length + 1

    def fingerprint(self, *sections: str) -> str:
        """A stable hash of the named sections (all when none): the identity of what they configure."""
        data = self.model_dump(mode="json")
        picked = {k: data[k] for k in (sections or data.keys())}
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key `{key}`: remove it or check its spelling")
        elif e["type"] == "missing":
            lines.append(f"  - missing key `{key}`: it is required")
        else:
            lines.append(f"  - `{key}`: {e['msg']} (got {e.get('input')!r})")
    return f"invalid config {source}:\n" + "\n".join(lines)


def parse_config(data: dict, source: str = "<dict>") -> PipelineConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | Path) -> PipelineConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file {path} not found: pass --config with the path of a YAML file "
            "(configs/demo.yaml is the embedded default)"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    return parse_config(data, str(path))
