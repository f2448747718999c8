"""A row a stage cannot use: its reason is the counter key of the stage's stats."""

from __future__ import annotations


class RowError(ValueError):
    """A row that cannot be used; `reason` is the counter key in stats.json."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
