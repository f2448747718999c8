"""A tiny Kimi-K2.5: the tiny DeepseekV3 text backbone wrapped in Kimi-K2.5's multimodal shell.

vLLM serves it as KimiK25ForConditionalGeneration (transformers' upstream Kimi_K25Config, no remote code), so
the drafter pipeline exercises the multimodal target path (language_model.* prefixes, media placeholder ids).
The vision tower is a 1-layer stub: it only has to load, never to see an image. `text_model/` holds the same
text weights as a plain DeepseekV3ForCausalLM, the transformers reference for hidden states.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyrie.target.tiny.common import padded_vocab, save_model
from eyrie.target.tiny.deepseek import deepseek_v3_config
from eyrie.target.tiny.tokenizer import build_tokenizer

MEDIA_TOKENS = [
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
    "<|kimi_k25_video_placeholder|>",
]

# Smallest tower vLLM's MoonViT builds: head_dim (hidden/heads) must be divisible by 4 for its 2D RoPE.
VISION = dict(
    model_type="kimi_k25_vision",
    patch_size=14,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    hidden_act="gelu_pytorch_tanh",
    pos_emb_height=8,
    pos_emb_width=8,
    pos_emb_time=4,
    merge_kernel_size=[2, 2],
    pos_emb_type="divided_fixed",
    video_attn_type="spatial_temporal",
    mm_projector_type="patchmerger",
    merge_type="sd2_tpool",
    projector_hidden_act="gelu",
    projector_ln_eps=1e-5,
)

# vLLM's Kimi processor reads this even for text-only prompts (startup fails without it). Limits are far below
# the real model's so the encoder's dummy profiling input stays small.
MEDIA_PROC_CFG = dict(
    patch_size=14,
    merge_kernel_size=2,
    in_patch_limit=1024,
    patch_limit_on_one_side=64,
    in_patch_limit_each_frame=256,
    in_patch_limit_video=None,
    fixed_output_tokens=None,
    temporal_merge_kernel_size=4,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    sample_fps=2.0,
    max_num_frames_each_video=None,
    timestamp_mode="hh:mm:ss.fff",
    config_type=None,
)


def _vision_weights(vision: dict, text_hidden: int, generator) -> dict:
    """Tensors named and shaped as vLLM's MoonViT3dPretrainedModel / KimiK25MultiModalProjector load them."""
    import torch

    h, mlp, ps = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged = h * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * 0.02

    w = {
        "vision_tower.patch_embed.proj.weight": normal(h, 3, ps, ps),
        "vision_tower.patch_embed.proj.bias": torch.zeros(h),
        "vision_tower.patch_embed.pos_emb.weight": normal(vision["pos_emb_height"], vision["pos_emb_width"], h),
    }
    for i in range(vision["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{i}."
        w |= {
            p + "norm0.weight": torch.ones(h),
            p + "norm0.bias": torch.zeros(h),
            p + "norm1.weight": torch.ones(h),
            p + "norm1.bias": torch.zeros(h),
            p + "wqkv.weight": normal(3 * h, h),
            p + "wqkv.bias": torch.zeros(3 * h),  # fused q|k|v
            p + "wo.weight": normal(h, h),
            p + "wo.bias": torch.zeros(h),
            p + "mlp.fc0.weight": normal(mlp, h),
            p + "mlp.fc0.bias": torch.zeros(mlp),
            p + "mlp.fc1.weight": normal(h, mlp),
            p + "mlp.fc1.bias": torch.zeros(h),
        }
    w |= {
        "vision_tower.encoder.final_layernorm.weight": torch.ones(h),
        "vision_tower.encoder.final_layernorm.bias": torch.zeros(h),
        # Checkpoint names: vLLM renames proj.0/proj.2 to linear_1/linear_2.
        "mm_projector.pre_norm.weight": torch.ones(h),
        "mm_projector.pre_norm.bias": torch.zeros(h),
        "mm_projector.proj.0.weight": normal(merged, merged),
        "mm_projector.proj.0.bias": torch.zeros(merged),
        "mm_projector.proj.2.weight": normal(text_hidden, merged),
        "mm_projector.proj.2.bias": torch.zeros(text_hidden),
    }
    return w


def build_kimi_k25(path: Path, seed: int = 0, **overrides) -> None:
    """Write the tiny Kimi-K2.5 into `path`; `overrides` go to the text backbone's DeepseekV3 config."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(path, extra_special_tokens=MEDIA_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in MEDIA_TOKENS}

    torch.manual_seed(seed)
    text_config = deepseek_v3_config(padded_vocab(len(tokenizer)), **overrides)
    text_dir = path / "text_model"
    text_dir.mkdir(exist_ok=True)
    tokenizer.save_pretrained(str(text_dir))
    save_model(DeepseekV3ForCausalLM(text_config), tokenizer, text_dir)

    # Re-read the saved checkpoint rather than state_dict(): save_pretrained writes the per-expert layout
    # vLLM's DeepseekV2 loader expects, whereas transformers 5 keeps experts fused in memory.
    weights = {"language_model." + k: v for k, v in load_file(str(text_dir / "model.safetensors")).items()}
    generator = torch.Generator().manual_seed(seed)
    weights |= {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in _vision_weights(VISION, text_config.hidden_size, generator).items()
    }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})

    text = json.loads((text_dir / "config.json").read_text())
    text.pop("transformers_version", None)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": VISION,
        "projection_hidden_size": VISION["hidden_size"],
        "projection_layer_norm_eps": VISION["projector_ln_eps"],
        # Upstream defaults point at Kimi's 160k vocab; these must be ids of this tokenizer.
        "media_placeholder_token_id": ids["<|media_pad|>"],
        "image_token_id": ids["<|media_pad|>"],
        "video_token_id": ids["<|kimi_k25_video_placeholder|>"],
        "vision_start_token_id": ids["<|media_begin|>"],
        "vision_end_token_id": ids["<|media_end|>"],
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "use_unified_vision_chunk": True,
        # Kimi_K25Config defaults to tied embeddings; the backbone has its own lm_head.
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    preprocessor = {"image_processor_type": "KimiK25FusedVisionProcessor", "media_proc_cfg": MEDIA_PROC_CFG}
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    gen = {"eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
