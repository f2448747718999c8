"""The stage: every row read, normalized, held out or tokenized and masked, counted; the output published at
once."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eyrie.config import DataConfig, TargetConfig
from eyrie.errors import DataError
from eyrie.run.faults import fault_point
from eyrie.run.files import atomic_write_json, replace_dir
from eyrie.run.manifest import files_under, finished_manifest, list_files
from eyrie.stages.prepare.conversation import normalize, tokenize_conversation
from eyrie.stages.prepare.dataset import _save_dataset
from eyrie.stages.prepare.key import prepare_key
from eyrie.stages.prepare.plan import is_eval, plan_shards
from eyrie.stages.prepare.rows import RowError, RowStats
from eyrie.stages.prepare.source import iter_rows
from eyrie.target.metadata import load_tokenizer


@dataclass
class PrepareStats(RowStats):
    rows_read: int = 0
    rows_used: int = 0
    rows_eval: int = 0
    dropped: Counter = field(default_factory=Counter)

    def drop(self, err: RowError, row_no: int) -> None:
        self.refuse(self.dropped, err.reason, f"row {row_no}: {err}")

    def as_dict(self) -> dict:
        return {
            "rows_read": self.rows_read,
            "rows_used": self.rows_used,
            "rows_eval": self.rows_eval,
            "truncated": self.truncated,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "dropped": dict(sorted(self.dropped.items())),
            "examples": self.examples,
        }


def prepare(target: TargetConfig, data: DataConfig, out_dir: Path, key: str | None = None) -> dict:
    """Run the stage into `out_dir` (replaced atomically); returns its manifest. Reuses a finished one with `key`."""
    key = key or prepare_key(target, data)
    if manifest := finished_manifest(out_dir / "manifest.json", key):
        return manifest
    started = time.monotonic()
    tokenizer = load_tokenizer(target)
    stats = PrepareStats()
    ids, masks, eval_rows, lines = [], [], [], []
    freq: Counter = Counter()
    for n, row in enumerate(iter_rows(data)):
        if data.max_samples is not None and stats.rows_used >= data.max_samples:
            break
        stats.rows_read += 1
        try:
            messages = normalize(row)
            if is_eval(messages, data.eval_fraction):
                eval_rows.append(messages)
                stats.rows_eval += 1
                continue
            row_ids, row_mask, truncated = tokenize_conversation(tokenizer, messages, data.max_length)
        except RowError as err:
            stats.drop(err, n)
            continue
        ids.append(row_ids)
        masks.append(row_mask)
        lines.append((json.dumps({"messages": messages}, ensure_ascii=False) + "\n").encode())
        stats.rows_used += 1
        stats.keep(row_ids, row_mask, truncated)
        freq.update(t for t, m in zip(row_ids, row_mask) if m)
    if not ids:
        reasons = ", ".join(f"{k}: {v}" for k, v in stats.dropped.most_common()) or "the source is empty"
        examples = "; ".join(stats.examples.values())
        raise DataError(
            f"no usable conversations in {data.source} ({stats.rows_read} rows read; {reasons}). "
            f"Examples: {examples}. Rows need `messages` (role/content) or `conversations` "
            "(from/value) with at least one assistant turn."
        )

    for stale in out_dir.parent.glob(out_dir.name + ".staging-*"):  # left by a run killed mid-stage
        shutil.rmtree(stale, ignore_errors=True)
    staging = out_dir.with_name(out_dir.name + f".staging-{os.getpid()}")
    _save_dataset(staging / "dataset", ids, masks)
    import torch

    torch.save(dict(freq), staging / "dataset" / "token_freq.pt")
    shards = plan_shards(ids, data.shard_size, lines)
    atomic_write_json(staging / "shards.json", [s.__dict__ for s in shards])
    # The train conversations as read, row-aligned with the dataset: what the regenerate stage answers again.
    (staging / "conversations.jsonl").write_bytes(b"".join(lines))
    (staging / "eval_prompts.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in eval_rows))
    atomic_write_json(staging / "stats.json", stats.as_dict())
    manifest = {
        "stage": "prepare",
        "key": key,
        "num_samples": len(ids),
        "num_shards": len(shards),
        "vocab_size": len(tokenizer),
        "stats": stats.as_dict(),
        "files": list_files(staging, files_under(staging)),
        "seconds": round(time.monotonic() - started, 1),  # the stage's own time (`eyrie status`)
    }
    atomic_write_json(staging / "manifest.json", manifest)
    fault_point("prepare.before-publish")
    replace_dir(staging, out_dir)
    return manifest
