"""The target model, read from metadata only: where it lives, its config and tokenizer, its identity, and the names
of the tensors an EAGLE-3 drafter borrows from it.

A drafter is trained against three of the target's tensors: the input embedding (the drafter's token embedding),
the final norm and the output head (together they turn the target's last hidden state into the label
distribution). Their names differ by architecture (`model.embed_tokens`, `gpt_neox.embed_in`, `transformer.wte`,
`language_model.model.embed_tokens`...). They are resolved here, once, by building the target's transformers class
on the meta device (no memory, no weights) and asking it for its embedding, head and decoder, then matched against
the checkpoint's own tensor names (safetensors index or headers). Preflight refuses a target whose names cannot be
resolved; the trainer is handed the resolved names, so nothing is guessed after extraction.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from eyrie.config import TargetConfig
from eyrie.errors import ConfigError, DataError
from eyrie.run.files import sha256_json
from eyrie.run.identity import STAGES, drafter_identity, folder_identity, key
from eyrie.target.hub import hub_commit

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# The config keys vLLM derives its longest context from (the smallest present wins), as in its own model config.
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def is_local_model(model: str) -> bool:
    """A folder (existing, or not shaped like a hub id `org/name`) rather than a Hugging Face hub id."""
    return Path(model).exists() or not HUB_ID.match(model)


def is_local_target(target: TargetConfig) -> bool:
    return is_local_model(target.model)


def verifier_name(target_model: str) -> str:
    """How a drafter names its target: an absolute path for a local folder, else the hub id."""
    return str(Path(target_model).resolve()) if is_local_model(target_model) else target_model


def check_target_folder(target: TargetConfig) -> None:
    """A missing or unreadable local target is a config error, raised before anything else."""
    if not is_local_target(target):
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise ConfigError(
                f"target.model {target.model!r} is neither a local folder nor reachable "
                "(HF_HUB_OFFLINE=1): download it first, or point target.model at the folder"
            )
        return
    path = Path(target.model)
    if not path.is_dir():
        raise ConfigError(
            f"target.model {path} does not exist: point it at the folder holding the target's "
            "config.json and weights (or a Hugging Face hub id)"
        )
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


def context_limit(cfg: dict) -> int | None:
    """The longest context vLLM derives from the config (None when it names none): a larger max_model_len is
    refused when the server starts."""
    text = text_config(cfg)
    limits = [int(text[k]) for k in CONTEXT_KEYS if isinstance(text.get(k), int)]
    if not limits:
        return None
    rope = text.get("rope_scaling") or {}
    factor = rope.get("factor") if rope.get("rope_type", rope.get("type")) in ("yarn", "linear", "dynamic") else 1
    return int(min(limits) * (factor or 1))


def load_hf_config(target: TargetConfig):
    """The target's transformers config. A model type transformers knows is read with its own class, as vLLM does
    (no remote code runs, and a folder holding only config.json and the weight index is enough); other types take
    the target's own code when target.trust_remote_code allows it."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    native = read_target_config(target).get("model_type") in CONFIG_MAPPING
    return AutoConfig.from_pretrained(
        target.model, revision=target.revision, trust_remote_code=target.trust_remote_code and not native
    )


def load_tokenizer(target: TargetConfig):
    from transformers import AutoTokenizer

    check_target_folder(target)
    try:
        tok = AutoTokenizer.from_pretrained(
            target.model, revision=target.revision, trust_remote_code=target.trust_remote_code
        )
    except Exception as err:
        hint = (
            " The target ships its own tokenizer code: set target.trust_remote_code: true if you trust it."
            if "trust_remote_code" in str(err)
            else ""
        )
        raise DataError(f"cannot load the tokenizer of {target.model}: {err}.{hint}") from None
    if not getattr(tok, "chat_template", None):
        raise DataError(
            f"the tokenizer of {target.model} has no chat template: add `chat_template` to its "
            "tokenizer_config.json (or a chat_template.jinja file), or use the instruct model"
        )
    return tok


def mask_token_id(tokenizer, vocab_size: int) -> int | None:
    """The token id speculators' trainer masks with, resolved from the tokenizer as speculators would (its own
    mask token; else the `<|MASK|>` it would add in an unused embedding row; else pad, eos or unk). Passing it
    spares the trainer speculators' AutoProcessor, which some multimodal targets (Kimi-K2.5) cannot build."""
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    return next(
        (t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) if t is not None), None
    )


