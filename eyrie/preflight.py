"""Every check that needs no weights, run in seconds before the expensive steps.

The original failure this project exists for: a 27-minute load of the target ended in "Model does not support
EAGLE3 interface". Here the target's vLLM class is resolved from its config.json and probed with attribute checks
(never `issubclass` on the protocol, which raises TypeError), the layer ids are checked against the layer count, the
installed vLLM is checked for the `extract_hidden_states` method, the disk is checked against the estimated hidden
states, and the chat template is checked. Each failure says what is wrong and how to fix it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eyrie.config import PipelineConfig, TargetConfig
from eyrie.errors import ConfigError, PreflightError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_local_model(model: str) -> bool:
    """A folder (existing, or not shaped like a hub id `org/name`) rather than a Hugging Face hub id."""
    return Path(model).exists() or not HUB_ID.match(model)


def is_local_target(target: TargetConfig) -> bool:
    return is_local_model(target.model)


def check_target_folder(target: TargetConfig) -> None:
    """A missing or unreadable local target is a config error, raised before anything else."""
    if not is_local_target(target):
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise ConfigError(f"target.model {target.model!r} is neither a local folder nor reachable "
                              "(HF_HUB_OFFLINE=1): download it first, or point target.model at the folder")
        return
    path = Path(target.model)
    if not path.is_dir():
        raise ConfigError(f"target.model {path} does not exist: point it at the folder holding the target's "
                          "config.json and weights (or a Hugging Face hub id)")
    if not os.access(path, os.R_OK | os.X_OK) or not (path / "config.json").is_file():
        raise ConfigError(f"target.model {path} has no readable config.json: is it a complete model folder?")


def read_target_config(target: TargetConfig) -> dict:
    check_target_folder(target)
    if is_local_target(target):
        path = Path(target.model) / "config.json"
    else:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(target.model, "config.json", revision=target.revision))
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None


def text_config(cfg: dict) -> dict:
    """The decoder's config: a multimodal wrapper keeps it under `text_config` (or `language_config`)."""
    return cfg.get("text_config") or cfg.get("language_config") or cfg


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
        problems.append(f"extraction.layer_ids {ids}: {bad} outside 0..{num_layers - 1} (the target has {num_layers} "
                        f"layers; id k is the input of layer k, and id {num_layers}, the last layer's output, is "
                        "always captured, so leave it out)")
    if len(set(ids)) != len(ids):
        problems.append(f"extraction.layer_ids {ids} has duplicates (with {num_layers} layers the default ids "
                        f"{default_aux_layer_ids(num_layers)} may collide): list distinct ids")
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


def _has_eagle3(cls) -> bool:
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
        probe.reason = f"the installed vLLM has no model class for {archs[0]}"
        return probe
    probe.vllm_class = f"{cls.__module__}.{cls.__qualname__}"
    lm_arch = language_model_architecture(cfg)
    if lm_arch:
        lm_cls = resolve_vllm_class(lm_arch)
        probe.language_model = f"{lm_cls.__module__}.{lm_cls.__qualname__}" if lm_cls else lm_arch
    if _has_eagle3(cls):
        probe.path = "native"
        probe.reason = f"{cls.__name__} implements SupportsEagle3"
        return probe
    lacks = (f"vLLM's {cls.__name__} does not implement SupportsEagle3 (no `supports_eagle3` flag or "
             "`set_aux_hidden_state_layers`)")
    if not callable(getattr(cls, "compute_logits", None)):
        probe.reason = f"{lacks}, and it is not a text-generation model the compatibility layer can serve"
    elif os.environ.get("EYRIE_EAGLE3_COMPAT", "1") == "0":
        probe.reason = (f"{lacks}, so vLLM would load the weights and then fail with 'Model does not support EAGLE3 "
                        "interface'; Eyrie's compatibility layer is off (EYRIE_EAGLE3_COMPAT=0)")
    else:
        probe.path = "compat"
        probe.reason = f"{lacks}; Eyrie's compatibility layer gives it the interface in every vLLM process"
    return probe


