from __future__ import annotations

from pathlib import Path

from eyrie.stages.vocab import build_vocab
from tasks.caching import stage_task


@stage_task("vocab", retries=1)
def vocab_task(
    token_freq: str, draft_vocab_size: int, target_vocab_size: int, out_dir: str, key: str, base: str | None = None
) -> dict:
    return build_vocab(
        Path(token_freq), draft_vocab_size, target_vocab_size, Path(out_dir), key, Path(base) if base else None
    )