COMMIT = re.compile(r"^[0-9a-f]{40}$")
_COMMITS: dict[tuple[str, str], str] = {}


def _pinned_commit(model: str, revision: str | None) -> str:
    """The commit a hub target's revision resolves to; asked once per process for a commit (what a run pins), so
    800 shard keys ask the hub nothing; a branch or tag is asked every time (it may move)."""
    if revision and COMMIT.match(revision):
        if (model, revision) not in _COMMITS:
            _COMMITS[(model, revision)] = hub_commit(model, "model", revision)
        return _COMMITS[(model, revision)]
    return hub_commit(model, "model", revision)


def file_identity(kind: str, target: TargetConfig | None, drafter: str | Path | None = None) -> object:
    """The identity of one kind of input file (`eyrie.run.identity.FILE_KINDS`). A local target's files by content,
    wherever the folder is; a hub target's by its id and the commit its revision resolves to now (a run pins it at
    its start, so a moving branch such as `main` gives a new identity when it moves)."""
    if kind == "drafter":
        return drafter_identity(drafter)
    if target is None:
        raise TypeError(f"the {kind} identity needs the target")
    if not is_local_target(target):
        return ["hub", target.model, _pinned_commit(target.model, target.revision)]
    folder = Path(target.model)
    if not folder.is_dir():
        return ["missing", str(folder)]
    return folder_identity(folder, kind)


def stage_key(
    stage: str, config, *, target: TargetConfig | None = None, drafter: str | Path | None = None, **upstream
) -> str:
    """`eyrie.run.identity.key` of `stage`, with the identities of the files it declares: the target's (of
    `config.target`, or `target`) and the drafter's (`drafter`; None when there is none)."""
    target = target if target is not None else getattr(config, "target", None)
    files = {kind: file_identity(kind, target, drafter) for kind in STAGES[stage].files}
    return key(stage, config, files, **upstream)


def target_identity(target: TargetConfig) -> str:
    """What the target computes, by content: its weights, config.json and own code (`file_identity`)."""
    return sha256_json(file_identity("target", target))[:16]


def tokenizer_files_identity(target: TargetConfig) -> str:
    """The target's tokenizer and processor files by content (a slow tokenizer's vocabulary and merges, a
    tiktoken model, the chat template file...); a hub target: its pinned commit."""
    return sha256_json(file_identity("tokenizer", target))[:16]


# ---------------------------------------------------------------------------------------------------------------
# The tensors a drafter borrows


class TargetError(ValueError):
    """The target cannot carry an EAGLE-3 drafter for a reason its metadata shows; the message says the fix."""


