"""EAGLE-3 for target classes that lack vLLM's `SupportsEagle3` interface.

vLLM checks the interface on the built model, in the model runner, just before it asks for aux hidden states
(`_setup_eagle3_aux_hidden_state_outputs`); without it the run dies after the whole load. Eyrie wraps that one
method: when aux outputs are requested and the model lacks the interface, the model instance is given a subclass
with the class flag, `set_aux_hidden_state_layers`, the default ids (2, L//2, L-3) and a forward that also returns
the residual stream entering each requested decoder layer (vLLM's convention; id L is the last layer's output).
The stream is read with forward hooks on the decoder layers found under `model.layers`, `decoder.layers`, `h`, or a
wrapper's `language_model`. How a layer's outputs make the stream differs between vLLM's classes (a delta and the
residual to add, or the stream itself beside the layer's input); it is measured on the model's own first forward
pass, at its final norm (`_Capture`), for whatever class is served. For serving a drafter, the target's
embeddings are also exposed where vLLM's proposer looks for them (`model.embed_tokens`). Classes that implement
the interface are never touched. Hooks need eager execution (`enforce_eager`), which preflight checks.

vLLM has two model runners, and each asks for the interface in its own place: V1 (`GPUModelRunner`, the only one on
the CPU build up to 0.33, which has no Triton) in `_setup_eagle3_aux_hidden_state_outputs`; Model Runner V2
(`vllm.v1.worker.gpu`, what GPU vLLM picks when Triton is present) in `eagle3_utils.set_eagle3_aux_hidden_state_layers`,
called right after the load, which raises "Model does not support EAGLE3 interface". Both are wrapped, each where
the installed vLLM has it (`HOOKS`); `missing_hooks` names a runner whose hook this vLLM lacks, for preflight to
refuse before any load. vLLM 0.34 removed V1 (its module is gone, so only V2's hook is installed): its GPU runner
and its CPU one (`vllm.v1.worker.cpu.model_runner`, a subclass of V2's) both call V2's hook, with
`(model, spec_config, use_pp)`; the wrapper passes on whatever follows the model.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

_INSTALLED = "_eyrie_eagle3_compat"
# Under vLLM's logger, so the line lands in the server log with vLLM's own.
logger = logging.getLogger("vllm.eyrie.compat")


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder's layer list, unwrapping a multimodal wrapper's language model the way vLLM does."""
    get_language_model = getattr(model, "get_language_model", None)
    parent = get_language_model() if callable(get_language_model) else getattr(model, "language_model", model)
    holder = getattr(parent, "model", parent)
    for path in ("layers", "decoder.layers", "h", "transformer.h", "model.layers"):
        obj = holder
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    return None


# How a decoder layer's outputs make the residual stream. vLLM's layers do not share one contract: most take the
# residual apart and return (delta, residual), summed by the next layer's fused add-norm (SUM); others return the
# full stream first, and their second output is the layer's input or a partial residual already inside it (FIRST:
# Cohere's parallel block, StableLM). The same forward signature can hide either, so the contract is measured, not
# read off a list or a signature: see `_Capture.probe`.
SUM, FIRST = "sum", "first"
PROBE_TOLERANCE = 0.05  # relative L2 a candidate must reproduce the final norm's output within (bf16 rounding)


def _pair(hs, residual) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(hs, tuple):  # a layer's tuple output
        hs, residual = hs[0], (hs[1] if len(hs) > 1 and isinstance(hs[1], torch.Tensor) else None)
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != hs.shape):
        residual = None
    return hs, residual


def _signature_guess(layer: nn.Module) -> str:
    """The contract a layer's signature suggests, used only until (or where) the probe cannot decide: a layer that
    takes `residual` returns (delta, residual)."""
    return SUM if "residual" in inspect.signature(layer.forward).parameters else FIRST


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _first_tensor(out):
    return out[0] if isinstance(out, tuple) else out


