"""promote: the drafter serving loads from one stable path, replaced only by a drafter that is at least as good.

Layout of `promotion.dir`:
  current -> versions/<id>     a relative symlink; point vLLM's speculative config at `<dir>/current`
  versions/<id>/               a full copy of an exported drafter plus `promotion.json` (why it was promoted)
  history.jsonl                every decision, promoted or not, one JSON line each
Versions are never changed once written, and the link is swapped by rename, so a reader sees the old drafter or
the new one, never a mix. A run warm-starts from the version that was current when its training began; that
choice is recorded in the run folder so re-runs of the same data train (and cache) the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from eyrie.run.folder import atomic_write_json, read_json

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
    """Promote when there is no current drafter, or when the candidate's acceptance length is at least its."""
    new = candidate.get("acceptance_length")
    if current is None:
        return True, "there is no current drafter yet"
    old = current.get("acceptance_length")
    if new is None:
        return False, "the new drafter's acceptance length could not be measured (no drafts): the current one stays"
    if old is None or new >= old:
        return True, f"acceptance length {new} is at least the current drafter's {old}"
    return False, f"acceptance length {new} is below the current drafter's {old}: the current drafter stays"


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
        os.replace(staging, dest)
    link = promo_dir / f".{CURRENT}.{os.getpid()}"
    link.unlink(missing_ok=True)
    os.symlink(dest.relative_to(promo_dir), link)
    os.replace(link, promo_dir / CURRENT)
    return dest


def decide_and_promote(
    promo_dir: Path, drafter: Path, version: str, candidate: dict, current: dict | None, context: dict
) -> dict:
    """Promote `drafter` if it is at least as good as the current one; log the decision either way."""
    promo_dir.mkdir(parents=True, exist_ok=True)
    now = current_version(promo_dir)
    if now is not None and now.name == version:
        return {
            "promoted": True,
            "version": version,
            "reason": "it is already the current drafter",
            "current": str(promo_dir / CURRENT),
        }
    promoted, reason = decide(candidate, current)
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "version": version,
        "promoted": promoted,
        "reason": reason,
        "acceptance_length": candidate.get("acceptance_length"),
        "current_before": str(now) if now else None,
        "current_acceptance_length": current.get("acceptance_length") if current else None,
        **context,
    }
    if promoted:
        promote(promo_dir, drafter, version, entry)
    with open(promo_dir / "history.jsonl", "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
    return {**entry, "current": str(promo_dir / CURRENT)}
