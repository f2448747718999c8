"""Preflight's checks of the target: its layer ids, the vLLM class it gets (probed for the EAGLE-3 interface
without building it), its context and parallelism, what serving it needs and what the drafter borrows from it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from eyrie.config import TargetConfig
from eyrie.stages.preflight.report import PreflightReport
from eyrie.target.drafter import draft_layer_config
from eyrie.target.metadata import (
    TargetError,
    checkpoint_tensor_names,
    context_limit,
    resolve_borrowed_weights,
    text_config,
)
from eyrie.vllm.plugin import hidden_eagle3_classes


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default: low, middle, high (input of layers 2, L//2, L-3)."""
    return [2, num_layers // 2, num_layers - 3]


def foreign_default_layer_ids(ids: list[int] | None, num_layers: int) -> str | None:
    """A warning when `ids` are the default ids of a target with another layer count (a preset's fixed ids, copied
    to this target): they pass the range check but capture other depths than the low/middle/high the default picks
    here. Ids chosen otherwise are the user's choice and pass."""
    if not ids or len(ids) != 3 or num_layers < 4:
        return None
    other = ids[2] + 3  # default ids end at L-3
    if other == num_layers or other < 4 or list(ids) != default_aux_layer_ids(other):
        return None
    return (
        f"extraction.layer_ids {list(ids)} are the default ids of a {other}-layer target, but this target has "
        f"{num_layers} layers (its default: {default_aux_layer_ids(num_layers)}): a preset's ids copied to another "
        "model capture other depths. Omit extraction.layer_ids for this target's default, or set ids for it"
    )


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


def _first(cfg: dict, *keys: str) -> int:
    return next((cfg[k] for k in keys if cfg.get(k)), 0)


def check_context(max_length: int, max_model_len: int, cfg: dict) -> list[str]:
    """Extraction sends each prepared sample (up to data.max_length tokens) and asks for one token more;
    `max_model_len` is the one vLLM is started with (`PipelineConfig.max_model_len`)."""
    failures = []
    need, have = max_length + 1, max_model_len
    if have < need:
        failures.append(
            f"target.max_model_len {have} leaves no room for a sample of data.max_length "
            f"{max_length} tokens plus the one token extraction generates (vLLM answers "
            f"'max_tokens must be at least 1'): set target.max_model_len to at least {need}, or unset it"
        )
    limit = context_limit(cfg)
    if limit is not None and have > limit:
        failures.append(
            f"max_model_len {have} is beyond the target's context of {limit} tokens (its config.json), "
            f"which vLLM refuses at start-up: set data.max_length to at most {limit - 1}"
        )
    return failures


def check_parallelism(target: TargetConfig, text: dict) -> list[str]:
    """vLLM shards attention heads over the tensor-parallel ranks: the heads must divide evenly."""
    tp = target.tensor_parallel_size
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


def check_drafter_inputs(target: TargetConfig, num_layers: int, cfg: dict, report: PreflightReport) -> list[str]:
    """What the train and export stages need from the target, decided now: the embedding, final norm and head
    the drafter borrows (present in the checkpoint), and the drafter's own decoder layer config."""
    failures = []
    try:
        borrowed = resolve_borrowed_weights(target, cfg, checkpoint_tensor_names(target))
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
        draft_layer_config(target, num_layers)
    except Exception as err:
        failures.append(
            f"the drafter's decoder layer cannot be shaped from {target.model}'s config ({type(err).__name__}: {err})"
        )
    return failures


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
