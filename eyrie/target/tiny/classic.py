"""Tiny GPT-2 and OPT targets: architectures whose vLLM classes lack the EAGLE-3 interface, served through Eyrie's
compatibility layer (eyrie/vllm/plugin/compat.py). 8 layers, hidden 64, 2 heads of 32 (CPU attention's minimum)."""

from __future__ import annotations

from pathlib import Path

from eyrie.target.tiny.common import padded_vocab, save_model
from eyrie.target.tiny.tokenizer import build_tokenizer


def _build(path: Path, seed: int, make) -> None:
    import torch

    tokenizer = build_tokenizer(path)
    torch.manual_seed(seed)
    save_model(make(padded_vocab(len(tokenizer))), tokenizer, path)


def build_gpt2(path: Path, seed: int = 0, **overrides) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    fields = dict(n_embd=64, n_layer=8, n_head=2, n_inner=128, n_positions=1024, tie_word_embeddings=False)
    _build(path, seed, lambda vocab: GPT2LMHeadModel(GPT2Config(vocab_size=vocab, **{**fields, **overrides})))


def build_opt(path: Path, seed: int = 0, **overrides) -> None:
    from transformers import OPTConfig, OPTForCausalLM

    fields = dict(
        hidden_size=64,
        num_hidden_layers=8,
        ffn_dim=128,
        num_attention_heads=2,
        word_embed_proj_dim=64,
        max_position_embeddings=1024,
        do_layer_norm_before=True,
        tie_word_embeddings=False,
    )
    _build(path, seed, lambda vocab: OPTForCausalLM(OPTConfig(vocab_size=vocab, **{**fields, **overrides})))
