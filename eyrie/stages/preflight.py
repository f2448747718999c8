"""Every check that needs no weights, run in seconds before the expensive steps.

The original failure this project exists for: a 27-minute load of the target ended in "Model does not support
EAGLE3 interface". Here the target's vLLM class is resolved from its config.json and probed with attribute checks
(never `issubclass` on the protocol, which raises TypeError), the layer ids are checked against the layer count, the
installed vLLM is checked for the `extract_hidden_states` method and against what the config asks of it (version,
server arguments, server variables), the disk is checked against the estimated hidden states, and the chat template
is checked. Each failure says what is wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib
import io
import os
import re
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from eyrie.config import PipelineConfig
from eyrie.errors import PreflightError
from eyrie.hidden_states.encoding import check_config as check_hidden_states_dtype
from eyrie.run.folder import RunFolder
from eyrie.stages.promote import check_base, current_version
from eyrie.target.drafter import draft_layer_config
from eyrie.target.metadata import (
    TargetError,
    checkpoint_tensor_names,
    context_limit,
    load_tokenizer,
    mask_token_id,
    read_target_config,
    resolve_borrowed_weights,
    text_config,
    verifier_name,
)
from eyrie.vllm.loading import load_warnings, weights_folder
from eyrie.vllm.plugin import hidden_eagle3_classes


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default: low, middle, high (input of layers 2, L//2, L-3)."""
    return [2, num_layers // 2, num_layers - 3]


def captured_layer_ids(aux_ids: list[int], num_layers: int) -> list[int]:
    """What extraction captures: the aux ids, then id L (the last layer's output, before the final norm)."""
    return list(aux_ids) + [num_layers]


def validate_aux_layer_ids(ids: list[int] | None, num_layers: int) -> tuple[list[int], list[str]]:
    """The aux ids to use (defaulted) and the problems with them."""
    ids = list(ids) if ids is not None else default_aux_layer_ids(num_layers)
    problems = []
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        problems.append(
            f"extraction.layer_ids {ids}: {bad} outside 0..{num_layers - 1} (the target has {num_layers} "
            f"layers; id k is the input of layer k, and id {num_layers}, the last layer's output, is "
            "always captured, so leave it out)"
        )
    if len(set(ids)) != len(ids):
        problems.append(
            f"extraction.layer_ids {ids} has duplicates (with {num_layers} layers the default ids "
            f"{default_aux_layer_ids(num_layers)} may collide): list distinct ids"
        )
    if ids != sorted(ids):
        problems.append(f"extraction.layer_ids {ids} is not ascending: list them low to high")
    return ids, problems


# ---------------------------------------------------------------------------------------------------------------
# vLLM class probing


@dataclass
class ClassProbe:
    architecture: str
    vllm_class: str | None = None
    path: str = "unsupported"  # native | compat (Eyrie's compatibility layer) | unsupported
    reason: str = ""
    language_model: str | None = None
    fix: str = ""


def not_a_decoder_lm(cls, cfg: dict) -> str | None:
    """Why `cls` (vLLM's class for the target) cannot carry an EAGLE-3 drafter whatever its interface, or None.

    EAGLE-3 drafts for a decoder-only causal LM: it reads the decoder's residual stream and predicts its next tokens.
    Encoder-decoder (speech, translation), embedding, reward and classification models have no such stream to
    draft for, so they are refused here, never routed to the compatibility layer. vLLM's own model inspection says
    what the class is; config.json's `is_encoder_decoder` catches encoder-decoder classes vLLM serves as decoders.
    """
    from vllm.model_executor.models.registry import _ModelInfo

    info = _ModelInfo.from_model_cls(cls)
    if info.is_pooling_model or not info.is_text_generation_model:
        return "an embedding, reward or classification (pooling) model, not a text generator"
    if cfg.get("is_encoder_decoder") or text_config(cfg).get("is_encoder_decoder") or info.supports_transcription_only:
        return "an encoder-decoder model (speech or sequence-to-sequence), not a decoder-only causal LM"
    if info.is_attention_free:
        return "attention-free (state-space): its hidden states cannot be captured through the KV-cache connector"
    return None


def _has_eagle3(cls) -> bool:
    if cls.__name__ in hidden_eagle3_classes():  # a test reproducing a vLLM whose class lacks the interface
        return False
    # hasattr, not issubclass: SupportsEagle3 is a Protocol with a ClassVar, and issubclass raises TypeError.
    return bool(getattr(cls, "supports_eagle3", False)) and callable(getattr(cls, "set_aux_hidden_state_layers", None))


def resolve_vllm_class(architecture: str):
    """The class vLLM would instantiate for `architecture`, imported but not built (no weights)."""
    from vllm.model_executor.models.registry import ModelRegistry

    return ModelRegistry._try_load_model_cls(architecture)


def language_model_architecture(cfg: dict) -> str | None:
    """The text backbone's architecture inside a multimodal wrapper, as vLLM would build it."""
    text = cfg.get("text_config") or cfg.get("language_config")
    if not text:
        return None
    if text.get("architectures"):
        return text["architectures"][0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text.get("model_type", ""))


def probe_eagle3(cfg: dict) -> ClassProbe:
    archs = cfg.get("architectures") or []
    if not archs:
        return ClassProbe("?", reason="config.json has no `architectures`: vLLM cannot pick a model class")
    probe = ClassProbe(archs[0])
    cls = resolve_vllm_class(archs[0])
    if cls is None:
        probe.reason = model_class_unavailable(archs[0])
        return probe
    probe.vllm_class = f"{cls.__module__}.{cls.__qualname__}"
    kind = not_a_decoder_lm(cls, cfg)
    if kind:
        probe.reason = f"{archs[0]} is {kind}; EAGLE-3 drafts only for decoder-only causal language models"
        probe.fix = (
            "point target.model at a decoder-only text-generation model (a *ForCausalLM, or a multimodal "
            "wrapper around one)"
        )
        return probe
    lm_arch = language_model_architecture(cfg)
    if lm_arch:
        lm_cls = resolve_vllm_class(lm_arch)
        probe.language_model = f"{lm_cls.__module__}.{lm_cls.__qualname__}" if lm_cls else lm_arch
    if _has_eagle3(cls):
        probe.path = "native"
        probe.reason = f"{cls.__name__} implements SupportsEagle3"
        return probe
    lacks = (
        f"vLLM's {cls.__name__} does not implement SupportsEagle3 (no `supports_eagle3` flag or "
        "`set_aux_hidden_state_layers`)"
    )
    probe.fix = f"use a vLLM version whose {cls.__name__} implements SupportsEagle3, or a target architecture that does"
    if os.environ.get("EYRIE_EAGLE3_COMPAT", "1") == "0":
        probe.reason = (
            f"{lacks}, so vLLM would load the weights and then fail with 'Model does not support EAGLE3 "
            "interface'; Eyrie's compatibility layer is off (EYRIE_EAGLE3_COMPAT=0)"
        )
    else:
        probe.path = "compat"
        probe.reason = f"{lacks}; Eyrie's compatibility layer gives it the interface in every vLLM process"
    return probe


def vllm_has_extract_hidden_states() -> bool:
    from vllm.config import speculative

    src = Path(speculative.__file__).read_text()
    return "extract_hidden_states" in src


# ---------------------------------------------------------------------------------------------------------------
# The installed vLLM against what the config asks of it: its version, its server's arguments, its variables

# Where `vllm serve`'s parser factory lives, newest first (0.32 moved it from openai/ to launchers/).
SERVE_PARSER_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")
PLACEHOLDER_PORT = 8000  # parsing needs a port; the server gets a free one


class ServerArgumentError(Exception):
    """vLLM's server parser refused an argument (argparse would print its usage and exit)."""


@functools.lru_cache(maxsize=1)
def serve_parser():
    """The installed vLLM's own `vllm serve` parser, built in-process (no engine, no model; 0.3 s after preflight's
    other imports), raising instead of exiting; None when this vLLM keeps its factory in none of
    SERVE_PARSER_MODULES."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before the utils package split
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]
    for name in SERVE_PARSER_MODULES:
        try:
            make_arg_parser = importlib.import_module(name).make_arg_parser
        except (ImportError, AttributeError):
            continue

        class Parser(FlexibleArgumentParser):
            def error(self, message):
                raise ServerArgumentError(message)

        return make_arg_parser(Parser())
    return None


def parse_server_arguments(args: list[str]) -> argparse.Namespace:
    """`args` as the installed vLLM's server parses them; ServerArgumentError names what it refuses."""
    parser = serve_parser()
    assert parser is not None, "check serve_parser() first"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(list(args))
    except SystemExit:  # --help or --version print and exit
        raise ServerArgumentError("the parser exits (is --help or --version among the arguments?)") from None
    except (ValueError, TypeError) as err:  # vLLM's own checks while it rewrites the arguments
        raise ServerArgumentError(str(err)) from None


# What a server argument Eyrie passes itself is set from (by vLLM's name for it); anything else: Eyrie's own wiring.
EYRIE_SETS = {
    "model": "target.model",
    "revision": "target.revision",
    "trust_remote_code": "target.trust_remote_code",
    "tensor_parallel_size": "target.tensor_parallel_size",
    "dtype": "target.dtype",
    "max_model_len": "target.max_model_len",
    "host": "extraction.host",
    "port": "extraction.port",
    "enforce_eager": "extraction.enforce_eager",
    "gpu_memory_utilization": "extraction.gpu_memory_utilization",
    "speculative_config": "extraction.layer_ids and evaluate.num_speculative_tokens",
}


def _dests(args: list[str]) -> dict[str, str]:
    """vLLM's name (argparse dest) for each flag in `args` -> the flag as written (`--a.b` is part of `--a`)."""
    actions = serve_parser()._option_string_actions
    out = {}
    for arg in args:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            action = actions.get(flag.split(".", 1)[0].replace("_", "-"))
            if action is not None:
                out[action.dest] = flag
    return out


def _blame(message: str, server_args: list[str]) -> list[str]:
    """The flags of `server_args` that vLLM's message names (vLLM spells names with dashes)."""
    flags = [a.split("=", 1)[0] for a in server_args if a.startswith("--")]
    return [f for f in flags if re.search(re.escape(f.replace("_", "-")) + r"(?![\w-])", message)]


def check_server_arguments(config: PipelineConfig, captured: list[int], serve: bool) -> tuple[list[str], list[str]]:
    """Every argument Eyrie would start vLLM with (its own and extraction.server_args), parsed by the installed
    vLLM's own parser: for the extraction server and, when `serve`, the target-plus-drafter one. Failures, warnings."""
    import vllm

    from eyrie.vllm.spec import ServerSpec

    if serve_parser() is None:  # a vLLM that moved its parser again: say so rather than guess
        modules = " or ".join(SERVE_PARSER_MODULES)
        return [], [
            f"the server arguments were not checked: vLLM {vllm.__version__} has no make_arg_parser in {modules}"
        ]
    specs: dict[str, ServerSpec] = {"extraction": ServerSpec.for_extraction(config, captured, "<staging>")}
    if serve:
        specs["export/evaluation"] = ServerSpec.for_serving(config, "<drafter>")
    failures = []
    # vLLM takes the later of two values, and Eyrie's checks and clients assume its own: one owner per setting.
    own = set(EYRIE_SETS).union(
        *(_dests(replace(s, server_args=[]).arguments(PLACEHOLDER_PORT)) for s in specs.values())
    )
    for dest, flag in _dests(config.extraction.server_args).items():
        if dest in EYRIE_SETS:
            failures.append(
                f"extraction.server_args sets {flag}, which Eyrie passes to vLLM from {EYRIE_SETS[dest]}: set "
                f"{EYRIE_SETS[dest]} instead and remove {flag} from server_args"
            )
        elif dest in own:
            failures.append(
                f"extraction.server_args sets {flag}, which Eyrie passes to vLLM itself for its own wiring (its "
                f"hidden-states connector, its client): remove {flag} from server_args"
            )
    refused: dict[str, list[str]] = {}  # vLLM's message -> the servers it refuses
    parsed = {}
    for label, spec in specs.items():
        try:
            parsed[label] = parse_server_arguments(spec.arguments(spec.port or PLACEHOLDER_PORT))
        except ServerArgumentError as err:
            refused.setdefault(str(err)[:400], []).append(label)
    for message, labels in refused.items():
        servers = " and ".join(labels) + (" servers" if len(labels) > 1 else " server")
        where = f"vLLM {vllm.__version__} refuses the arguments of the {servers}: {message}"
        flags = _blame(message, config.extraction.server_args)
        if flags:
            failures.append(
                f"{where}. {', '.join(flags)} in extraction.server_args: check the spelling against this vLLM "
                "(`python -m vllm.entrypoints.openai.api_server --help=<word>`), or install a vLLM that has it "
                "(flags are renamed between versions; target.vllm_version states the versions a preset needs)"
            )
        else:
            failures.append(
                f"{where}. Eyrie builds this argument from the config: check the setting behind it, and the "
                "installed vLLM against the versions pyproject's `cpu`/`gpu` extras pin (a flag may be missing)"
            )
    warnings = []
    seqs = getattr(parsed.get("extraction"), "max_num_seqs", None)
    if seqs and config.extraction.concurrency > seqs:
        warnings.append(
            f"extraction.concurrency {config.extraction.concurrency} is above the server's --max-num-seqs {seqs}: "
            f"the requests beyond it wait in vLLM's queue, their wait counted against request_timeout_s; set "
            f"extraction.concurrency to {seqs}"
        )
    # Regeneration sends its requests to the same server (the extraction server generates too).
    if seqs and config.regenerate.enabled and config.regenerate.concurrency > seqs:
        warnings.append(
            f"regenerate.concurrency {config.regenerate.concurrency} is above the extraction server's "
            f"--max-num-seqs {seqs}, which regeneration generates on: the requests beyond it wait in vLLM's queue, "
            f"their wait counted against regenerate.request_timeout_s; set regenerate.concurrency to {seqs}"
        )
    return failures, warnings


def check_server_env(env: dict[str, str]) -> list[str]:
    """Every VLLM_* variable in extraction.server_env must be one the installed vLLM reads (its `vllm.envs`
    registry; vLLM itself only warns, 'Unknown vLLM environment variable', and ignores it), with a value it can
    read. Other names (NCCL_*, HF_*, ...) are other libraries' and pass."""
    import vllm
    from vllm import envs

    known = envs.environment_variables
    failures = []
    for name, value in env.items():
        if not name.startswith("VLLM_"):
            continue
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            failures.append(
                f"extraction.server_env sets {name}, which vLLM {vllm.__version__} does not know (not in "
                "vllm.envs): vLLM would ignore it. "
                + (f"Did you mean {close[0]}? " if close else "")
                + "Fix the name, or install a vLLM that has it"
            )
            continue
        saved = os.environ.get(name)
        os.environ[name] = value  # the registry's readers read os.environ: int(...), a choice check, ...
        try:
            known[name]()
        except Exception as err:
            failures.append(
                f"extraction.server_env {name}={value!r}: vLLM {vllm.__version__} cannot read this value "
                f"({type(err).__name__}: {err}): see its definition in vllm/envs.py"
            )
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved
    return failures


def check_vllm_version(required: str | None, installed: str) -> list[str]:
    """target.vllm_version (a PEP 440 specifier) against the installed vLLM."""
    if not required:
        return []
    try:
        ok = SpecifierSet(required).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        return [
            f"target.vllm_version asks for vLLM {required}, and the installed vLLM's version {installed!r} cannot "
            "be compared with it: install a released vLLM"
        ]
    if ok:
        return []
    return [
        f"target.vllm_version asks for vLLM {required}, and vLLM {installed} is installed: install a vLLM that "
        "meets it (pyproject's `gpu` and `cpu` extras pin the tested ones)"
    ]


# ---------------------------------------------------------------------------------------------------------------
# The whole check


@dataclass
class PreflightReport:
    architecture: str
    vllm_class: str | None
    eagle3_path: str
    eagle3_reason: str
    language_model: str | None
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    captured_layer_ids: list[int]
    vllm_version: str
    max_model_len: int
    # What the train stage needs from the target, decided here (see `eyrie.stages.train.trainer.training_command`):
    # `verifier_weights`, speculators' names for the tensors the drafter borrows -> the checkpoint's, and
    # `mask_token_id`.
    target_facts: dict = field(default_factory=dict)
    final_norm: str | None = None  # the target's final norm class (speculators applies it as an RMSNorm)
    revisions: dict = field(default_factory=dict)  # hub revisions as this run pinned them (commits)
    estimated_bytes: int | None = None
    free_bytes: int | None = None
    hidden_states: str = "offline"  # train.hidden_states: online runs have no extract stage (`eyrie status` reads it)
    warnings: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def report_markdown(report: PreflightReport) -> str:
    """The report as a user reads it in Prefect's UI: the verdict first, then every problem and what was found."""
    verdict = (
        f"**FAILED**: {len(report.failures)} problem(s), no weights were loaded"
        if report.failures
        else f"passed: `{report.architecture}` via the {report.eagle3_path} EAGLE-3 path"
    )
    weights = report.target_facts.get("verifier_weights", {})
    rows = [
        ("architecture", f"`{report.architecture}` (vLLM `{report.vllm_class}`)"),
        ("EAGLE-3 path", f"{report.eagle3_path}: {report.eagle3_reason}"),
        ("layers / hidden / vocab", f"{report.num_layers} / {report.hidden_size} / {report.vocab_size}"),
        ("captured layer ids", str(report.captured_layer_ids)),
        ("max_model_len", str(report.max_model_len)),
        ("borrowed tensors", ", ".join(f"`{v}`" for v in weights.values()) or "-"),
        ("hidden states (estimate)", f"{report.estimated_bytes / 2**30:.1f} GiB" if report.estimated_bytes else "-"),
        ("vLLM", report.vllm_version),
    ]
    return "\n".join(
        [
            f"# Preflight {verdict}",
            "",
            *(f"- {f}" for f in report.failures),
            "",
            *(f"- warning: {w}" for w in report.warnings),
            "",
            "| check | found |",
            "|---|---|",
            *(f"| {k} | {v} |" for k, v in rows),
        ]
    )


def _first(cfg: dict, *keys: str) -> int:
    return next((cfg[k] for k in keys if cfg.get(k)), 0)


def hidden_state_bytes(tokens: int, num_captured: int, hidden_size: int, dtype_bytes: int = 2) -> int:
    """Bytes of hidden states for `tokens` tokens, plus safetensors headers and token ids (8 B each)."""
    return tokens * (num_captured * hidden_size * dtype_bytes + 8)


def bytes_still_to_write(config: PipelineConfig, estimated_bytes: int, hidden_dir: Path) -> int:
    """What the disk check asks for: the estimated hidden states less those already on disk (a re-run of a half
    finished extraction, or a finished one, needs only the rest); nothing with online hidden states, which go
    through tmpfs and never reach the run folder."""
    if config.train.hidden_states == "online":
        return 0
    have = 0
    stack = [hidden_dir]
    while stack:  # os.scandir: one stat per file from the directory read itself, for 200,000 files
        try:
            with os.scandir(stack.pop()) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(Path(e.path))
                    elif e.is_file(follow_symlinks=False):
                        have += e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return max(estimated_bytes - have, 0)


def check_context(config: PipelineConfig, cfg: dict) -> list[str]:
    """Extraction sends each prepared sample (up to data.max_length tokens) and asks for one token more."""
    failures = []
    need, have = config.data.max_length + 1, config.max_model_len
    if have < need:
        failures.append(
            f"target.max_model_len {have} leaves no room for a sample of data.max_length "
            f"{config.data.max_length} tokens plus the one token extraction generates (vLLM answers "
            f"'max_tokens must be at least 1'): set target.max_model_len to at least {need}, or unset it"
        )
    limit = context_limit(cfg)
    if limit is not None and have > limit:
        failures.append(
            f"max_model_len {have} is beyond the target's context of {limit} tokens (its config.json), "
            f"which vLLM refuses at start-up: set data.max_length to at most {limit - 1}"
        )
    return failures


def check_parallelism(config: PipelineConfig, text: dict) -> list[str]:
    """vLLM shards attention heads over the tensor-parallel ranks: the heads must divide evenly."""
    tp = config.target.tensor_parallel_size
    heads = _first(text, "num_attention_heads", "n_head")
    kv = text.get("num_key_value_heads") or heads
    failures = []
    if heads and heads % tp:
        failures.append(
            f"target.tensor_parallel_size {tp} does not divide the target's {heads} attention heads: "
            "use a divisor of the head count"
        )
    elif kv and kv % tp and tp % kv:
        failures.append(
            f"target.tensor_parallel_size {tp} and the target's {kv} key-value heads neither divide "
            "the other: vLLM cannot shard or replicate them evenly"
        )
    return failures


def check_serving(cfg: dict) -> list[str]:
    """Export and evaluation serve target + drafter in vLLM: refuse what the installed build cannot decode."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and text_config(cfg).get("kv_lora_rank"):
        return [
            "the target uses multi-head latent attention (MLA), and vLLM's CPU backend cannot decode it with an "
            "EAGLE-3 drafter ('No common block size'), so export and evaluation would fail after training: run "
            "`eyrie run --until train` here and evaluate on GPUs"
        ]
    return []


def check_drafter_inputs(config: PipelineConfig, cfg: dict, report: PreflightReport) -> list[str]:
    """What the train and export stages need from the target, decided now: the embedding, final norm and head
    the drafter borrows (present in the checkpoint), and the drafter's own decoder layer config."""
    failures = []
    try:
        borrowed = resolve_borrowed_weights(config.target, cfg, checkpoint_tensor_names(config.target))
        report.target_facts["verifier_weights"] = borrowed.speculators_names()
        report.final_norm = borrowed.norm_class
        if "rms" not in borrowed.norm_class.lower():
            report.warnings.append(
                f"the target's final norm is a {borrowed.norm_class}; speculators applies it as "
                "an RMSNorm when it computes training labels, so labels approximate the target's "
                "distribution"
            )
    except TargetError as err:
        failures.append(str(err))
    try:
        draft_layer_config(config.target, config.train.num_layers)
    except Exception as err:
        failures.append(
            f"the drafter's decoder layer cannot be shaped from {config.target.model}'s config "
            f"({type(err).__name__}: {err})"
        )
    return failures


# --- the node: what a run needs of the machine and the filesystems it runs on (issue 22, item 7) ---------------


def model_class_unavailable(architecture: str) -> str:
    """Why vLLM gave no class for `architecture`: it has none, or it has one whose module fails to import (a
    multimodal wrapper whose module needs a package that is not installed): then the import error, and its fix."""
    from vllm.model_executor.models.registry import ModelRegistry

    registered = ModelRegistry.models.get(architecture)
    if registered is None:
        return f"the installed vLLM has no model class for {architecture}"
    try:
        registered.load_model_cls()
    except ModuleNotFoundError as err:
        return (
            f"the installed vLLM has a model class for {architecture}, but its module fails to import: "
            f"{type(err).__name__}: {err}. Fix: install the missing package ({err.name}) in this environment"
        )
    except Exception as err:  # noqa: BLE001 - whatever the module raises is the news
        return (
            f"the installed vLLM has a model class for {architecture}, but it fails to import: "
            f"{type(err).__name__}: {err}. Fix: the packages this model needs (see the error), or another vLLM"
        )
    return f"vLLM would not load its class for {architecture} (see the log above for its error)"


def gpu_count() -> int:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES applied), without creating a CUDA context."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_train_devices(config: PipelineConfig, gpus: int | None = None) -> list[str]:
    """train.devices no larger than the GPUs present, when training runs on GPUs; online, the extraction server's
    GPUs beside the trainer's too. A host with no GPU at all is not judged: preflight of a GPU config runs from a
    login node too, and the GPU node's preflight (each run's own) decides."""
    gpus = gpu_count() if gpus is None else gpus
    t = config.train
    if t.device == "cpu" or gpus == 0:
        return []
    need, what = t.devices, f"train.devices {t.devices}"
    if t.hidden_states == "online":  # the server stays up, on GPUs of its own, while the trainer runs
        need += config.target.tensor_parallel_size
        what += f" + target.tensor_parallel_size {config.target.tensor_parallel_size} (online: the server stays up)"
    if need > gpus:
        return [
            f"{what} need {need} GPUs, but {gpus} are visible here: lower train.devices (or the tensor "
            "parallelism), or run on a node with more GPUs"
        ]
    return []


