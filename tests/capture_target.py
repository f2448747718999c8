"""A tiny Llama target for the capture checks' tests (tests/unit/test_capture_check.py, test_capture_proof.py): the
model, its true residual stream at every captured point, and the capture context extraction records for it."""

from __future__ import annotations

import torch

LAYERS = 4
CAPTURED = [1, 2, LAYERS]  # two aux layers and the last layer's output (vLLM's id L)


def tiny_llama(folder, seed: int):
    """A seeded tiny Llama saved at `folder`; a wide initialisation keeps its logits away from near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def residual_stream(model, ids: list[int]) -> torch.Tensor:
    """[T, L+1, H]: the stream entering each layer, and the last layer's output before the final norm."""
    seen: list = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    hook.remove()
    last = seen[0][0] if isinstance(seen[0], tuple) else seen[0]
    return torch.stack([*(h[0] for h in hs[:LAYERS]), last[0]], dim=1)


def capture_context(folder) -> dict:
    """What extraction records beside the files for the capture checks (`eyrie.hidden_states.check.CONTEXT`)."""
    return {
        "model": str(folder),
        "revision": None,
        "num_layers": LAYERS,
        "layer_ids": CAPTURED,
        "verifier_weights": {
            "embed_tokens.weight": "model.embed_tokens.weight",
            "model.norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight",
        },
        "final_norm": "LlamaRMSNorm",
        "norm_eps": 1e-6,
    }
