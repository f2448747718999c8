"""The pipeline's stages, in order: the one list the flow's `until`, `eyrie run --until`, `eyrie status` and the
README's stage table are read from (tests/unit/test_readme.py checks the README against it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    until: bool  # `eyrie run --until` may stop after it (vocab runs with train, export with evaluate)
    in_run_folder: bool  # its output and manifest live in `<run>/<name>/` (promotion's live in promotion.dir)


STAGES = (
    Stage("prepare", until=True, in_run_folder=True),
    Stage("regenerate", until=True, in_run_folder=True),  # only with regenerate.enabled
    Stage("extract", until=True, in_run_folder=True),
    Stage("vocab", until=False, in_run_folder=True),
    Stage("train", until=True, in_run_folder=True),
    Stage("export", until=False, in_run_folder=True),
    Stage("evaluate", until=True, in_run_folder=True),
    Stage("promote", until=False, in_run_folder=False),
)
UNTIL = tuple(s.name for s in STAGES if s.until)
RUN_FOLDER_STAGES = tuple(s.name for s in STAGES if s.in_run_folder)
