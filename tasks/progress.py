"""One progress artifact per run of a sharded stage (regeneration, extraction, a node's share): "N of M shards",
rows done, rows/s and the time left, updated from the flow's thread.

A shard's task only counts its rows here (`report_rows`, any thread, no API call); the flow's thread, which waits
for the shards, publishes the count every few seconds and once at the end. One artifact per stage run scales to the
~2,700 shards of a Kimi-sized run (one artifact per shard made about 5,400), and the last update is the flow's own:
an update from a worker thread dropped by a rate limit once left a finished shard at 93%.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from eyrie.stages.prepare import Shard

_LIVE: dict[tuple[str, str], StageProgress] = {}  # (stage, shard name) -> the stage run counting it
_LIVE_LOCK = threading.Lock()


def report_rows(stage: str, shard: str, done: int, total: int) -> None:
    """A shard's rows done (`done` of `total`), from its task: counted by the stage run waiting for it in this
    process, if any (a task run elsewhere counts nothing here)."""
    with _LIVE_LOCK:
        progress = _LIVE.get((stage, shard))
    if progress is not None:
        progress.rows(shard, done, total)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class StageProgress:
    """The progress of one run of a sharded stage over `shards`, of which `pending` are to be done (the others were
    found complete on disk and count as done). `publish` (from the flow's thread) sends it to Prefect at most every
    `every_s` seconds; `close` sends the last state and stops counting."""

    def __init__(
        self,
        stage: str,
        shards: Iterable[Shard],
        pending: set[str],
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        artifacts: bool = True,
    ):
        self.stage, self.every_s, self.clock = stage, every_s, clock
        self.size = {s.name: max(s.stop - s.start, 0) for s in shards}
        self.done = {name: (0 if name in pending else n) for name, n in self.size.items()}
        self.finished = {name for name in self.size if name not in pending}
        self.failed: set[str] = set()
        self._lock = threading.Lock()
        self._started, self._rows_at_start = clock(), sum(self.done.values())
        self._last_sent: float | None = None
        self.artifact = None
        with _LIVE_LOCK:
            for name in pending:
                _LIVE[(stage, name)] = self
        if artifacts:
            from prefect.artifacts import create_progress_artifact

            self.artifact = create_progress_artifact(self.percent(), description=self.text())
            self._last_sent = clock()

    def rows(self, shard: str, done: int, total: int) -> None:
        size = self.size.get(shard, 0)
        with self._lock:
            # In the shard's own unit (samples, conversations), scaled to its rows; never backwards.
            now = size if total <= 0 else min(size, round(size * done / total))
            self.done[shard] = max(self.done.get(shard, 0), now)
            if total > 0 and done >= total:
                self.finished.add(shard)

    def finish(self, shard: str, ok: bool = True) -> None:
        """The flow saw the shard's task end: done (all its rows), or failed (its rows left as counted)."""
        with self._lock:
            if ok:
                self.finished.add(shard)
                self.failed.discard(shard)
                self.done[shard] = self.size.get(shard, 0)
            else:
                self.failed.add(shard)
                self.finished.discard(shard)

    def percent(self) -> float:
        total = sum(self.size.values())
        return 100.0 if not total else round(100.0 * sum(self.done.values()) / total, 2)

    def text(self) -> str:
        with self._lock:
            rows, total = sum(self.done.values()), sum(self.size.values())
            finished, failed = len(self.finished), len(self.failed)
        elapsed = self.clock() - self._started
        new = rows - self._rows_at_start
        parts = [f"{self.stage}: {finished} of {len(self.size)} shards", f"{rows:,} of {total:,} rows"]
        if new > 0 and elapsed > 0:
            rate = new / elapsed
            parts.append(f"{rate:,.1f} rows/s")
            if rows < total:
                parts.append(f"about {_duration((total - rows) / rate)} left")
        if failed:
            parts.append(f"{failed} failed")
        return ", ".join(parts)

    def publish(self, force: bool = False) -> None:
        if self.artifact is None:
            return
        now = self.clock()
        if not force and self._last_sent is not None and now - self._last_sent < self.every_s:
            return
        from prefect.artifacts import update_progress_artifact

        self._last_sent = now
        update_progress_artifact(self.artifact, self.percent(), description=self.text())

    def close(self) -> None:
        with _LIVE_LOCK:
            for key in [k for k, v in _LIVE.items() if v is self]:
                del _LIVE[key]
        self.publish(force=True)