def vllm_has_extract_hidden_states() -> bool:
    from vllm.config import speculative

    src = Path(speculative.__file__).read_text()
    return "extract_hidden_states" in src


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
    estimated_bytes: int | None = None
    free_bytes: int | None = None
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _first(cfg: dict, *keys: str) -> int:
    return next((cfg[k] for k in keys if cfg.get(k)), 0)


def hidden_state_bytes(tokens: int, num_captured: int, hidden_size: int, dtype_bytes: int = 2) -> int:
    """Bytes of hidden states for `tokens` tokens, plus safetensors headers and token ids (8 B each)."""
    return tokens * (num_captured * hidden_size * dtype_bytes + 8)


def run_preflight(config: PipelineConfig, run_dir: Path, tokens: int | None = None,
                  raise_on_failure: bool = True) -> PreflightReport:
    import vllm

    from eyrie.data import load_tokenizer

    cfg = read_target_config(config.target)
    failures = []
    if cfg.get("auto_map") and not config.target.trust_remote_code:
        failures.append(f"{config.target.model} ships its own code (config.json `auto_map`): set "
                        "target.trust_remote_code: true if you trust it")
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
        failures.append(f"{probe.reason}. Fix: use a vLLM version whose {probe.architecture} implements "
                        "SupportsEagle3, or a target architecture that does")
    if probe.path == "compat" and not config.extraction.enforce_eager:
        failures.append(f"{probe.architecture} takes Eyrie's compatibility layer, whose hooks need eager execution: "
                        "set extraction.enforce_eager: true")
    if not vllm_has_extract_hidden_states():
        failures.append(f"the installed vLLM {vllm.__version__} lacks the `extract_hidden_states` speculative "
                        "method: install vLLM >= 0.17 (pyproject extras `cpu` or `gpu`)")
    if config.vocab.draft_vocab_size > vocab > 0:
        failures.append(f"vocab.draft_vocab_size {config.vocab.draft_vocab_size} is larger than the target's "
                        f"vocabulary ({vocab}): set it to at most {vocab}")
    try:
        tok = load_tokenizer(config.target)
        probe_msgs = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
        if "pong" not in tok.apply_chat_template(probe_msgs, tokenize=False):
            failures.append("the chat template drops the assistant's content: the loss mask would be empty")
    except Exception as err:  # DataError and template errors both end here with their own message
        failures.append(str(err))

    if config.promotion.dir and config.promotion.warm_start:
        from eyrie.export import verifier_name
        from eyrie.promote import check_base, current_version

        current = current_version(Path(config.promotion.dir))
        if current is not None:
            failures += check_base(current, verifier_name(config.target.model), config.vocab.draft_vocab_size,
                                   aux_ids)

    report = PreflightReport(probe.architecture, probe.vllm_class, probe.path, probe.reason, probe.language_model,
                             num_layers, hidden, vocab, aux_ids, captured_layer_ids(aux_ids, num_layers),
                             vllm.__version__)
    if tokens is not None and hidden:
        report.estimated_bytes = hidden_state_bytes(tokens, len(report.captured_layer_ids), hidden)
        run_dir.mkdir(parents=True, exist_ok=True)
        report.free_bytes = shutil.disk_usage(run_dir).free
        need = report.estimated_bytes + int(config.extraction.min_free_disk_gib * 2**30)
        if need > report.free_bytes:
            failures.append(f"hidden states need about {report.estimated_bytes / 2**30:.1f} GiB (+ "
                            f"{config.extraction.min_free_disk_gib} GiB head-room) but {run_dir} has "
                            f"{report.free_bytes / 2**30:.1f} GiB free: free space, use a larger volume for "
                            "--run-dir, or lower data.max_samples / data.max_length")
    report.failures = failures
    if failures and raise_on_failure:
        raise PreflightError(failures)
    return report
