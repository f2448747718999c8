"""Tiny random-weight targets of more architectures, for the compatibility matrix: one builder per family.

Each is built from its transformers config class (no downloads) with the shape vLLM's CPU build needs: 8 decoder
layers (so the default aux ids 2, L//2, L-3 are distinct), hidden 64, 2 attention heads of head_dim 32 (CPU attention's
minimum), 1024 positions, untied embeddings and bf16 weights, beside the shared demo tokenizer. Where the family's
real models differ in a way vLLM serves through another code path, the tiny one keeps that difference: grouped-query
attention (Qwen2, Mistral: one KV head), QK norms (Qwen3), routed experts (Qwen3-MoE: 4 experts, top 2), sandwich
norms, soft-capping and alternating sliding-window layers (Gemma-2), fused projections (Phi-3), partial rotary and
parallel residual (GPT-NeoX, StableLM), multi-query parallel attention (Falcon).

Gemma-2 is the one exception to untied embeddings: vLLM's Gemma2ForCausalLM has no lm_head (it computes logits
with the input embeddings), so its tiny target ties them like the real Gemma-2 models do.

`FAMILIES` maps each tiny-target name to its builder: `FAMILIES["tiny-qwen3"](path, seed=0)`.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.target.tiny.common import padded_vocab, save_model
from eyrie.target.tiny.tokenizer import build_tokenizer

# What every family shares; a family's own fields come after, and the caller's overrides last.
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def _build(path: Path, seed: int, config_cls, model_cls, fields: dict, overrides: dict, drop=()) -> None:
    """Tokenizer, seeded weights from `config_cls(**COMMON, **fields, **overrides)`, saved in bf16. The special
    token ids are the tokenizer's from the start: some configs default to ids beyond the tiny vocabulary (Phi-3's
    pad 32000 fails as the embedding's padding_idx)."""
    import torch

    tokenizer = build_tokenizer(path)
    merged = {k: v for k, v in COMMON.items() if k not in drop}
    merged.update(
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
        pad_token_id=tokenizer.pad_token_id,
    )
    merged.update(fields)
    merged.update(overrides)
    torch.manual_seed(seed)
    save_model(model_cls(config_cls(vocab_size=padded_vocab(len(tokenizer)), **merged)), tokenizer, path)


def build_qwen2(path: Path, seed: int = 0, **overrides) -> None:
    """Qwen2: biased q/k/v projections, grouped-query attention (2 query heads share 1 KV head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = dict(num_key_value_heads=1, rms_norm_eps=1e-6, use_sliding_window=False)
    _build(path, seed, Qwen2Config, Qwen2ForCausalLM, fields, overrides)


def build_qwen3(path: Path, seed: int = 0, **overrides) -> None:
    """Qwen3: RMS norms on queries and keys, head_dim set apart from hidden_size // heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = dict(rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False)
    _build(path, seed, Qwen3Config, Qwen3ForCausalLM, fields, overrides)


def build_qwen3_moe(path: Path, seed: int = 0, **overrides) -> None:
    """Qwen3-MoE: every layer's MLP is 4 routed experts, top 2 with renormalised weights (no shared expert)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
    )
    _build(path, seed, Qwen3MoeConfig, Qwen3MoeForCausalLM, fields, overrides)


def build_mistral(path: Path, seed: int = 0, **overrides) -> None:
    """Mistral: Llama-like with grouped-query attention; no sliding window (as Mistral-7B v0.2 and later)."""
    from transformers import MistralConfig, MistralForCausalLM

    fields = dict(num_key_value_heads=1, sliding_window=None, rms_norm_eps=1e-5)
    _build(path, seed, MistralConfig, MistralForCausalLM, fields, overrides)


def build_gemma2(path: Path, seed: int = 0, **overrides) -> None:
    """Gemma-2: scaled embeddings, four norms per layer, attention and final logit soft-capping, sliding-window
    layers alternating with global ones (a 16-token window, shorter than a demo conversation, so that the sliding
    layers really slide). Tied embeddings: vLLM's class has no lm_head."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    fields = dict(
        tie_word_embeddings=True,
        query_pre_attn_scalar=32,
        sliding_window=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
    )
    _build(path, seed, Gemma2Config, Gemma2ForCausalLM, fields, overrides)


def build_phi3(path: Path, seed: int = 0, **overrides) -> None:
    """Phi-3: fused qkv and gate_up projections in the checkpoint itself."""
    from transformers import Phi3Config, Phi3ForCausalLM

    fields = dict(rms_norm_eps=1e-5, sliding_window=None, original_max_position_embeddings=1024)
    _build(path, seed, Phi3Config, Phi3ForCausalLM, fields, overrides, drop=("head_dim",))


def build_gpt_neox(path: Path, seed: int = 0, **overrides) -> None:
    """GPT-NeoX (Pythia): LayerNorm, rotary on a quarter of each head, parallel attention and MLP residual."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    fields = dict(hidden_act="gelu", use_parallel_residual=True, attention_bias=True, layer_norm_eps=1e-5)
    _build(path, seed, GPTNeoXConfig, GPTNeoXForCausalLM, fields, overrides, drop=("num_key_value_heads", "head_dim"))


def build_falcon(path: Path, seed: int = 0, **overrides) -> None:
    """Falcon (7B style): one shared KV head (multi-query), attention and MLP in parallel, rotary, no biases. The MLP
    is 4 x hidden wide: vLLM's FalconMLP ignores `ffn_hidden_size` (128 fails the load with "start (0) + length
    (256) exceeds dimension size (128)")."""
    from transformers import FalconConfig, FalconForCausalLM

    fields = dict(
        multi_query=True,
        parallel_attn=True,
        new_decoder_architecture=False,
        alibi=False,
        bias=False,
        num_kv_heads=1,
        ffn_hidden_size=None,
        layer_norm_epsilon=1e-5,
    )
    _build(
        path,
        seed,
        FalconConfig,
        FalconForCausalLM,
        fields,
        overrides,
        drop=("intermediate_size", "num_key_value_heads", "head_dim"),
    )


def build_stablelm(path: Path, seed: int = 0, **overrides) -> None:
    """StableLM (2): LayerNorm, rotary on a quarter of each head, sequential residual."""
    from transformers import StableLmConfig, StableLmForCausalLM

    fields = dict(
        partial_rotary_factor=0.25,
        use_parallel_residual=False,
        qk_layernorm=False,
        use_qkv_bias=False,
        layer_norm_eps=1e-5,
    )
    _build(path, seed, StableLmConfig, StableLmForCausalLM, fields, overrides, drop=("head_dim",))


FAMILIES = {
    "tiny-qwen2": build_qwen2,
    "tiny-qwen3": build_qwen3,
    "tiny-qwen3-moe": build_qwen3_moe,
    "tiny-mistral": build_mistral,
    "tiny-gemma2": build_gemma2,
    "tiny-phi3": build_phi3,
    "tiny-gpt-neox": build_gpt_neox,
    "tiny-falcon": build_falcon,
    "tiny-stablelm": build_stablelm,
}
