from __future__ import annotations

from prefect import get_run_logger

from eyrie.config import PipelineConfig
from eyrie.ops.tracking import track
from eyrie.run.folder import RunFolder
from tasks.caching import eyrie_task


@eyrie_task("track-run")
def track_run_task(config: PipelineConfig, run_dir: str, outputs: dict, summary_markdown: str) -> list[str]:
    """Export the finished run to the trackers its config turns on (eyrie.ops.tracking); returns the warnings of a
    tracker that could not take it (the run is finished either way)."""
    tracked = track(RunFolder(run_dir), config, outputs, summary_markdown)
    log = get_run_logger()
    for line in tracked.notes:
        log.info(f"run tracking: {line}")
    return tracked.warnings
