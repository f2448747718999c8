"""Preflight's checks of what the run reads and writes beside the target: the data source opened and a sample of
its rows read as prepare reads them, and the run folder writable. Both run every time (neither the data's content
nor the folder's state is in the verdict's key), in well under a second."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from itertools import islice
from pathlib import Path

from eyrie.config import DataConfig
from eyrie.errors import DataError
from eyrie.stages.prepare import is_hub_source, iter_rows, normalize
from eyrie.stages.prepare.rows import RowError

SAMPLE_ROWS = 64  # the first rows read: enough to see a layout, few enough for any file size read lazily
LAYOUTS = (
    "`messages` (a list of {role, content}) or `conversations` (a list of {from, value}) with at least one "
    "assistant turn"
)


def check_data_sample(data: DataConfig, rows: int = SAMPLE_ROWS) -> tuple[list[str], list[str], list[str]]:
    """(failures, warnings, notes) of the data source: a local source is opened and its first `rows` rows
    normalized as prepare does (`eyrie.stages.prepare.normalize`); none usable is a failure naming the reasons and
    the layouts read, some unusable a warning. A hub dataset is not downloaded here: a note says prepare reads it."""
    if is_hub_source(data):
        return [], [], [f"data.source {data.source!r} is a hub dataset: its rows are checked when prepare reads it"]
    reasons: Counter = Counter()
    examples: dict[str, str] = {}
    read = 0
    try:
        for row in islice(iter_rows(data), rows):
            read += 1
            try:
                normalize(row)
            except RowError as err:
                reasons[err.reason] += 1
                examples.setdefault(err.reason, str(err)[:200])
    except (DataError, OSError) as err:
        return [f"data.source cannot be read: {err}"], [], []
    if read == 0:
        return [f"data.source {data.source} holds no rows: give a file or folder of conversations ({LAYOUTS})"], [], []
    bad = sum(reasons.values())
    said = "; ".join(f"{reason} ({n}): {examples[reason]}" for reason, n in reasons.most_common())
    if bad == read:
        return (
            [
                f"data.source {data.source}: none of the first {read} rows is a conversation prepare can use ({said}). "
                f"Rows need {LAYOUTS}"
            ],
            [],
            [],
        )
    if bad:
        return (
            [],
            [f"data.source {data.source}: {bad} of the first {read} rows cannot be used and will be dropped ({said})"],
            [],
        )
    return [], [], []


def _nearest_existing(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_run_folder(run_dir: Path) -> list[str]:
    """The run folder is a folder (or can be made one) that this process can write: a file in its place, a file
    above it or a folder it cannot write is refused now, not when prepare (or the disk check after it) first
    writes. Probed by writing a file, which also catches a read-only mount (where permissions alone say yes)."""
    run_dir = Path(run_dir)
    existing = _nearest_existing(run_dir)
    if not existing.is_dir():
        where = "is a file" if existing == Path(os.path.abspath(run_dir)) else f"is under {existing}, a file"
        return [f"the run folder {run_dir} {where}: give --run-dir a folder (or a path where one can be made)"]
    try:
        fd, probe = tempfile.mkstemp(prefix=".eyrie-write-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        where = "" if existing == Path(os.path.abspath(run_dir)) else f" (at {existing}, where it would be made)"
        return [
            f"the run folder {run_dir} cannot be written{where}: {err.strerror or err}. Give --run-dir a writable "
            "folder, or fix its permissions or mount"
        ]
    return []