class _Capture:
    """Hooks on the decoder layers that keep the stream entering each requested layer (and leaving the last), and a
    probe that decides the model's output contract from its own computation.

    The probe: the module the decoder calls right after its last layer (the final norm) normalises the stream. On the
    first forward pass where the last layer's second output is a tensor, its two candidate streams (the sum of the
    outputs, and the first alone) are each put through that same module, and the one reproducing what the model
    itself computed there (within `PROBE_TOLERANCE`, the other clearly not) is the contract, for every layer: the
    model's loop passes (hidden_states, residual) between its layers alike. Until it is decided (vLLM's profile run
    decides it, before any request) and where it cannot be (a norm that needs more than the stream), the signature's
    guess stands and the server log says so."""

    def __init__(self, model_name: str, layers: nn.ModuleList, ids: tuple[int, ...], after: list[nn.Module]):
        self.ids = ids
        self.model_name = model_name
        self.out: dict[int, dict[str, torch.Tensor]] = {}
        self.contract: str | None = None
        self.guess = _signature_guess(layers[0])
        self._pending: dict[str, torch.Tensor] | None = None
        self._probing = False
        self._warned = False
        n = self.n = len(layers)
        for k in ids:
            if k < n:
                params = list(inspect.signature(layers[k].forward).parameters)
                layers[k].register_forward_pre_hook(
                    lambda m, a, kw, k=k, params=params: self._keep(k, *self._inputs(params, a, kw)), with_kwargs=True
                )
            elif k != n:
                raise ValueError(f"aux hidden state layer {k} is beyond the model's {n} layers")
        layers[n - 1].register_forward_hook(self._last_layer)
        for module in after:
            module.register_forward_hook(self._after_last)

    @staticmethod
    def _inputs(params, args, kwargs):
        bound = dict(zip(params, args), **kwargs)
        return bound.get("hidden_states", args[0] if args else None), bound.get("residual")

    def _candidates(self, hs, residual) -> dict[str, torch.Tensor]:
        hs, residual = _pair(hs, residual)
        if residual is None:
            return {SUM: hs, FIRST: hs}
        if self.contract == SUM:
            return {SUM: hs + residual}
        if self.contract == FIRST:
            return {FIRST: hs.clone()}  # a copy: a fused add-norm may update its inputs in place
        return {SUM: hs + residual, FIRST: hs.clone()}

    def _keep(self, k: int, hs, residual) -> None:
        if not self._probing:
            self.out[k] = self._candidates(hs, residual)

    def _last_layer(self, module, args, out) -> None:
        if self._probing:
            return
        cands = self._candidates(out, None)
        if self.n in self.ids:  # id L: the last layer's output, before the final norm
            self.out[self.n] = cands
        self._pending = cands if self.contract is None and len(cands) == 2 and cands[SUM] is not cands[FIRST] else None

    def _after_last(self, module, args, out) -> None:
        """The first module the decoder runs after its last layer: the probe, while undecided."""
        pending, self._pending = self._pending, None
        if pending is None or self._probing or self.contract is not None:
            return
        seen = _first_tensor(out)
        if not isinstance(seen, torch.Tensor) or seen.shape != pending[SUM].shape:
            return
        self._probing = True
        try:
            errs = {c: _rel(_first_tensor(module(x.clone())), seen) for c, x in pending.items()}
        except Exception:  # noqa: BLE001 - a module that needs more than the stream cannot be the probe
            return
        finally:
            self._probing = False
        best, other = sorted(errs, key=errs.__getitem__)
        if errs[best] <= PROBE_TOLERANCE and errs[other] > 4 * errs[best] + 1e-3:
            self.contract = best
            logger.info(
                "Eyrie's EAGLE-3 compatibility layer: %s's decoder layers return %s (measured at its final norm: "
                "relative L2 %.4f for the sum of a layer's outputs, %.4f for the first alone)",
                self.model_name,
                "a delta and the residual, summed" if best == SUM else "the full residual stream first",
                errs[SUM],
                errs[FIRST],
            )

    def collect(self) -> list[torch.Tensor]:
        out, self.out = self.out, {}
        contract = self.contract or self.guess
        if (
            self.contract is None
            and not self._warned
            and any(len(c) == 2 and c[SUM] is not c[FIRST] for c in out.values())
        ):
            self._warned = True
            logger.warning(
                "Eyrie's EAGLE-3 compatibility layer could not measure how %s's decoder layers make the residual "
                "stream; it assumes %s from their signature",
                self.model_name,
                contract,
            )
        return [out[k].get(contract, next(iter(out[k].values()))) for k in self.ids]


def _after_layers(model: nn.Module, layers: nn.ModuleList) -> list[nn.Module]:
    """The modules that may run right after the last decoder layer: the layer list's siblings (the final norm among
    them), whatever they are named."""
    for parent in model.modules():
        if any(child is layers for child in parent.children()):
            return [c for c in parent.children() if c is not layers and not isinstance(c, nn.Embedding)]
    return []


