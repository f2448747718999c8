"""EAGLE-3 for target classes that lack vLLM's `SupportsEagle3` interface.

vLLM checks the interface on the built model, in the model runner, just before it asks for aux hidden states
(`_setup_eagle3_aux_hidden_state_outputs`); without it the run dies after the whole load. Eyrie wraps that one
method: when aux outputs are requested and the model lacks the interface, the model instance is given a subclass
with the class flag, `set_aux_hidden_state_layers`, the default ids (2, L//2, L-3) and a forward that also returns
the residual stream entering each requested decoder layer (vLLM's convention; id L is the last layer's output).
The stream is read with forward hooks on the decoder layers found under `model.layers`, `decoder.layers`, `h`, or a
wrapper's `language_model`. For serving a drafter, the target's embeddings are also exposed where vLLM's proposer
looks for them (`model.embed_tokens`). Classes that implement the interface are never touched. Hooks need eager
execution (`enforce_eager`), which preflight checks.
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


def _stream(layer: nn.Module):
    """A function (args, kwargs) -> the residual stream entering `layer` (hidden_states + residual, if split)."""
    params = list(inspect.signature(layer.forward).parameters)

    def read(args, kwargs):
        bound = dict(zip(params, args), **kwargs)
        hs = bound.get("hidden_states", args[0] if args else None)
        residual = bound.get("residual")
        return hs if residual is None else hs + residual

    return read


def _layer_output(layer: nn.Module, out):
    """The residual stream leaving `layer`. Layers that take the residual separately (Llama-style: forward has a
    `residual` argument) return (hidden_states, residual), and the stream is their sum; others return the stream
    first (StableLM's second element is its pre-MLP residual, already inside the first)."""
    if not isinstance(out, tuple):
        return out
    if "residual" in inspect.signature(layer.forward).parameters and len(out) == 2 and out[1] is not None:
        return out[0] + out[1]
    return out[0]


class _Capture:
    def __init__(self, layers: nn.ModuleList, ids: tuple[int, ...]):
        self.ids = ids
        self.out: dict[int, torch.Tensor] = {}
        n = len(layers)
        for k in ids:
            if k < n:
                read = _stream(layers[k])
                layers[k].register_forward_pre_hook(
                    lambda m, a, kw, k=k, read=read: self.out.__setitem__(k, read(a, kw)), with_kwargs=True
                )
            elif k == n:  # the last layer's output, before the final norm
                layers[n - 1].register_forward_hook(lambda m, a, o: self.out.__setitem__(n, _layer_output(m, o)))
            else:
                raise ValueError(f"aux hidden state layer {k} is beyond the model's {n} layers")

    def collect(self) -> list[torch.Tensor]:
        out, self.out = self.out, {}
        return [out[k] for k in self.ids]


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

    def set_aux_hidden_state_layers(self, ids) -> None:
        self._eyrie_capture = _Capture(layers, tuple(sorted(set(ids))))

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


def install() -> None:
    """Wrap the model runner's EAGLE-3 setup and the proposer's embedding sharing (which runs first, when a drafter
    is loaded beside the target). Idempotent: vLLM may load plugins more than once."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._setup_eagle3_aux_hidden_state_outputs
    if getattr(original, _INSTALLED, False):
        return
    share = SpecDecodeBaseProposer._maybe_share_embeddings

    def _maybe_share_embeddings(self, target_language_model) -> None:
        if not supports_eagle3(target_language_model):
            expose_embeddings(target_language_model)
        return share(self, target_language_model)

    SpecDecodeBaseProposer._maybe_share_embeddings = _maybe_share_embeddings  # type: ignore[method-assign]

    def _setup_eagle3_aux_hidden_state_outputs(self) -> None:
        if self.use_aux_hidden_state_outputs and not supports_eagle3(self.get_model()):
            graft_eagle3(self.get_model())
        return original(self)

    setattr(_setup_eagle3_aux_hidden_state_outputs, _INSTALLED, True)
    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs = (  # type: ignore[method-assign]
        _setup_eagle3_aux_hidden_state_outputs
    )
