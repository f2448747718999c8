"""Issue 25 item 8: where the drafter's training labels (speculators: an RMSNorm with the target's final-norm
weight, then a head without bias) approximate the target, each approximation is named from the target's class and
config (eyrie/target/labels.py), for any architecture: tiny targets of several families (eyrie/target/tiny), and
tiny configs of families with a head bias, logit scaling and embedding multipliers, built on the meta device."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch import nn

from eyrie.config import TargetConfig
from eyrie.target.labels import label_approximations, label_warnings, probe_norm

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=256)


def _meta(config_cls, model_cls, **fields):
    with torch.device("meta"):
        return model_cls._from_config(config_cls(**SMALL, **fields))


def _whats(model) -> dict[str, str]:
    return {a.what: a.source for a in label_approximations(model)}


@pytest.mark.parametrize(
    ("family", "want"),
    [
        ("tiny-llama", {}),
        ("tiny-qwen3", {}),
        ("tiny-gemma2", {"final norm", "logit soft-capping", "embedding scale"}),
        ("tiny-gpt-neox", {"final norm"}),
        ("tiny-falcon", {"final norm"}),
    ],
)
def test_tiny_targets_name_their_approximations(tiny_target, family, want):
    path = tiny_target(family)
    warnings = label_warnings(TargetConfig(model=str(path)), json.loads((path / "config.json").read_text()))
    named = {w.split(": ", 1)[1].split(" (", 1)[0] for w in warnings}
    assert named == set(want), warnings
    for w in warnings:
        assert w.startswith(f"the drafter's training labels approximate {path}: ")
    if family == "tiny-gemma2":
        text = "\n".join(warnings)
        assert "config.final_logit_softcapping" in text and "(1 + weight)" in text
    if family == "tiny-gpt-neox":
        assert "gpt_neox.final_layer_norm (LayerNorm)" in warnings[0] and "adds a bias" in warnings[0]


def test_families_without_a_tiny_target_are_read_from_their_config_and_class():
    granite = _whats(
        _meta(
            transformers.GraniteConfig, transformers.GraniteForCausalLM, embedding_multiplier=12.0, logits_scaling=8.0
        )
    )
    assert granite == {
        "embedding scale": "config.embedding_multiplier = 12.0",
        "logit scaling": "config.logits_scaling = 8.0",
    }
    cohere = _whats(_meta(transformers.CohereConfig, transformers.CohereForCausalLM))
    assert cohere["logit scaling"] == "config.logit_scale = 0.0625"
    assert cohere["final norm"].endswith("(CohereLayerNorm)")  # a LayerNorm without bias: the mean is removed
    phi = _whats(_meta(transformers.PhiConfig, transformers.PhiForCausalLM))
    assert phi["head bias"] == "PhiForCausalLM.lm_head.bias" and "final norm" in phi
    # Neutral values name nothing; attention's own soft-capping is inside the target, not a label approximation.
    granite_plain = _meta(
        transformers.GraniteConfig, transformers.GraniteForCausalLM, embedding_multiplier=1.0, logits_scaling=1.0
    )
    assert _whats(granite_plain) == {}
    gemma = _meta(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        head_dim=32,
        final_logit_softcapping=None,
        attn_logit_softcapping=50.0,
    )
    assert "logit soft-capping" not in _whats(gemma)


def test_the_norm_probe_tells_what_the_module_computes():
    assert probe_norm(transformers.models.llama.modeling_llama.LlamaRMSNorm(16)) == "rms"
    assert probe_norm(transformers.models.gemma.modeling_gemma.GemmaRMSNorm(16)) == "rms+1"
    assert probe_norm(nn.LayerNorm(16)) == "layer"
    assert probe_norm(nn.LayerNorm(16, bias=False)) == "layer"

    class Tanh(nn.Module):  # a norm of another kind: reported, not mistaken for an RMSNorm
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return torch.tanh(x) * self.weight

    assert probe_norm(Tanh()) == "unknown"
    with torch.device("meta"):
        meta_norm = nn.LayerNorm(16)
    assert probe_norm(meta_norm) == "layer"  # probed on a CPU copy of a meta module