def _unescape_mount(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mount_of(path: Path, mounts: str | None = None) -> tuple[str, str, set[str]] | None:
    """(mount point, filesystem type, options) of the filesystem holding `path` (its nearest existing folder, with
    symlinks resolved), from /proc/mounts; from `mounts` instead (that text, `path` taken as it is written) when
    given. None when /proc/mounts cannot be read."""
    p = Path(os.path.abspath(path))
    if mounts is None:
        while not p.exists() and p != p.parent:
            p = p.parent
        p = Path(os.path.realpath(p))
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    best = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = _unescape_mount(fields[1])
        if (p == Path(point) or Path(point) in p.parents) and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2], set(fields[3].split(",")))
    return best


def check_lock_filesystem(run_dir: Path, mounts: str | None = None) -> list[str]:
    """The run lock (an flock on the run folder) must hold across nodes: refused on a filesystem whose flock is
    node-local (Lustre `localflock`, NFS `nolock` or `local_lock=flock|all`) or absent (Lustre without `flock`),
    where two nodes would both hold it and interleave their writes."""
    found = mount_of(run_dir, mounts)
    if found is None:
        return []
    point, fstype, options = found
    why = None
    if fstype == "lustre":
        if "localflock" in options:
            why = "Lustre mounted with `localflock`: flock is local to each client node"
        elif "flock" not in options:
            why = "Lustre mounted without `flock` (or with `noflock`): flock is not supported"
    elif fstype in ("nfs", "nfs4"):
        if "nolock" in options:
            why = "NFS mounted with `nolock`: locks are local to each client node"
        elif {"local_lock=flock", "local_lock=all"} & options:
            why = "NFS mounted with `local_lock`: flock is local to each client node"
    if why is None:
        return []
    return [
        f"the run folder {run_dir} is on {point} ({why}), so the run lock would not keep two runs (or a run and "
        "`eyrie verify`) on different nodes apart: use a --run-dir on a filesystem with cluster-wide flock (Lustre "
        "`-o flock`, NFS without `nolock`/`local_lock`, a node-local disk for a one-node run)"
    ]


