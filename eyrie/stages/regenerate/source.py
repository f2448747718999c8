"""Which folder extraction reads (regenerate's or prepare's), and the stage's status line."""

from __future__ import annotations

from pathlib import Path

from eyrie.config import RegenerateConfig
from eyrie.errors import RegenerationError
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.folder import RunFolder
from eyrie.stages.extract.plan import source_folder
from eyrie.stages.prepare import load_shards
from eyrie.stages.regenerate.shard import STAGE, shard_paths

SOURCE_MARKER = "source.json"  # in the extraction stage's folder: which stage's data it extracted


def extraction_source(run: RunFolder, regenerate: RegenerateConfig | None = None) -> Path:
    """The folder whose dataset and shards.json extraction, vocab and training read: `regenerate/` when the config
    enables regeneration, else `prepare/`. Without it (status, verify), the one extraction last recorded."""
    if regenerate is None:
        recorded = (read_json(run.extract / SOURCE_MARKER) or {}).get("stage")
        return run.stage(recorded) if recorded in (STAGE, "prepare") else run.prepare
    stage_dir = source_folder(run, regenerate)  # the folder extraction's plan reads
    if stage_dir == run.prepare:
        return stage_dir
    m = read_json(stage_dir / "manifest.json")
    prepared = read_json(run.manifest("prepare")) or {}
    if not m or m.get("prepare_key") != prepared.get("key"):
        raise RegenerationError(
            f"regenerate.enabled is set but {stage_dir} holds no regeneration of the current prepared data: run "
            f"`eyrie run --until regenerate` on {run.root} first (or set regenerate.enabled: false)"
        )
    return stage_dir


def record_extraction_source(run: RunFolder, source: Path) -> None:
    """Written by the extraction flow before it extracts, for the readers that have no config."""
    want = {"stage": Path(source).name}
    if read_json(run.extract / SOURCE_MARKER) != want:
        atomic_write_json(run.extract / SOURCE_MARKER, want)


def stage_status(run: RunFolder) -> str:
    """`eyrie status`'s line for the stage: done, or how many shards are."""
    stage_dir = run.stage(STAGE)
    if read_json(stage_dir / "manifest.json"):
        return "done"
    shards = load_shards(run.prepare)
    done = sum(1 for s in shards if read_json(shard_paths(stage_dir, s)[1]))
    return f"{done}/{len(shards)} shards" if done else "not started"
