"""The prepared dataset in speculators' preprocessed format: written, and read back by the later stages."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def _save_dataset(path: Path, ids: list[list[int]], masks: list[list[int]]) -> None:
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": [len(r) for r in ids]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(path))


def load_dataset_rows(prepare_dir: Path, start: int, stop: int) -> list[list[int]]:
    from datasets import load_from_disk

    ds = load_from_disk(str(prepare_dir / "dataset")).with_format(None)
    return ds.select(range(start, stop))["input_ids"]


def load_seq_lens(prepare_dir: Path) -> list[int]:
    from datasets import load_from_disk

    return list(load_from_disk(str(prepare_dir / "dataset")).with_format(None)["seq_len"])


def iter_eval_prompts(prepare_dir: Path) -> Iterable[list[dict]]:
    """Held-out conversations cut before their first assistant turn: the prompts evaluation sends."""
    for line in (prepare_dir / "eval_prompts.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        yield messages[:first]
