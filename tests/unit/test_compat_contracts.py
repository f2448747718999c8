"""The compatibility layer measures how a decoder layer's outputs make the residual stream, whatever its signature.

Two toy decoders with the same layer signature `forward(positions, hidden_states, residual)` and vLLM's two output
contracts: a Llama-style layer returns (delta, residual) for a fused add-norm to sum; a Cohere-style parallel block
returns the full stream and its own input (the residual it was given is ignored). A capture that trusts the
signature double-counts the second one's residual (the issue's relative L2 0.84-0.89); the probe at the final norm
tells them apart on the first forward pass, and every captured id equals the true stream."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eyrie.vllm.plugin.compat import FIRST, SUM, graft_eagle3

H, LAYERS = 16, 4


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class FusedAddNorm(nn.Module):
    """vLLM's RMSNorm: norm(x), or (norm(x + residual), x + residual)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H))

    def forward(self, x, residual=None):
        if residual is None:
            return _rms(x, self.weight)
        s = x + residual
        return _rms(s, self.weight), s


class PassNorm(nn.Module):
    """Cohere's LayerNorm: (norm(x), residual) — the residual passed through untouched."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H))

    def forward(self, x, residual=None):
        return torch.nn.functional.layer_norm(x, (H,), self.weight), residual


class SumLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = FusedAddNorm(), nn.Linear(H, H)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual, h = hidden_states, self.norm(hidden_states)
        else:
            h, residual = self.norm(hidden_states, residual)
        return self.mlp(h), residual


class FirstLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = PassNorm(), nn.Linear(H, H)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states
        h, _ = self.norm(hidden_states, residual)
        return residual + self.mlp(h), residual


class Decoder(nn.Module):
    def __init__(self, layer_cls, norm_cls):
        super().__init__()
        self.embed_tokens = nn.Embedding(32, H)
        self.layers = nn.ModuleList(layer_cls() for _ in range(LAYERS))
        self.norm = norm_cls()


class ToyForCausalLM(nn.Module):
    def __init__(self, layer_cls, norm_cls):
        super().__init__()
        self.model = Decoder(layer_cls, norm_cls)

    def forward(self, input_ids, positions):
        hs, residual = self.model.embed_tokens(input_ids), None
        self.truth = []  # the stream entering each layer, then leaving the last
        for layer in self.model.layers:
            self.truth.append(hs if residual is None or isinstance(layer, FirstLayer) else hs + residual)
            hs, residual = layer(positions, hs, residual)
        self.truth.append(hs if isinstance(self.model.layers[0], FirstLayer) else hs + residual)
        hs, _ = self.model.norm(hs, residual)
        return hs


def _fresh(layer_cls, norm_cls):
    # A class of its own per model: graft_eagle3 swaps the instance's class.
    return type(f"Toy{layer_cls.__name__}", (ToyForCausalLM,), {})(layer_cls, norm_cls)


@pytest.mark.parametrize(
    "layer_cls, norm_cls, contract", [(SumLayer, FusedAddNorm, SUM), (FirstLayer, PassNorm, FIRST)]
)
def test_the_contract_is_measured_and_every_id_is_the_true_stream(layer_cls, norm_cls, contract):
    torch.manual_seed(0)
    model = _fresh(layer_cls, norm_cls)
    graft_eagle3(model)
    ids = (1, 2, LAYERS)
    model.set_aux_hidden_state_layers(ids)
    tokens = torch.randint(0, 32, (12,))
    with torch.no_grad():
        for _ in range(2):  # the first pass (vLLM's profile run) decides; every pass is right
            _, aux = model(tokens, torch.arange(12))
            assert model._eyrie_capture.contract == contract
            for k, got in zip(ids, aux, strict=True):
                want = model.truth[k]
                assert torch.allclose(got, want, atol=1e-5), (k, float((got - want).norm() / want.norm()))


def test_the_signatures_guess_is_wrong_for_the_cohere_contract():
    """What the layer fixes: trusting the signature (a `residual` argument means sum) double-counts."""
    torch.manual_seed(0)
    model = _fresh(FirstLayer, PassNorm)
    graft_eagle3(model)
    model.set_aux_hidden_state_layers((2, LAYERS))
    capture = model._eyrie_capture
    assert capture.guess == SUM
    with torch.no_grad():
        model(torch.randint(0, 32, (12,)), torch.arange(12))
        capture.contract = SUM  # as the signature alone would have it
        _, aux = model(torch.randint(0, 32, (12,)), torch.arange(12))
    rel = float((aux[-1] - model.truth[LAYERS]).norm() / model.truth[LAYERS].norm())
    assert rel > 0.3, rel


def _spec_config(ids):
    """What `set_eagle3_aux_hidden_state_layers` reads of vLLM's SpeculativeConfig: the drafter's aux layer ids."""
    from types import SimpleNamespace

    hf_config = SimpleNamespace(eagle_aux_hidden_state_layer_ids=list(ids))
    return SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))


def test_model_runner_v2_gives_a_class_without_the_interface_its_aux_outputs(monkeypatch):
    """GPU vLLM's Model Runner V2 sets EAGLE-3 up through `eagle3_utils.set_eagle3_aux_hidden_state_layers`, which
    raised "Model does not support EAGLE3 interface" for a class lacking it (the layer wrapped V1's runner only).
    Installed, the function V2 calls (also through a module that imported it by name before the install) grafts
    the interface first, and the model returns the requested streams."""
    import sys
    import types

    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils

    from eyrie.vllm.plugin import compat

    importer = types.ModuleType("vllm._eyrie_test_v2_runner")  # as the V2 runner binds it: `from ... import name`
    importer.set_eagle3_aux_hidden_state_layers = eagle3_utils.set_eagle3_aux_hidden_state_layers
    monkeypatch.setitem(sys.modules, importer.__name__, importer)
    torch.manual_seed(0)
    model = _fresh(SumLayer, FusedAddNorm)
    assert not supports_eagle3(model)
    installed = compat.install()
    assert compat.install() == installed  # idempotent
    importer.set_eagle3_aux_hidden_state_layers(model, _spec_config((1, 2, LAYERS)))
    assert supports_eagle3(model) and "V2" in installed
    with torch.no_grad():
        _, aux = model(torch.randint(0, 32, (12,)), torch.arange(12))
    for k, got in zip((1, 2, LAYERS), aux, strict=True):
        assert torch.allclose(got, model.truth[k], atol=1e-5), k
    # the function itself, as a module importing it after the install gets it
    other = _fresh(SumLayer, FusedAddNorm)
    eagle3_utils.set_eagle3_aux_hidden_state_layers(other, _spec_config((2,)))
    assert supports_eagle3(other)
    # vLLM 0.33 and later call it with a third argument (use_pp): the wrapper takes what the runner passes on
    import inspect

    inspect.signature(eagle3_utils.set_eagle3_aux_hidden_state_layers).bind(other, _spec_config((2,)), False)


def test_a_runner_whose_hook_this_vllm_lacks_is_named(monkeypatch):
    """Preflight refuses a compat target on a runner whose hook the installed vLLM moved or dropped."""
    from eyrie.vllm.plugin import compat

    assert compat.missing_hooks() == {}  # the installed vLLM (0.32) has both runners' hooks
    monkeypatch.setitem(compat.HOOKS, "V2", ("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils", "moved_away"))
    missing = compat.missing_hooks({"V1", "V2"})
    assert list(missing) == ["V2"] and "moved_away" in missing["V2"]
