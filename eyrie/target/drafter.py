"""The drafter's shape, read from the target's config: what preflight checks and training builds, in one place."""

from __future__ import annotations

from eyrie.config import TargetConfig
from eyrie.target.metadata import context_limit, load_hf_config, read_target_config, text_config


def draft_layer_config(target: TargetConfig, num_layers: int):
    """The drafter's decoder: a Llama layer (what vLLM's EAGLE-3 drafter runs) shaped by the target's width.

    Eyrie always writes it out rather than leave speculators to copy Llama-only fields (num_key_value_heads,
    rms_norm_eps, hidden_act) from the target's config: GPT-2, GPT-NeoX or MLA configs lack some, and a Gemma's
    GELU would give a drafter vLLM's Llama layer cannot run. Preflight builds it too, so a target it cannot be
    built for is refused before extraction. Attention shape follows speculators (the target's head_dim if set).
    """
    from speculators.models.utils import resolve_draft_intermediate_size
    from transformers import LlamaConfig

    v = load_hf_config(target).get_text_config()
    hidden, heads = v.hidden_size, v.num_attention_heads
    if hidden % heads and "head_dim" not in text_config(read_target_config(target)):
        raise ValueError(
            f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and config.json "
            "gives no head_dim, so no attention width fits the target's hidden size"
        )
    kv = getattr(v, "num_key_value_heads", None) or heads
    head_dim = getattr(v, "head_dim", None) or hidden // heads
    theta = (getattr(v, "rope_parameters", None) or {}).get("rope_theta") or getattr(v, "rope_theta", None)
    eps = next(
        (e for e in (getattr(v, k, None) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")) if e), 1e-6
    )
    return LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv if heads % kv == 0 else heads,
        head_dim=head_dim,
        intermediate_size=resolve_draft_intermediate_size(v),
        vocab_size=v.vocab_size,
        num_hidden_layers=num_layers,
        hidden_act="silu",
        rms_norm_eps=eps,
        max_position_embeddings=context_limit(v.to_dict()) or 2048,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(theta or 10000.0)},
    )
