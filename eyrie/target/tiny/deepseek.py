"""A tiny DeepseekV3 (MLA + MoE). vLLM's CPU build needs kv_lora_rank 512, qk_rope_head_dim 64 and
noaux_tc/sigmoid routing (see README); everything else is as small as it goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyrie.target.tiny.common import padded_vocab, save_model
from eyrie.target.tiny.tokenizer import build_tokenizer


def deepseek_v3_config(vocab_size: int, **overrides):
    from transformers import DeepseekV3Config

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        kv_lora_rank=512,
        q_lora_rank=32,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_scaling=None,
        torch_dtype="bfloat16",
    )
    fields.update(overrides)
    config = DeepseekV3Config(**fields)
    # vLLM's CPU MoE path supports these two settings only.
    config.topk_method = "noaux_tc"
    config.scoring_func = "sigmoid"
    return config


def build_deepseek_v3(path: Path, seed: int = 0, **overrides) -> None:
    import torch
    from transformers import DeepseekV3ForCausalLM

    tokenizer = build_tokenizer(path)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_v3_config(padded_vocab(len(tokenizer)), **overrides))
    save_model(model, tokenizer, path)
