"""vocab: the draft vocabulary map from loss-masked token frequencies, in speculators' format.

`d2t-<N>.npy` (int64 offsets: target_id = draft_id + d2t[draft_id]) and `t2d-<N>.npy` (bool mask over the target
vocabulary), named the way speculators' trainer looks for them in its data folder. The selection itself is
speculators' own `build_vocab_mappings_from_distribution` (most frequent first, ties by id).
"""

from __future__ import annotations

import time
from pathlib import Path

from eyrie.errors import ConfigError
from eyrie.run.faults import fault_point
from eyrie.run.files import atomic_write_json
from eyrie.run.manifest import finished_manifest, list_files


def vocab_key(prepare_manifest: dict, draft_vocab_size: int, target_vocab_size: int, base: str | None = None) -> str:
    """`eyrie.run.identity.STAGES["vocab"]`: the data's key (prepared or regenerated), the sizes, and a warm start's
    base drafter by its content (its mapping is kept)."""
    from types import SimpleNamespace

    from eyrie.target.metadata import stage_key

    config = SimpleNamespace(vocab=SimpleNamespace(draft_vocab_size=draft_vocab_size))
    return stage_key("vocab", config, drafter=base, data=prepare_manifest["key"], target_vocab_size=target_vocab_size)


def mapping_paths(folder: Path, draft_vocab_size: int) -> tuple[Path, Path]:
    return folder / f"d2t-{draft_vocab_size}.npy", folder / f"t2d-{draft_vocab_size}.npy"


def build_vocab(
    token_freq_path: Path,
    draft_vocab_size: int,
    target_vocab_size: int,
    out_dir: Path,
    key: str,
    base: Path | None = None,
) -> dict:
    """The mapping for this data, or, warm-starting from the drafter `base`, that drafter's own mapping (its
    lm_head rows belong to those tokens); the coverage figures are for this data either way."""
    import numpy as np
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if manifest := finished_manifest(out_dir / "manifest.json", key):
        return manifest
    started = time.monotonic()
    if draft_vocab_size > target_vocab_size:
        raise ConfigError(
            f"vocab.draft_vocab_size {draft_vocab_size} is larger than the target's vocabulary "
            f"({target_vocab_size}): set it to at most {target_vocab_size}"
        )
    freq = torch.load(token_freq_path, weights_only=True)
    if base is None:
        d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, target_vocab_size)
    else:
        from safetensors.torch import load_file

        weights = load_file(str(base / "model.safetensors"))
        d2t, t2d = weights["d2t"], weights["t2d"]
    out_dir.mkdir(parents=True, exist_ok=True)
    d2t_path, t2d_path = mapping_paths(out_dir, draft_vocab_size)
    np.save(d2t_path, d2t.numpy())
    np.save(t2d_path, t2d.numpy())
    total = sum(freq.values())
    kept = sum(freq.get(int(i), 0) for i in (torch.arange(draft_vocab_size) + d2t).tolist())
    manifest = {
        "stage": "vocab",
        "key": key,
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": target_vocab_size,
        "distinct_loss_tokens": len(freq),
        "loss_token_coverage": round(kept / total, 6) if total else None,
        "from_drafter": str(base) if base else None,
        "files": list_files(out_dir, (d2t_path, t2d_path)),
        "seconds": round(time.monotonic() - started, 1),  # the stage's own time (`eyrie status`)
    }
    fault_point("vocab.before-manifest")
    atomic_write_json(out_dir / "manifest.json", manifest)
    return manifest
