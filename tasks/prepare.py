from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_table_artifact

from eyrie.config import DataConfig, TargetConfig
from eyrie.stages.preflight.ahead import import_ahead
from eyrie.stages.prepare import prepare, prepare_key
from eyrie.target.tiny import build_target
from tasks.caching import eyrie_task, stage_task


@eyrie_task("target", retries=0)
def ensure_target(target: TargetConfig) -> str:
    """Build the configured tiny target if its folder is missing (demo and tests); real targets are left alone."""
    if target.tiny and not Path(target.model, "config.json").exists():
        import_ahead()  # preflight's vLLM imports, on the core the teaching child leaves idle
        build_target(target.tiny, target.model)
    return target.model


@eyrie_task("data-fingerprint")
def compute_prepare_key(target: TargetConfig, data: DataConfig, memo: str | None = None) -> str:
    """prepare's key; with `memo` (a file in the run folder), its costly fingerprints remembered there
    (`eyrie.stages.prepare.prepare_key`)."""
    return prepare_key(target, data, Path(memo) if memo else None)


@stage_task("prepare", retries=1)
def prepare_task(target: TargetConfig, data: DataConfig, out_dir: str, key: str) -> dict:
    manifest = prepare(target, data, Path(out_dir), key=key)
    stats = manifest["stats"]
    rows = [{"measure": k, "value": v} for k, v in stats.items() if not isinstance(v, dict)]
    rows += [{"measure": f"dropped: {k}", "value": v} for k, v in stats["dropped"].items()]
    create_table_artifact(rows, key="data-statistics", description="prepare: rows used and dropped by reason")
    return manifest
