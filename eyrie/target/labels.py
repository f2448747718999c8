"""Where the drafter's training labels approximate the target (issue 25 item 8).

speculators' EAGLE-3 trainer makes its label distribution from the target's last hidden state as
`verifier_lm_head(verifier_norm(h))`: an RMSNorm that multiplies by the target's final-norm weight, then a linear
head without bias, over the draft vocabulary. vLLM serves the target's own transform. Where the two differ, the
drafter learns a distribution the target does not sample from, and its acceptance is lower than its validation
says. `label_approximations` names each difference, read from the target's class and config, for any architecture:

- the head has a bias (`get_output_embeddings().bias`): speculators' head has none;
- the final norm is not an RMSNorm that multiplies by its weight: a numeric probe of the target's own norm module
  (materialized on the CPU from the meta model, weights set, a vector with a mean fed through) tells a LayerNorm
  (subtracts the mean, has a bias) and an offset RMSNorm (scales by 1 + weight, as Gemma's) from what speculators
  applies;
- the logits are soft-capped or scaled (any config attribute of the text config whose name says logit soft-capping,
  scaling or an output multiplier, set to other than the neutral value; attention's own soft-capping excluded:
  it is inside the target, captured in the hidden states);
- the input embeddings are scaled (a config attribute of an embedding multiplier or scale, or a scale the embedding
  module or the decoder holds, as Gemma's `embed_scale`): the drafter embeds tokens with the unscaled table. This
  does not change the labels, but the drafter's input is not what the target sees.

Preflight reports them (`label_warnings`) before anything loads.

`label_plan` decides which of them the trainer applies (eyrie/stages/train/patches/target_transform.py, from the
same detection, so preflight and the trainer agree): the target's own final norm module in place of speculators'
RMSNorm, the head's bias added to the label logits, and the logit transform the target's own forward applies after
its head (scaling, soft-capping: probed numerically by `probe_logits`, not read from a name). The embedding scale is
not applied: vLLM's EAGLE-3 drafter embeds its input tokens with an unscaled table (the target's shared
embedding, whose scale lives in the target's forward), so the unscaled table in training is what serving feeds it.
`label_report` is preflight's split of them into warnings (approximations left) and info lines ("applied: ...").
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from torch import nn

SOFTCAP = re.compile(r"(logit|output).*soft_?cap|soft_?cap.*(logit|output)", re.IGNORECASE)
LOGIT_SCALE = re.compile(
    r"^(logit|logits|output|lm_head|final_logit)_?(scale|scaling|multiplier|mult)s?$"
    r"|^(mup_)?output_(multiplier|mult|scale)"
    r"|^logit_(temperature|divisor)$",
    re.IGNORECASE,
)
EMBED_SCALE = re.compile(
    r"^(embedding|embeddings|embed|emb|input_embedding)_?(multiplier|mult|scale|scaling)$|^scale_emb(edding)?$",
    re.IGNORECASE,
)
SERVED_UNSCALED = (
    ", as vLLM's EAGLE-3 drafter does when it serves (not applied: a scale in training alone would make training "
    "differ from serving)"
)
NOT_OUTPUT = re.compile(r"attn|attention|router|rope|residual", re.IGNORECASE)


@dataclass
class Approximation:
    what: str  # short name: head bias, final norm, logit soft-capping, logit scaling, embedding scale
    source: str  # where it was read: `config.final_logit_softcapping`, `GPTNeoXForCausalLM.embed_out.bias`...
    detail: str  # what the target does that the labels do not
    applied: str = ""  # how the trainer applies the target's own transform instead ("": it does not)

    def message(self) -> str:
        return f"{self.what} ({self.source}): {self.detail}"


def _neutral(value) -> bool:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return True  # unset, a switch, or not a number: nothing to scale by
    return value in (0, 1) or math.isnan(value)


def _config_attributes(config) -> dict:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {k: v for k, v in vars(text).items() if not k.startswith("_")}


def _config_approximations(model) -> list[Approximation]:
    out = []
    for name, value in sorted(_config_attributes(model.config).items()):
        if NOT_OUTPUT.search(name):
            continue
        if SOFTCAP.search(name) and not _neutral(value):
            out.append(
                Approximation(
                    "logit soft-capping",
                    f"config.{name} = {value}",
                    f"the target's logits are {value} * tanh(logits / {value}); the labels are the head's raw logits",
                )
            )
        elif LOGIT_SCALE.search(name) and not _neutral(value):
            out.append(
                Approximation(
                    "logit scaling",
                    f"config.{name} = {value}",
                    "the target scales its logits by this (the sampling temperature it implies changes the label "
                    "distribution); the labels are the head's raw logits",
                )
            )
        elif EMBED_SCALE.search(name) and not _neutral(value):
            out.append(
                Approximation(
                    "embedding scale",
                    f"config.{name} = {value}",
                    "the target scales its input embeddings by this; the drafter embeds tokens with the unscaled table"
                    + SERVED_UNSCALED,
                )
            )
    return out


def _head_bias(model) -> list[Approximation]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "bias", None) is None:
        return []
    name = next((n for n, m in model.named_modules() if m is head), "lm_head")
    return [
        Approximation(
            "head bias",
            f"{type(model).__name__}.{name}.bias",
            "the target's output head adds a bias; speculators' verifier head has none, so every label misses it",
        )
    ]


def probe_norm(norm, hidden: int | None = None) -> str:
    """What the norm module computes, probed on the CPU: "rms" (x / rms(x) * weight: what speculators applies),
    "rms+1" (x / rms(x) * (1 + weight)), "layer" (subtracts the mean, then weight and bias), or "unknown"."""
    import torch

    try:
        probe = copy.deepcopy(norm).to_empty(device="cpu").float()
    except Exception:  # noqa: BLE001 - a module that cannot be copied is reported as not probed
        return "unknown"
    params = dict(probe.named_parameters(recurse=False))
    weight = params.get("weight")
    size = weight.shape[-1] if weight is not None else hidden
    if not size:
        return "unknown"
    gen = torch.Generator().manual_seed(0)
    x = (
        torch.randn(4, size, generator=gen, device="cpu") + 3.0
    )  # a clear mean: a LayerNorm removes it, an RMSNorm does not
    rms = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    centered = x - x.mean(-1, keepdim=True)
    layer = centered / torch.sqrt((centered * centered).mean(-1, keepdim=True) + 1e-6)

    def run(w: float) -> torch.Tensor | None:
        with torch.no_grad():
            for pname, p in params.items():
                p.fill_(w if pname == "weight" else 0.0)
            try:
                y = probe(x)
            except Exception:  # noqa: BLE001
                return None
        return (y[0] if isinstance(y, tuple) else y).float()

    zero, one = run(0.0), run(1.0)
    if zero is None or one is None:
        return "unknown"
    if torch.allclose(zero, rms, atol=1e-2) and torch.allclose(one, 2 * rms, atol=2e-2):
        return "rms+1"
    if torch.allclose(one, rms, atol=1e-2):
        return "rms"
    if torch.allclose(one, layer, atol=1e-2) or torch.allclose(zero, layer, atol=1e-2):
        return "layer"
    return "unknown"


def _final_norm_approximation(model) -> list[Approximation]:
    from eyrie.target.metadata import _final_norm

    found = _final_norm(model)
    if found is None:
        return []  # metadata refuses such a target itself (no final norm to borrow)
    name, norm = found[0], cast("nn.Module", found[1])
    kind = probe_norm(norm, getattr(model.config.get_text_config(), "hidden_size", None))
    source = f"{type(model).__name__}.{name} ({type(norm).__name__})"
    has_bias = any(n == "bias" for n, _ in norm.named_parameters(recurse=False))
    if kind == "rms" and not has_bias:
        return []
    detail = {
        "rms+1": "the target's final norm scales by (1 + weight); speculators' RMSNorm scales by the weight alone",
        "layer": "the target's final norm is a LayerNorm (subtracts the mean"
        + (", adds a bias" if has_bias else "")
        + "); speculators applies an RMSNorm with its weight",
        "rms": "the target's final norm adds a bias; speculators' RMSNorm has none",
        "unknown": "the target's final norm is not an RMSNorm that multiplies by its weight (or could not be "
        "probed); speculators applies one",
    }[kind]
    return [Approximation("final norm", source, detail)]


EMBED_SCALE_ATTR = re.compile(r"^(embed_scale|embedding_scale|embed_multiplier|normalizer|scale_emb)$")


def _embedding_scale_in_code(model, found: list[Approximation]) -> list[Approximation]:
    """An embedding scale the class holds rather than the config names: a scale attribute on the embedding module
    or the decoder (Gemma's scaled word embedding, `embed_scale` = sqrt(hidden_size))."""
    if any(a.what == "embedding scale" for a in found):
        return []
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for module in (embed, decoder):
        if module is None:
            continue
        for name in [*vars(module), *getattr(module, "_buffers", {})]:  # plain attributes and buffers
            value = getattr(module, name, None)
            if not EMBED_SCALE_ATTR.match(name) or value is None:
                continue
            if hasattr(value, "numel") and value.numel() == 1 and value.device.type != "meta":
                value = float(value)
            if isinstance(value, (int, float)) and _neutral(value):
                continue
            shown = f" = {round(value, 4)}" if isinstance(value, float) else ""
            return [
                Approximation(
                    "embedding scale",
                    f"{type(module).__name__}.{name}{shown}",
                    "the target scales its input embeddings; the drafter embeds tokens with the unscaled table"
                    + SERVED_UNSCALED,
                )
            ]
    return []


def label_approximations(model) -> list[Approximation]:
    """Each way speculators' labels (and the drafter's input embedding) approximate `model`, a transformers
    causal LM (built on the meta device is enough: the final norm is probed on a CPU copy). The probes run on the
    CPU whatever the default device is: the GPU trainer builds its drafter under a CUDA default device."""
    import torch

    with torch.device("cpu"):
        found = [*_head_bias(model), *_final_norm_approximation(model), *_config_approximations(model)]
        return [*found, *_embedding_scale_in_code(model, found)]


def label_warnings(target, cfg: dict) -> list[str]:
    """Preflight's report: one line per approximation of the target `target` (its config.json dict `cfg`), built
    on the meta device (no weights read). A target transformers cannot build is left to the borrowed-weights check,
    which refuses it with its own message."""
    from eyrie.target.metadata import _meta_model

    try:
        model = _meta_model(target, cfg)
    except Exception:  # noqa: BLE001 - resolve_borrowed_weights reports it
        return []
    return [
        f"the drafter's training labels approximate {target.model}: {a.message()}. Acceptance in vLLM will be "
        "lower than validation predicts by what this costs; the train/serve gap in the evaluation report measures it"
        for a in label_approximations(model)
    ]


# ---------------------------------------------------------------------------------------------------------------
# What the trainer applies


@dataclass
class LogitTransform:
    """What the target's forward does to its head's output: `cap * tanh(scale * raw / cap)`, or `scale * raw`
    when `cap` is None (a logit scale, or Granite's division, is a scale; Gemma-2's soft-cap is scale 1, cap c)."""

    scale: float = 1.0
    cap: float | None = None

    def __call__(self, raw):
        if self.cap is None:
            return raw * self.scale
        import torch

        return self.cap * torch.tanh(raw * (self.scale / self.cap))

    def describe(self) -> str:
        if self.cap is None:
            return f"logits * {self.scale:.6g}"
        inner = "logits" if self.scale == 1.0 else f"{self.scale:.6g} * logits"
        return f"{self.cap:.6g} * tanh({inner} / {self.cap:.6g})"


def _child_parent(model, module) -> tuple[object, str, str] | None:
    for name, m in model.named_modules():
        if m is module and name:
            parent_name, _, attr = name.rpartition(".")
            return model.get_submodule(parent_name) if parent_name else model, attr, name
    return None


def probe_logits(model) -> LogitTransform | None:
    """The transform the target's own forward applies after its head, measured: the decoder is stubbed to return
    a probe vector as its hidden state and the head replaced by the identity, so the CausalLM's forward returns
    f(probe) for the values fed. Identity gives LogitTransform(1.0); a scale or a tanh soft-cap (with a scale
    inside) is recognised by its shape; anything else, or a forward that cannot run this way, gives None. `model`
    may be on the meta device (only the forward's code after the decoder runs); it is left as it was."""
    import torch
    from torch import nn
    from transformers.modeling_outputs import BaseModelOutputWithPast

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    where = _child_parent(model, head) if head is not None else None
    if decoder is None or where is None:
        return None
    parent, attr, _ = where
    t = torch.cat([torch.tensor([1e-2, -1e-2]), torch.linspace(-60.0, 60.0, 121), torch.tensor([1e4, -1e4])]).reshape(
        1, 1, -1
    )

    def stub(*args, **kwargs):
        return BaseModelOutputWithPast(last_hidden_state=t)

    decoder.forward = stub
    setattr(parent, attr, nn.Identity())
    try:
        with torch.no_grad():
            out = model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=False)
        y = (out.logits if hasattr(out, "logits") else out[0]).double().flatten()
    except Exception:  # noqa: BLE001 - a forward that cannot run stubbed is not probed
        return None
    finally:
        del decoder.forward
        setattr(parent, attr, head)
    x = t.double().flatten()
    if y.shape != x.shape or not torch.isfinite(y).all():
        return None
    scale = float(y[0] / x[0])
    if torch.allclose(y, scale * x, rtol=1e-4, atol=1e-6):
        return LogitTransform(1.0 if abs(scale - 1) < 1e-5 else scale)
    cap = float(y[-2])
    if cap > 0 and torch.allclose(y, cap * torch.tanh(x * (scale / cap)), rtol=1e-4, atol=1e-5):
        return LogitTransform(1.0 if abs(scale - 1) < 1e-5 else scale, cap)
    return None


