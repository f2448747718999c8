"""`eyrie verify`: read every file a run folder's manifests list and compare it with the sha256 recorded for it.

A run does not do this: it trusts a hidden-state file whose stat (size, mtime, inode) is the one its manifest
recorded (`eyrie.stages.extract.shard_complete`), so a cached re-run reads no hidden-state bytes. What a stat cannot
see,
bit rot or a write that keeps size, mtime and inode, only a full read finds: this scrub, run by hand or on a schedule.

What it does with a damaged file, so that the next `eyrie run` redoes exactly that work and nothing else:

- a hidden-state file (listed by `extract/shards/<shard>.json`) is removed: its shard then fails the stat check (a
  listed file is missing) and the next run extracts only the missing samples (a damaged pack, `extraction.storage:
  packed`: its whole shard);
- a file listed by a stage manifest (regenerate, vocab, export): that `<stage>/manifest.json` is removed, and the
  next run redoes the stage;
- a file of a training checkpoint (the train manifest lists the shipped one): the manifest is removed and the
  checkpoint stops counting (`eyrie.stages.train.checkpoints.quarantine`: renamed `<N>.damaged`), so the next run
  resumes from the newest whole checkpoint before it, or trains from scratch, and never vouches for the rotted file.

It changes nothing with `report_only`, or while a run holds the folder's lock (that run may be reading the files):
then it says so, and a later `eyrie verify` does it. Missing files need nothing removed: the next run sees them.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from eyrie import FORMAT_VERSION
from eyrie.errors import EyrieError, RunFolderError
from eyrie.hidden_states.packs import shard_entries
from eyrie.run.files import read_json, within
from eyrie.run.folder import STAMP, RunFolder
from eyrie.run.manifest import file_problem, listed
from eyrie.stages import RUN_FOLDER_STAGES
from eyrie.stages.prepare import load_shards
from eyrie.stages.regenerate import extraction_source
from eyrie.stages.train.checkpoints import checkpoint_holding, quarantine

CHUNK = 64  # files per task handed to a worker: 200,000 files make 3,125 tasks, not 200,000 futures
SHOWN = 50  # damaged files named in the summary; the count covers all of them


@dataclass(frozen=True)
class Listed:
    """One file a manifest vouches for."""

    path: Path
    sha256: str
    size: int | None  # None: a stage manifest from before sizes were recorded
    owner: str  # the shard's name, or the stage's
    manifest: Path


def shard_files(run: RunFolder, manifest_path: Path, manifest: dict) -> list[Listed]:
    owner = manifest.get("shard") or manifest_path.stem
    if not manifest.get("files"):
        return []
    return [
        Listed(
            run.hidden_states / name,
            manifest["files"][idx]["sha256"],
            manifest["files"][idx]["bytes"],
            owner,
            manifest_path,
        )
        for idx, name in shard_entries(manifest)  # each sample's file, or the shard's pack
    ]


def stage_files(run: RunFolder, stage: str, manifest: dict) -> list[Listed]:
    """The files a stage manifest lists (by their paths relative to the stage's folder)."""
    return [
        Listed(path, digest, size, stage, run.manifest(stage))
        for path, size, digest in listed(run.stage(stage), manifest)
    ]


@dataclass
class Listing:
    files: list[Listed] = field(default_factory=list)
    shard_manifests: int = 0
    stage_manifests: int = 0
    skipped: list[str] = field(default_factory=list)  # manifests not checked, and why
    problems: list[str] = field(default_factory=list)  # manifests that cannot be checked: count as damage


def listed_files(run: RunFolder) -> Listing:
    """Every file the run folder's manifests vouch for: the current shards' (those of the `shards.json` extraction
    last read: prepare's, or regenerate's) and the stage manifests'. A shard manifest from an earlier plan (other
    rows or content) is skipped: its files may since belong to a current shard."""
    out = Listing()
    source = extraction_source(run)
    plan = {s.name: s for s in load_shards(source)}
    for path in sorted(run.shard_manifests.glob("*.json")) if run.shard_manifests.is_dir() else []:
        m = read_json(path)
        if not m or not isinstance(m.get("files"), dict):
            out.skipped.append(f"{path.relative_to(run.root)}: unreadable (a shard that never finished)")
            continue
        s = plan.get(m.get("shard") or path.stem)
        if plan and (s is None or m.get("fingerprint") != s.fingerprint or m.get("rows") != [s.start, s.stop]):
            current = (source / "shards.json").relative_to(run.root)
            out.skipped.append(f"{path.relative_to(run.root)}: not a shard of the current {current}")
            continue
        out.shard_manifests += 1
        out.files += _inside(run, shard_files(run, path, m), run.hidden_states, out)
    for stage in RUN_FOLDER_STAGES:
        m = read_json(run.manifest(stage)) if stage != "extract" else None
        if not m or not m.get("files"):
            continue
        out.files += _inside(run, stage_files(run, stage, m), run.stage(stage), out)
        out.stage_manifests += 1
    return out


def _inside(run: RunFolder, items: list[Listed], folder: Path, out: Listing) -> list[Listed]:
    """The items inside `folder`; one naming a path outside it (`../..` in a damaged or edited manifest, a symlinked
    folder) is a problem of its manifest, never read nor removed."""
    kept = []
    for item in items:
        if within(item.path, folder):
            kept.append(item)
        else:
            out.problems.append(
                f"{_rel(item.manifest, run.root)} lists {item.path}, outside {_rel(folder, run.root)}: not read and "
                "not removed; the manifest is damaged or was edited (remove it, and the next `eyrie run` redoes "
                "that work)"
            )
    return kept


def check_file(item: Listed) -> tuple[int, str | None]:
    """(bytes read, what is wrong or None)."""
    problem = file_problem(item.path, item.size, item.sha256)
    return (0, problem) if problem else (item.path.stat().st_size, None)


@dataclass
class VerifyReport:
    run_dir: Path
    files: int
    bytes: int
    seconds: float
    workers: int
    shard_manifests: int
    stage_manifests: int
    bad: list[tuple[Listed, str]]
    problems: list[str]
    skipped: list[str]
    changed: list[str] = field(default_factory=list)  # what was removed, and what the next run then does
    unchanged_because: str | None = None  # why damaged files were left as they are

    @property
    def ok(self) -> bool:
        return not self.bad and not self.problems

    def summary(self) -> str:
        rate = self.bytes / self.seconds / 2**30 if self.seconds > 0 else 0.0
        lines = [
            f"verified {self.files:,} files ({self.bytes / 2**30:.2f} GiB) listed by {self.shard_manifests} shard "
            f"and {self.stage_manifests} stage manifests of {self.run_dir} in {self.seconds:.1f} s: {rate:.2f} GiB/s "
            f"with {self.workers} workers"
        ]
        lines += [f"skipped {s}" for s in self.skipped[:SHOWN]]
        if len(self.skipped) > SHOWN:
            lines.append(f"skipped {len(self.skipped) - SHOWN} more manifests")
        if self.ok:
            lines.append("every file matches its manifest" if self.files else "no manifest lists files yet")
            return "\n".join(lines)
        lines += [f"PROBLEM: {p}" for p in self.problems]
        if self.bad:
            lines.append(f"{len(self.bad)} damaged file(s):")
            lines += [
                f"  {_rel(item.path, self.run_dir)} ({item.owner}): {problem}" for item, problem in self.bad[:SHOWN]
            ]
            if len(self.bad) > SHOWN:
                lines.append(f"  ... and {len(self.bad) - SHOWN} more")
        lines += self.changed
        if self.unchanged_because:
            lines.append(f"nothing was changed: {self.unchanged_because}")
        return "\n".join(lines)


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def default_workers() -> int:
    # Threads: hashlib releases the GIL while it hashes, and a network filesystem serves parallel reads faster.
    return min(32, 2 * (os.cpu_count() or 1))


def verify_run(
    run_dir: str | Path, workers: int | None = None, report_only: bool = False, progress: bool = True
) -> VerifyReport:
    """Hash every file the manifests of `run_dir` list, `workers` at a time; remove what is damaged as the module
    docstring says (unless `report_only`). `progress`: a tqdm bar on stderr, when that is a terminal."""
    from tqdm import tqdm

    run = RunFolder(run_dir)
    _check_run_folder(run)
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise EyrieError(f"--workers {workers}: give at least 1")
    listing = listed_files(run)
    items = listing.files
    chunks = [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]

    def one_chunk(chunk: list[Listed]) -> list[tuple[int, str | None]]:
        return [check_file(item) for item in chunk]

    total = sum(i.size or 0 for i in items) or None
    t0 = time.perf_counter()
    results: list[tuple[int, str | None]] = []
    bar = tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", disable=None if progress else True
    )
    with bar, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="eyrie-verify") as pool:
        for out in pool.map(one_chunk, chunks):
            results += out
            bar.update(sum(n for n, _ in out))
    seconds = time.perf_counter() - t0
    report = VerifyReport(
        run.root,
        len(items),
        sum(n for n, _ in results),
        seconds,
        workers,
        listing.shard_manifests,
        listing.stage_manifests,
        [(item, problem) for item, (_, problem) in zip(items, results) if problem],
        listing.problems,
        listing.skipped,
    )
    if report.bad and report_only:
        report.unchanged_because = (
            "--report-only; without it `eyrie verify` removes the damaged files (a stage's: its manifest), so the "
            "next `eyrie run` redoes that work"
        )
    elif report.bad:
        try:
            with run.lock():
                _remove_damaged(run, report)
        except RunFolderError as err:  # only the lock raises it: a run holds the folder
            report.unchanged_because = f"{err}. Run `eyrie verify` again once that run has ended."
    return report


