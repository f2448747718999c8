"""promote: the drafter serving loads from one stable path, replaced only by a drafter that is clearly better.

Layout of `promotion.dir`:
  current -> versions/<id>     a relative symlink; point vLLM's speculative config at `<dir>/current`
  versions/<id>/               a full copy of an exported drafter plus `promotion.json` (why it was promoted)
  history.jsonl                every decision, promoted or not, one JSON line each
Versions are never changed once written, and the link is swapped by rename, so a reader sees the old drafter or
the new one, never a mix. A run warm-starts from the version that was current when its training began; that
choice is recorded in the run folder so re-runs of the same data train (and cache) the same way.

Runs may share `promotion.dir`. The decision and the swap happen under an exclusive `flock` on
`<dir>/promotion.lock` (as the run folder's own lock, eyrie/run/folder.py), and under it the version current now
must be the one this run measured against: if another run promoted meanwhile, this run refuses (its comparison was
against a drafter that is no longer current) and says to run again, which measures against the new one.

The decision is a paired comparison on the same held-out prompts (`eyrie.stages.evaluate.paired_difference`): the
candidate is promoted only when its pooled acceptance length is above the current drafter's by more than 1.645
standard errors of the difference (one-sided 95%), so an equal drafter is almost never promoted (with `new >= old`
between two noisy figures it was, half the time); and never when it is not clearly better than the untrained
baseline it was measured beside, or, with none served, than the floor of no drafter (acceptance length 1.0).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from eyrie.run.files import atomic_write_json, fsync_path, fsync_tree, read_json

CURRENT = "current"


def current_version(promo_dir: Path) -> Path | None:
    """The promoted drafter's version folder, or None before the first promotion."""
    link = promo_dir / CURRENT
    return link.resolve() if link.exists() else None


def choose_base(record: Path, data_id: str, current: Path | None) -> Path | None:
    """The drafter to warm-start from for this data: the one chosen when it was first trained, else `current`."""
    chosen = read_json(record)
    if chosen and chosen.get("data") == data_id:
        return Path(chosen["base"]) if chosen.get("base") else None
    atomic_write_json(record, {"data": data_id, "base": str(current) if current else None})
    return current


def check_base(base: Path, target: str, draft_vocab_size: int, aux_ids: list[int]) -> list[str]:
    """Why a warm start from `base` cannot continue into this run (preflight reports these before any load)."""
    cfg = json.loads((base / "config.json").read_text())
    problems = []
    verifier = cfg.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    if verifier != target:
        problems.append(f"it was trained for the target {verifier}, this run's target is {target}")
    if cfg.get("draft_vocab_size") not in (None, draft_vocab_size):
        problems.append(
            f"its draft vocabulary has {cfg['draft_vocab_size']} tokens, vocab.draft_vocab_size is {draft_vocab_size}"
        )
    if list(cfg.get("eagle_aux_hidden_state_layer_ids") or []) != list(aux_ids):
        problems.append(f"it reads layers {cfg.get('eagle_aux_hidden_state_layer_ids')}, this run extracts {aux_ids}")
    if not problems:
        return []
    return [
        f"cannot warm-start from the current drafter {base}: {'; '.join(problems)}. Make the config match it, "
        "or set promotion.warm_start: false to train from scratch"
    ]


def decide(candidate: dict, current: dict | None) -> tuple[bool, str]:
    """Promote when the candidate is clearly better than the untrained baseline it was measured beside (when there
    was one) and than the current drafter, each by a paired comparison on the same prompts (`candidate["versus"]`,
    attached by the evaluation's report, or computed here from both measurements' per-request counts)."""
    from eyrie.stages.evaluate import paired_difference
    from eyrie.vllm.provenance import differences

    new = candidate.get("acceptance_length")
    if new is None:
        return False, "the new drafter's acceptance length could not be measured (no drafts): the current one stays"
    versus = candidate.get("versus") or {}
    for label, what in (("untrained", "an untrained drafter"), ("floor", "no drafter (acceptance length 1.0)")):
        if (base := versus.get(label)) is not None and not base["clearly_better"]:
            return False, f"it is not clearly better than {what} ({_paired(base)}): a useless drafter is never promoted"
    if current is None:
        return True, "there is no current drafter yet"
    if changed := differences(candidate.get("served_under"), current.get("served_under")):
        return False, (
            f"the current drafter was measured under another server than the new one ({'; '.join(changed)}): "
            "nothing is compared across servers; run again, which measures the current drafter again"
        )
    old = current.get("acceptance_length")
    if old is None:
        return True, f"acceptance length {new}; the current drafter's could not be measured"
    cmp = versus.get("current") or paired_difference(candidate, current)
    if cmp is None:  # no per-request counts (a measurement from before they were kept): the figures alone
        if new > old:
            return (
                True,
                f"acceptance length {new} is above the current drafter's {old} (unpaired: no per-request counts)",
            )
        return False, f"acceptance length {new} is not above the current drafter's {old}: the current drafter stays"
    if cmp["clearly_better"]:
        return True, f"it is clearly better than the current drafter ({_paired(cmp)})"
    return False, f"it is not clearly better than the current drafter ({_paired(cmp)}): the current drafter stays"


