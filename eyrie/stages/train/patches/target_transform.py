"""The drafter's training labels made with the target's own transform (issue 25 item 8).

speculators' EAGLE-3 labels are `verifier_lm_head(verifier_norm(h))` over the draft vocabulary: an RMSNorm scaled
by the target's final-norm weight and a head without bias. Where the target does otherwise
(`eyrie.target.labels.label_plan`, the same detection preflight reports), the trainer makes its labels the
target's own way, decided here in the trainer process from the target's own files (its config, its class built on
the meta device, its checkpoint), for any architecture:

- final norm: `verifier_norm` becomes the target's own final norm module, run on the target's tensors read from the
  checkpoint (a LayerNorm with its weight and bias, Gemma's (1 + weight) RMSNorm, a norm with a bias, any other
  kind): the module's own code, called with `torch.func.functional_call`;
- head bias: the bias's draft-vocabulary rows are added to `verifier_lm_head`'s output;
- logit transform: the scaling or soft-capping the target's forward applies after its head
  (`eyrie.target.labels.probe_logits`, measured from that forward) is applied to `verifier_lm_head`'s output,
  before the label softmax.

Only the labels change. `verifier_norm` keeps its one saved name (`verifier_norm.weight`, which speculators leaves
out of every save); the norm's other tensors and the head's bias are non-persistent buffers, and the logit
transform is a forward hook, so checkpoints and the exported drafter hold exactly the tensors they held before
(the drafter's own `lm_head`, `norm` and `embed_tokens` are untouched): what vLLM loads does not change.

The embedding scale is not applied: vLLM's EAGLE-3 drafter embeds tokens with an unscaled table (the target's
shared embedding; the scale lives in the target's forward), so the unscaled table in training is what serving
feeds the drafter.

`train.target_transform: false` (the trainer's options file, eyrie/stages/train/options.py) leaves speculators'
labels as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

OFF = "train.target_transform: false"


class TargetNorm(nn.Module):
    """The target's own final norm module (kept on the meta device, unregistered: its code and attributes such as
    its epsilon, no tensors) run on tensors this module holds: `weight` (speculators' `verifier_norm.weight`, which
    it loads and never saves) and the norm's other tensors as non-persistent buffers. Computed in float32, returned
    in the input's dtype."""

    target_module: nn.Module

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor], like: torch.Tensor):
        super().__init__()
        object.__setattr__(self, "target_module", module)
        weight = tensors.get("weight")
        self.weight = nn.Parameter(
            (weight if weight is not None else torch.ones_like(like)).to(like), requires_grad=False
        )
        self.names = {n: n.replace(".", "__") for n in tensors if n != "weight"}
        for name, buffer in self.names.items():
            self.register_buffer(buffer, tensors[name].to(device=like.device, dtype=like.dtype), persistent=False)
        self.has_weight = weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = {name: getattr(self, buffer).float() for name, buffer in self.names.items()}
        if self.has_weight:
            tensors["weight"] = self.weight.float()
        y = torch.func.functional_call(self.target_module, tensors, (x.float(),))
        return (y[0] if isinstance(y, tuple) else y).to(x.dtype)


def _checkpoint(path: Path) -> dict[str, Path]:
    """Each tensor name of the safetensors checkpoint in `path` -> its file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {n: path / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as opened:
            files.update(dict.fromkeys(opened.keys(), f))
    return files


def _read(
    path: Path, files: dict[str, Path], loaded: dict[str, str], module_names: list[str]
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors for the target's module parameter names (the class's names, as transformers
    renames the checkpoint's: GPT-NeoX's `embed_out`, a multimodal prefix), float32. A name not in the checkpoint
    is an error that names it."""
    from safetensors import safe_open

    from eyrie.target.metadata import match_checkpoint_name

    names = list(files)
    out = {}
    for name in module_names:
        key = loaded.get(name) or match_checkpoint_name(name, names)
        if key is None:
            raise ValueError(
                f"the target's labels need its tensor `{name}`, which the checkpoint in {path} does not hold "
                f"(looked for it and for one tensor sharing its dotted tail); set {OFF} "
                "to train with speculators' labels"
            )
        if not files[key].is_file():
            raise ValueError(
                f"the target's labels need its tensor `{key}`, in {files[key].name}, which is not in {path}: "
                "fetch the target's weight files whole"
            )
        with safe_open(str(files[key]), framework="pt") as opened:
            out[name] = opened.get_tensor(key).float()
    return out


def apply_target_transform(model, verifier: str | Path, trust_remote_code: bool = False, log=print):
    """Make `model`'s (an Eagle3DraftModel with its verifier weights loaded) labels the target's own, for the
    target in the local folder `verifier`. Returns the plan applied (`eyrie.target.labels.LabelPlan`)."""
    from eyrie.config import TargetConfig
    from eyrie.target.labels import label_plan
    from eyrie.target.metadata import _meta_model, loaded_names

    path = Path(verifier)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"the drafter's verifier {verifier} is not a local folder with a config.json, so the labels cannot be "
            f"made with the target's own transform; give the trainer the target's folder, or set {OFF}"
        )
    target = TargetConfig(model=str(path), trust_remote_code=trust_remote_code)
    meta = _meta_model(target, json.loads((path / "config.json").read_text()))
    plan = label_plan(meta)
    files = _checkpoint(path)
    loaded = loaded_names(meta, list(files))  # the class's names -> the checkpoint's, by transformers' own rules
    like = model.verifier_lm_head.weight
    if plan.norm is not None:
        norm = meta.get_submodule(plan.norm)
        wanted = [n for n, _ in norm.named_parameters()] + [n for n, _ in norm.named_buffers()]
        tensors = _read(path, files, loaded, [f"{plan.norm}.{n}" for n in wanted])
        tensors = {n[len(plan.norm) + 1 :]: t for n, t in tensors.items()}
        model.verifier_norm = TargetNorm(norm, tensors, like=model.verifier_norm.weight)
    head = model.verifier_lm_head
    for handle in getattr(head, "eyrie_label_hooks", []):
        handle.remove()
    head.eyrie_label_hooks = []
    bias = None
    if plan.head is not None:
        bias = _read(path, files, loaded, [f"{plan.head}.bias"])[f"{plan.head}.bias"]
        if model.use_draft_vocab:
            bias = bias[model.t2d.to(device=bias.device, dtype=torch.bool)]
        head.register_buffer("eyrie_label_bias", bias.to(like), persistent=False)
    logits = plan.logits
    if bias is not None or logits is not None:

        def label_logits(module, inputs, output):
            if bias is not None:
                output = output + module.eyrie_label_bias.to(output.dtype)
            return logits(output) if logits is not None else output

        head.eyrie_label_hooks = [head.register_forward_hook(label_logits)]
    for a in plan.approximations:
        if a.applied:
            log(f"eyrie: applied: {a.what} ({a.source}): {a.applied}", flush=True)
        else:
            log(f"eyrie: the labels still approximate the target: {a.message()}", flush=True)
    return plan