@dataclass
class LabelPlan:
    """What the trainer applies so the labels are the target's own distribution: the final norm module to apply
    as the target's own (its name in the target), the head whose bias is added (its name), the logit transform,
    and every approximation, each with `applied` set where the plan covers it."""

    norm: str | None
    head: str | None
    logits: LogitTransform | None
    approximations: list[Approximation]


LOGIT_KINDS = ("logit soft-capping", "logit scaling")


def label_plan(model) -> LabelPlan:
    """`label_approximations(model)` and what the trainer applies of them (eyrie/stages/train/patches/
    target_transform.py builds it from the target's own files in the trainer process), probed on the CPU as
    `label_approximations` is."""
    import torch

    with torch.device("cpu"):
        return _label_plan(model)


def _label_plan(model) -> LabelPlan:
    from eyrie.target.metadata import _final_norm

    found = label_approximations(model)
    norm = head = None
    for a in found:
        if a.what == "final norm":
            final = _final_norm(model)
            if final is not None:
                norm = final[0]
                a.applied = (
                    f"the labels apply the target's own final norm ({type(final[1]).__name__}, its tensors read "
                    "from the checkpoint) in place of speculators' RMSNorm"
                )
        elif a.what == "head bias":
            where = _child_parent(model, model.get_output_embeddings())
            if where is not None:
                head = where[2]
                a.applied = "the labels add the head's bias (its draft-vocabulary rows) to the verifier logits"
    probed = probe_logits(model)
    logits = probed if probed is not None and (probed.scale != 1.0 or probed.cap is not None) else None
    if logits is not None:
        applied = (
            f"the labels apply the target's logit transform, {logits.describe()} (measured from the target's "
            "own forward), before their softmax"
        )
        named = [a for a in found if a.what in LOGIT_KINDS]
        if not named:
            kind = LOGIT_KINDS[0] if logits.cap is not None else LOGIT_KINDS[1]
            named = [
                Approximation(
                    kind,
                    f"{type(model).__name__}.forward",
                    f"the target's logits are {logits.describe()}; the labels are the head's raw logits",
                )
            ]
            found.append(named[0])
        for a in named:
            a.applied = applied
    return LabelPlan(norm, head, logits, found)


def label_report(target, cfg: dict) -> tuple[list[str], list[str]]:
    """Preflight's lines for the target's label approximations: (warnings: each approximation the trainer cannot
    apply, as `label_warnings` words it; infos: "applied: ..." for each one it applies)."""
    from eyrie.target.metadata import _meta_model

    try:
        model = _meta_model(target, cfg)
    except Exception:  # noqa: BLE001 - resolve_borrowed_weights reports it
        return [], []
    plan = label_plan(model)
    cost = (
        " Acceptance in vLLM will be lower than validation predicts by what this costs; the train/serve gap in the "
        "evaluation report measures it"
    )
    warnings = [
        f"the drafter's training labels approximate {target.model}: {a.message()}."
        + ("" if a.what == "embedding scale" else cost)  # not a label: training feeds the drafter what vLLM does
        for a in plan.approximations
        if not a.applied
    ]
    infos = [f"applied: {a.what} ({a.source}): {a.applied}" for a in plan.approximations if a.applied]
    return warnings, infos
