from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from eyrie.stages.promote import decide_and_promote
from tasks.caching import eyrie_task


@eyrie_task("promote")
def promote_task(
    promo_dir: str, drafter: str, version: str, candidate: dict, current: dict | None, context: dict
) -> dict:
    """Point `<promo_dir>/current` at the new drafter if it is clearly better than the current one (and than the
    untrained baseline), decided under the promotion folder's lock (eyrie.stages.promote)."""
    decision = decide_and_promote(Path(promo_dir), Path(drafter), version, candidate, current, context)
    log = get_run_logger()
    (log.info if decision["promoted"] else log.warning)(
        f"{'promoted' if decision['promoted'] else 'not promoted'}: {decision['reason']} ({decision['current']})"
    )
    return decision
