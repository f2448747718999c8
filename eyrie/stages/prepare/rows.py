"""What a stage that writes rows counts (prepare, and each regenerated shard): a row it cannot use, by reason, with
the first example of each reason; the tokens, loss tokens and truncations of the rows it keeps."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class RowError(ValueError):
    """A row that cannot be used; `reason` is the counter key in stats.json."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class RowStats:
    """The counts every row-writing stage keeps (`eyrie.stages.prepare.stage.PrepareStats`,
    `eyrie.stages.regenerate.shard.ShardStats`); each names its own counter of refused rows in its stats.json."""

    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    examples: dict = field(default_factory=dict)  # reason -> the first refused row's example

    def keep(self, input_ids: list[int], loss_mask: list[int], truncated: bool) -> None:
        """A row written: its tokens, the tokens its loss mask trains on, whether it was cut to the length limit."""
        self.tokens += len(input_ids)
        self.loss_tokens += sum(loss_mask)
        self.truncated += truncated

    def refuse(self, reasons: Counter, reason: str, example: str) -> None:
        """A row not written: counted under `reason` in `reasons`, the stage's counter; the first one kept as the
        reason's example."""
        reasons[reason] += 1
        self.examples.setdefault(reason, example)