def expose_embeddings(model: nn.Module) -> None:
    """vLLM's EAGLE proposer shares the target's embeddings through `target.model.embed_tokens`; GPT-2 keeps them
    at `transformer.wte`, OPT at `model.decoder.embed_tokens`. Alias them there (plain attributes, so no module is
    registered twice and no weight name changes)."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    if inner is None or hasattr(inner, "embed_tokens") or hasattr(inner, "embedding"):
        return
    for path in ("wte", "decoder.embed_tokens", "embed_in", "word_embeddings"):
        obj = inner
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.Module):
            object.__setattr__(inner, "embed_tokens", obj)
            break
    if getattr(model, "model", None) is None:
        object.__setattr__(model, "model", inner)


def graft_eagle3(model: nn.Module) -> None:
    """Give `model` (an instance lacking the interface) EAGLE-3 aux outputs, in place."""
    layers = decoder_layers(model)
    if layers is None:
        raise RuntimeError(
            f"Eyrie's EAGLE-3 compatibility layer found no decoder layers in "
            f"{type(model).__name__} (looked for model.layers, decoder.layers, h)"
        )
    expose_embeddings(model)
    base = type(model)

    after = _after_layers(model, layers)

    def set_aux_hidden_state_layers(self, ids) -> None:
        self._eyrie_capture = _Capture(base.__name__, layers, tuple(sorted(set(ids))), after)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        n = len(layers)
        return (2, n // 2, n - 3)

    def forward(self, *args, **kwargs):
        out = base.forward(self, *args, **kwargs)
        capture = self.__dict__.get("_eyrie_capture")
        return out if capture is None else (out, capture.collect())

    logger.info("Eyrie's EAGLE-3 compatibility layer serves %s (%d decoder layers)", base.__name__, len(layers))
    model.__class__ = type(
        f"{base.__name__}WithEagle3",
        (base,),
        {
            # every member vLLM's runtime protocol check looks for (SupportsEagleBase's defaults included)
            "supports_eagle3": True,
            "has_own_lm_head": False,
            "has_own_embed_tokens": False,
            "set_aux_hidden_state_layers": set_aux_hidden_state_layers,
            "get_eagle3_default_aux_hidden_state_layers": get_eagle3_default_aux_hidden_state_layers,
            "forward": forward,
            "__module__": base.__module__,
        },
    )


# Where each model runner asks for the interface: (runner, module, attribute). V1's is a method of its runner class,
# V2's a function of a module that the runner and others import by name (so every loaded importer is rebound too).
HOOKS = {
    "V1": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._setup_eagle3_aux_hidden_state_outputs"),
    "V2": ("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils", "set_eagle3_aux_hidden_state_layers"),
}


def _lookup(module: str, attr: str):
    """The hook's current object, or None where this vLLM has no such module or attribute. V2's module is imported
    (light: vLLM's interfaces and config); V1's runner module only where already loaded or importable."""
    import importlib

    obj: object
    try:
        obj = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a vLLM without this runner (0.34 drops V1), or one that fails to import
        return None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def missing_hooks(runners: set[str] | None = None) -> dict[str, str]:
    """Runner -> why the compatibility layer cannot serve a class lacking the interface on it, in the installed
    vLLM (its hook is not where Eyrie wraps it); empty when every runner asked about has it."""
    out = {}
    for runner in sorted(runners or HOOKS):
        module, attr = HOOKS[runner]
        if _lookup(module, attr) is None:
            out[runner] = (
                f"this vLLM has no {module}.{attr}, where Eyrie's compatibility layer gives a class the EAGLE-3 "
                f"interface on model runner {runner}"
            )
    return out


def _install_v1() -> bool:
    from vllm.model_executor.models.interfaces import supports_eagle3

    runner = _lookup("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
    if runner is None or not hasattr(runner, "_setup_eagle3_aux_hidden_state_outputs"):
        return False
    original = runner._setup_eagle3_aux_hidden_state_outputs
    if getattr(original, _INSTALLED, False):
        return True
    proposer = _lookup("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer")
    share = getattr(proposer, "_maybe_share_embeddings", None)
    if share is not None:

        def _maybe_share_embeddings(self, target_language_model) -> None:
            if not supports_eagle3(target_language_model):
                expose_embeddings(target_language_model)
            return share(self, target_language_model)

        proposer._maybe_share_embeddings = _maybe_share_embeddings

    def _setup_eagle3_aux_hidden_state_outputs(self) -> None:
        if self.use_aux_hidden_state_outputs and not supports_eagle3(self.get_model()):
            graft_eagle3(self.get_model())
        return original(self)

    setattr(_setup_eagle3_aux_hidden_state_outputs, _INSTALLED, True)
    runner._setup_eagle3_aux_hidden_state_outputs = _setup_eagle3_aux_hidden_state_outputs
    return True


def _install_v2() -> bool:
    """Model Runner V2: graft before `set_eagle3_aux_hidden_state_layers` checks the interface. The V2 runner loads
    its EAGLE drafter after this call and shares the target's embeddings from `model.embed_tokens`, which the graft
    exposes first."""
    import sys

    module, attr = HOOKS["V2"]
    original = _lookup(module, attr)
    if original is None:
        return False
    if getattr(original, _INSTALLED, False):
        return True
    from vllm.model_executor.models import interfaces

    def set_eagle3_aux_hidden_state_layers(model, *args, **kwargs) -> None:
        # Whatever vLLM passes on: (model, spec_config) up to 0.32, (model, spec_config, use_pp) in 0.33 and 0.34.
        # interfaces' own, read now: the test hook that hides the interface (plugin/__init__.py) replaces it there
        if not isinstance(model, type) and not interfaces.supports_eagle3(model):
            graft_eagle3(model)
        return original(model, *args, **kwargs)

    setattr(set_eagle3_aux_hidden_state_layers, _INSTALLED, True)
    # The module and every loaded module that imported the function by name (the V2 runner, its PP helpers).
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("vllm.") and getattr(mod, attr, None) is original:
            setattr(mod, attr, set_eagle3_aux_hidden_state_layers)
    return True


def install() -> list[str]:
    """Wrap each model runner's EAGLE-3 setup that the installed vLLM has (V1's, and the proposer's embedding sharing,
    which runs first when a drafter is loaded beside the target; V2's). Idempotent: vLLM may load plugins more than
    once. Returns the runners wrapped."""
    return [runner for runner, done in (("V1", _install_v1()), ("V2", _install_v2())) if done]
