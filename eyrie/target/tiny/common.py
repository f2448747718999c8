"""What every tiny target shares: seeded weights saved in bf16 beside its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path


def padded_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def save_model(model, tokenizer, path: Path) -> None:
    """Save weights and config in bf16 (the production dtype) with an eos-aware generation config."""
    import torch

    model = model.to(torch.bfloat16)
    model.config.eos_token_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    gen = {"eos_token_id": model.config.eos_token_id, "pad_token_id": model.config.pad_token_id, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