def check_online_tmpfs(config: PipelineConfig, run_dir: Path, captured: int, hidden: int) -> list[str]:
    """Online training keeps the requests in flight as files on tmpfs: it must hold them all at the longest sample
    (every request of extraction.concurrency, twice: those written and not yet read beside those being written)."""
    if config.train.hidden_states != "online" or not captured or not hidden:
        return []
    from eyrie.hidden_states.staging import staging_dir

    base = staging_dir(run_dir).parent
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        return [f"online hidden states go through {base}, which does not exist: create it, or set $EYRIE_ONLINE_TMPFS"]
    per_sample = hidden_state_bytes(
        config.data.max_length, captured, hidden, 1 if config.extraction.hidden_states_dtype == "float8_e4m3fn" else 2
    )
    need = 2 * config.extraction.concurrency * per_sample
    if need > free:
        return [
            f"online training keeps up to {2 * config.extraction.concurrency} samples of up to "
            f"{per_sample / 2**20:.0f} MiB in flight on {base}, {need / 2**30:.2f} GiB, but it has "
            f"{free / 2**30:.2f} GiB free: enlarge it (`mount -o remount,size=... {base}`), point $EYRIE_ONLINE_TMPFS "
            "at a larger tmpfs, or lower extraction.concurrency or data.max_length"
        ]
    return []