def _check_run_folder(run: RunFolder) -> None:
    if not run.root.is_dir():
        raise RunFolderError(f"no run folder at {run.root}: pass the --run-dir of a run")
    stamp = read_json(run.root / STAMP)
    if stamp is None:
        raise RunFolderError(f"{run.root} is not an Eyrie run folder ({STAMP} is missing or unreadable)")
    if stamp.get("format_version") != FORMAT_VERSION:
        raise RunFolderError(
            f"run folder {run.root} has format {stamp.get('format_version')}; this Eyrie reads format "
            f"{FORMAT_VERSION}: verify it with the Eyrie version that made it"
        )


def _remove_damaged(run: RunFolder, report: VerifyReport) -> None:
    """Holding the run lock: remove what is still damaged and still listed (a run may have redone it meanwhile)."""
    listed_now = set(listed_files(run).files)
    removed, missing, stages, checkpoints = 0, 0, set(), set()
    for item, _ in report.bad:
        if item not in listed_now or check_file(item)[1] is None:
            continue
        if item.manifest == run.manifest(item.owner):  # a stage's file: the stage is redone
            stages.add(item.owner)
            # A file the redo would resume from (a training checkpoint) must stop counting, or the redo finds the
            # work done and vouches for it again.
            held = checkpoint_holding(item.path)
            if held is not None and within(held, run.stage(item.owner)) and held.is_dir():
                checkpoints.add(held)
        elif item.path.exists() and within(item.path, run.hidden_states):  # listed_files keeps only these
            item.path.unlink()
            removed += 1
        else:
            missing += 1
    if removed:
        report.changed.append(
            f"removed {removed} damaged hidden-state file(s): their shards no longer pass the stat check, and the "
            "next `eyrie run` extracts only those samples again"
        )
    if missing:
        report.changed.append(f"{missing} hidden-state file(s) are missing: the next `eyrie run` extracts them again")
    for folder in sorted(checkpoints):
        aside = quarantine(folder)
        report.changed.append(
            f"moved the damaged checkpoint {_rel(folder, run.root)} aside to {aside.name}: the next `eyrie run` "
            "resumes from the newest whole checkpoint before it (or trains from scratch)"
        )
    for stage in sorted(stages):
        run.manifest(stage).unlink(missing_ok=True)
        report.changed.append(f"removed {stage}/manifest.json: the next `eyrie run` redoes the {stage} stage")