@dataclass
class BorrowedWeights:
    """Checkpoint names of the target tensors the drafter is trained against."""

    embed_tokens: str
    lm_head: str | None  # None: the head is tied to the embedding (no tensor of its own in the checkpoint)
    norm: str
    norm_class: str  # the final norm's transformers class (speculators applies it as an RMSNorm)

    def speculators_names(self) -> dict[str, str]:
        """speculators' own names for these tensors -> the checkpoint's (what `train_entry` hands its loader)."""
        names = {"embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if self.lm_head:
            names["lm_head.weight"] = self.lm_head
        return names


def checkpoint_tensor_names(target: TargetConfig) -> list[str]:
    """Every tensor name in the target's checkpoint, from its safetensors index or headers (no tensor is read)."""
    if not is_local_target(target):
        from huggingface_hub import get_safetensors_metadata

        meta = get_safetensors_metadata(target.model, revision=target.revision)
        return [n for f in meta.files_metadata.values() for n in f.tensors]
    folder = Path(target.model)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TargetError(
            f"{folder} has no safetensors weights (no model.safetensors.index.json or *.safetensors): "
            "convert the checkpoint to safetensors, which vLLM and speculators read"
        )
    from safetensors import safe_open  # reads each file's header only

    names = []
    for f in files:
        with safe_open(str(f), framework="pt") as opened:
            names += list(opened.keys())
    return names


def _meta_model(target: TargetConfig, cfg: dict):
    """The target's transformers model built on the meta device: module names and structure, no memory."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    hf_config = load_hf_config(target)
    remote = not type(hf_config).__module__.startswith("transformers.")  # the target's own code was loaded
    arch = (cfg.get("architectures") or [""])[0]
    cls = getattr(transformers, arch, None)
    with torch.device("meta"):
        if cls is not None:
            return cls._from_config(hf_config)
        try:
            return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=remote)
        except ValueError:
            # A multimodal wrapper transformers has no class for (Kimi-K2.5): its text backbone carries the
            # embedding, norm and head; the checkpoint's names for them share the backbone's dotted tails.
            text = hf_config.get_text_config()
            if text is hf_config:
                raise
            return AutoModelForCausalLM.from_config(text, trust_remote_code=remote)


def _final_norm(model) -> tuple[str, object] | None:
    """The decoder's final norm: the last norm module directly under the decoder (outside its layer list)."""
    from torch import nn

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None:
        return None
    found = None
    for name, child in decoder.named_children():
        if not isinstance(child, (nn.ModuleList, nn.Embedding)) and "norm" in type(child).__name__.lower():
            found = (name, child)
    if found is None:
        return None
    full = {id(m): n for n, m in model.named_modules()}[id(found[1])]
    return full, found[1]


def match_checkpoint_name(module_name: str, names: list[str]) -> str | None:
    """The checkpoint tensor for a module parameter name: the same name, or the one tensor sharing its longest
    dotted tail (checkpoints and classes often differ only in a prefix, e.g. `language_model.model.` vs
    `model.language_model.`). None when nothing or more than one tensor matches."""
    if module_name in names:
        return module_name
    parts = module_name.split(".")
    for n in range(len(parts), 1, -1):
        tail = "." + ".".join(parts[-n:])
        hits = [k for k in names if k.endswith(tail) or k == tail[1:]]
        if len(hits) == 1:
            return hits[0]
        if hits:
            return None
    return None


IN_A_LAYER = re.compile(r"\.\d+\.")


def loaded_names(model, names: list[str]) -> dict[str, str]:
    """The name transformers loads each checkpoint tensor under -> the checkpoint's name, by transformers' own
    renaming rules for the class (GPT-NeoX stores its head as `embed_out`, loaded as `lm_head`). Tensors inside
    numbered layers are skipped: the borrowed ones never are, and a 1T-parameter index holds ~200,000 names."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    transforms = get_model_conversion_mapping(model)
    loaded: dict[str, str] = {}
    for name in names:
        if IN_A_LAYER.search(name):
            continue
        key = name
        for transform in transforms:
            key, _ = transform.rename_source_key(key)
        loaded.setdefault(key, name)
    return loaded


def resolve_borrowed_weights(target: TargetConfig, cfg: dict, names: list[str] | None = None) -> BorrowedWeights:
    """Resolve the embedding, final norm and head the drafter borrows, and check each is in the checkpoint."""
    names = checkpoint_tensor_names(target) if names is None else names
    try:
        model = _meta_model(target, cfg)
    except Exception as err:
        raise TargetError(
            f"transformers cannot build {target.model}'s architecture to find its embedding and head "
            f"({type(err).__name__}: {err}); install a transformers that knows it, or set "
            "target.trust_remote_code: true if the target ships its own code"
        ) from None
    loaded = loaded_names(model, names)
    modules = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    norm = _final_norm(model)
    if embed is None or id(embed) not in modules or norm is None:
        raise TargetError(f"{type(model).__name__} exposes no input embedding or final norm to build a drafter from")
    wanted = {"input embedding": modules[id(embed)] + ".weight", "final norm": norm[0] + ".weight"}
    tied = head is None or head.weight is embed.weight
    if not tied:
        wanted["output head"] = modules[id(head)] + ".weight"
    found, missing = {}, []
    for what, module_name in wanted.items():
        key = match_checkpoint_name(module_name, list(loaded))
        if key is None:
            missing.append(f"{what} `{module_name}`")
        found[what] = loaded.get(key) if key else None
    if missing == [f"output head `{wanted.get('output head')}`"] and model.config.get_text_config().tie_word_embeddings:
        missing, found["output head"] = [], None  # a tied head that the checkpoint does not store
    if missing:
        raise TargetError(
            f"{target.model}'s checkpoint has no tensor for the {', '.join(missing)} of "
            f"{type(model).__name__} (looked for the name and its suffixes among {len(names)} "
            "tensors): the checkpoint does not match its config.json, or it is incomplete"
        )
    embed, head_name, final_norm = found["input embedding"], found.get("output head"), found["final norm"]
    assert embed and final_norm  # both were required above
    return BorrowedWeights(embed, head_name, final_norm, type(norm[1]).__name__)