def _paired(cmp: dict) -> str:
    return (
        f"acceptance length {cmp['new']} vs {cmp['old']} on the same {cmp['prompts']} prompts, difference "
        f"{cmp['difference']:+} with standard error {cmp['se']}"
    )


LOCK = "promotion.lock"


@contextmanager
def promotion_lock(promo_dir: Path):
    """Exclusive across the runs (and nodes, on a filesystem whose flock is shared) that promote into `promo_dir`."""
    promo_dir.mkdir(parents=True, exist_ok=True)
    with open(promo_dir / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def promote(promo_dir: Path, drafter: Path, version: str, record: dict) -> Path:
    """Copy `drafter` to versions/<version> (once) and point `current` at it."""
    versions = promo_dir / "versions"
    dest = versions / version
    if not (dest / "promotion.json").exists():
        staging = versions / f".{version}.staging"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(drafter, staging)
        atomic_write_json(staging / "promotion.json", record)
        # Every byte of the copy on disk before its name says it is whole: a power cut after the swap must not
        # leave `current` pointing at a version whose files never reached the disk.
        fsync_tree(staging)
        os.replace(staging, dest)
        fsync_path(versions)
    link = promo_dir / f".{CURRENT}.{os.getpid()}"
    link.unlink(missing_ok=True)
    os.symlink(dest.relative_to(promo_dir), link)
    os.replace(link, promo_dir / CURRENT)
    fsync_path(promo_dir)  # the swap itself survives a power cut
    return dest


def decide_and_promote(
    promo_dir: Path, drafter: Path, version: str, candidate: dict, current: dict | None, context: dict
) -> dict:
    """Promote `drafter` if it is clearly better than the current one (and than the untrained baseline); log the
    decision either way. `current` is the current drafter's measurement in this run (its `drafter`: the version
    folder measured), None when there was none. Decided and swapped under the promotion folder's lock."""
    with promotion_lock(promo_dir):
        now = current_version(promo_dir)
        if now is not None and now.name == version:
            return {
                "promoted": True,
                "version": version,
                "reason": "it is already the current drafter",
                "current": str(promo_dir / CURRENT),
            }
        measured = Path(current["drafter"]).name if current and current.get("drafter") else None
        if current is not None and measured is None:
            measured = now.name if now else None  # a measurement that does not say which version it was of
        if (now.name if now else None) != measured:
            promoted, reason = (
                False,
                (
                    f"the current drafter changed since this run measured against it (measured "
                    f"{measured or 'none'}, now {now.name if now else 'none'}: another run promoted meanwhile): run "
                    "again to measure against the new current drafter"
                ),
            )
        else:
            promoted, reason = decide(candidate, current)
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "version": version,
            "promoted": promoted,
            "reason": reason,
            "acceptance_length": candidate.get("acceptance_length"),
            "current_before": str(now) if now else None,
            "current_acceptance_length": current.get("acceptance_length") if current else None,
            "comparisons": candidate.get("versus") or {},
            # What each was measured under (vLLM version, model runner, attention backend, serving arguments): a
            # later run's comparison with this drafter measures it again when its server differs.
            "served_under": candidate.get("served_under"),
            "current_served_under": current.get("served_under") if current else None,
            **context,
        }
        if promoted:
            promote(promo_dir, drafter, version, entry)
        with open(promo_dir / "history.jsonl", "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
    return {**entry, "current": str(promo_dir / CURRENT)}
