"""A tiny Llama: 8 layers so the default aux ids (2, L//2, L-3) are distinct; head_dim 32 for CPU attention."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eyrie.target.tiny.common import padded_vocab, save_model
from eyrie.target.tiny.tokenizer import build_tokenizer


def llama_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def build_llama(path: Path, seed: int = 0, pretrain_steps: int = 0, **overrides) -> None:
    """Random weights, or (pretrain_steps > 0) weights taught the bundled demo conversations."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer(path)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(padded_vocab(len(tokenizer)), **overrides))
    if pretrain_steps:
        from eyrie.target.tiny.pretrain import pretrain_on_demo_data

        curve = pretrain_on_demo_data(model, tokenizer, steps=pretrain_steps, seed=seed)
        (path / "pretrain_loss.json").write_text(json.dumps(curve) + "\n")
    save_model(model, tokenizer, path)
