"""The commits a flow run pinned, kept in the run folder so that its retries reuse them.

`pin_revisions` resolves a moving revision (`main`) to the commit it points at now. A Prefect retry of a flow run
(automatic, or "Retry" in the UI) opens the run again: pinned again, a `main` that moved in between would change
every key, and regeneration and extraction would start over in the middle of one run. So the first attempt records
its commits in `<run>/revisions.json`, keyed by the flow run's id and by what was asked (repo and revision), and
every later attempt of the same flow run takes them from there. A new flow run pins afresh (a weekly run must see
the week's commits); a run outside Prefect (no flow run id) always pins.
"""

from __future__ import annotations

from pathlib import Path

from eyrie.config import DataConfig, TargetConfig
from eyrie.run.files import atomic_write_json, read_json
from eyrie.target.hub import Pinned, pin_revisions

PINS = "revisions.json"


def _asked(target: TargetConfig, data: DataConfig, is_hub_target: bool, is_hub_data: bool) -> dict:
    return {
        "target": [target.model, target.revision] if is_hub_target else None,
        "data": [data.source, data.revision] if is_hub_data else None,
    }


def pin_for_flow_run(
    target: TargetConfig,
    data: DataConfig,
    run_root: Path,
    flow_run_id: str | None,
    is_hub_target: bool,
    is_hub_data: bool,
) -> tuple[Pinned, bool]:
    """`target` and `data` with their hub revisions pinned: to the commits this flow run pinned before (a retry),
    else to the commits they point at now (recorded for the retries). Returns (them, whether the pins were
    reused)."""
    if not (is_hub_target or is_hub_data):
        return Pinned(target, data), False
    asked = _asked(target, data, is_hub_target, is_hub_data)
    record = read_json(run_root / PINS)
    if (
        flow_run_id
        and isinstance(record, dict)
        and record.get("flow_run") == flow_run_id
        and record.get("asked") == asked
    ):
        commits = record.get("commits") or {}
        if is_hub_target:
            target = target.model_copy(update={"revision": commits["target"]})
        if is_hub_data:
            data = data.model_copy(update={"revision": commits["data"]})
        return Pinned(target, data), True
    pinned = pin_revisions(target, data, is_hub_target, is_hub_data)
    if flow_run_id:
        commits = {
            "target": pinned.target.revision if is_hub_target else None,
            "data": pinned.data.revision if is_hub_data else None,
        }
        atomic_write_json(run_root / PINS, {"flow_run": flow_run_id, "asked": asked, "commits": commits})
    return pinned, False