def run_preflight(
    config: PipelineConfig, run_dir: Path, tokens: int | None = None, raise_on_failure: bool = True, serve: bool = True
) -> PreflightReport:
    """Every check that needs no weights; the report lists every failure found, not only the first. `serve`: the
    run goes on to export and evaluation (vLLM serves target + drafter), so check that too."""
    import vllm

    cfg = read_target_config(config.target)
    failures = []
    if cfg.get("auto_map") and not config.target.trust_remote_code:
        failures.append(
            f"{config.target.model} ships its own code (config.json `auto_map`): set "
            "target.trust_remote_code: true if you trust it"
        )
    text = text_config(cfg)
    # GPT-2 and OPT-era configs spell these n_layer/n_embd (and word_embed_proj_dim for OPT is not the width).
    num_layers = int(_first(text, "num_hidden_layers", "n_layer", "num_layers"))
    hidden = int(_first(text, "hidden_size", "n_embd", "d_model"))
    vocab = int(text.get("vocab_size", cfg.get("vocab_size", 0)))
    if not num_layers or not hidden:
        failures.append(f"{config.target.model}/config.json has no num_hidden_layers/hidden_size for the decoder")
    aux_ids, problems = validate_aux_layer_ids(config.extraction.layer_ids, num_layers)
    failures += problems

    probe = probe_eagle3(cfg)
    if probe.path == "unsupported":
        failures.append(f"{probe.reason}. Fix: {probe.fix}" if probe.fix else probe.reason)
    if probe.path == "compat" and not config.extraction.enforce_eager:
        failures.append(
            f"{probe.architecture} takes Eyrie's compatibility layer, whose hooks need eager execution: "
            "set extraction.enforce_eager: true"
        )
    if not vllm_has_extract_hidden_states():
        failures.append(
            f"the installed vLLM {vllm.__version__} lacks the `extract_hidden_states` speculative "
            "method: install vLLM >= 0.17 (pyproject extras `cpu` or `gpu`)"
        )
    failures += check_vllm_version(config.target.vllm_version, vllm.__version__)
    failures += check_server_env(config.extraction.server_env)
    failures += check_hidden_states_dtype(config.extraction.hidden_states_dtype)
    arg_failures, arg_warnings = check_server_arguments(config, captured_layer_ids(aux_ids, num_layers), serve)
    failures += arg_failures
    if config.vocab.draft_vocab_size > vocab > 0:
        failures.append(
            f"vocab.draft_vocab_size {config.vocab.draft_vocab_size} is larger than the target's "
            f"vocabulary ({vocab}): set it to at most {vocab}"
        )
    failures += check_context(config, cfg) + check_parallelism(config, text) + (check_serving(cfg) if serve else [])
    failures += check_train_devices(config)
    failures += check_lock_filesystem(run_dir)
    failures += check_online_tmpfs(config, run_dir, len(captured_layer_ids(aux_ids, num_layers)), hidden)
    tok = None
    try:
        tok = load_tokenizer(config.target)
        probe_msgs = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
        if "pong" not in tok.apply_chat_template(probe_msgs, tokenize=False):
            failures.append("the chat template drops the assistant's content: the loss mask would be empty")
        if len(tok) > vocab > 0:
            failures.append(
                f"the tokenizer has {len(tok)} tokens but the model's vocabulary has {vocab} rows: token "
                "ids beyond it would fail in vLLM; use the tokenizer that belongs to this checkpoint"
            )
    except Exception as err:  # DataError and template errors both end here with their own message
        failures.append(str(err))

    if config.promotion.dir and config.promotion.warm_start:
        current = current_version(Path(config.promotion.dir))
        if current is not None:
            failures += check_base(current, verifier_name(config.target.model), config.vocab.draft_vocab_size, aux_ids)

    report = PreflightReport(
        probe.architecture,
        probe.vllm_class,
        probe.path,
        probe.reason,
        probe.language_model,
        num_layers,
        hidden,
        vocab,
        aux_ids,
        captured_layer_ids(aux_ids, num_layers),
        vllm.__version__,
        config.max_model_len,
    )
    report.revisions = {"target": config.target.revision, "data": config.data.revision}
    report.hidden_states = config.train.hidden_states
    report.warnings += arg_warnings
    x = config.extraction
    report.warnings += load_warnings(weights_folder(config.target), x.server_args, x.enforce_eager, x.server_env)
    mask = config.train.mask_token_id
    report.target_facts["mask_token_id"] = mask if mask is not None or tok is None else mask_token_id(tok, vocab)
    if probe.path != "unsupported":  # a refused class is the one problem worth reading; its metadata may be odd
        failures += check_drafter_inputs(config, cfg, report)
    if tokens is not None and hidden:
        fp8 = config.extraction.hidden_states_dtype == "float8_e4m3fn"
        report.estimated_bytes = hidden_state_bytes(tokens, len(report.captured_layer_ids), hidden, 1 if fp8 else 2)
        run_dir.mkdir(parents=True, exist_ok=True)
        report.free_bytes = shutil.disk_usage(run_dir).free
        todo = bytes_still_to_write(config, report.estimated_bytes, RunFolder(run_dir).hidden_states)
        need = todo + int(config.extraction.min_free_disk_gib * 2**30)
        if need > report.free_bytes:
            failures.append(
                f"hidden states need about {todo / 2**30:.1f} GiB more (of "
                f"{report.estimated_bytes / 2**30:.1f} GiB in all; + {config.extraction.min_free_disk_gib} GiB "
                f"head-room) but {run_dir} has {report.free_bytes / 2**30:.1f} GiB free: free space, use a larger "
                "volume for --run-dir, or lower data.max_samples / data.max_length"
            )
    report.failures = failures
    if failures and raise_on_failure:
        raise PreflightError(failures)
    return report
