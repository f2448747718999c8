from __future__ import annotations

import logging
import os
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.exceptions import MissingContextError

from eyrie.config import DataConfig, TargetConfig
from eyrie.errors import ConfigError
from eyrie.stages.preflight.ahead import import_ahead
from eyrie.stages.prepare import prepare, prepare_key
from eyrie.target.tiny import build_target
from tasks.caching import eyrie_task, stage_task

# Where `target.tiny` may build its tiny target when the folder is missing: the demo's own place for it
# (configs/demo.yaml: .cache/targets/<tiny>), or anywhere with EYRIE_BUILD_TINY=1 (the tests, a deliberate build).
TINY_HOME = (".cache", "targets")
BUILD_TINY_ENV = "EYRIE_BUILD_TINY"


def may_build_tiny(target: TargetConfig) -> bool:
    """Whether a missing `target.model` is built as the tiny target `target.tiny`. Not because a config copied from
    the demo kept `tiny`: a mistyped model path would then build and teach a tiny model there, silently."""
    return bool(target.tiny) and (
        Path(target.model).parts[-3:] == (*TINY_HOME, target.tiny) or os.environ.get(BUILD_TINY_ENV) == "1"
    )


@eyrie_task("target", retries=0)
def ensure_target(target: TargetConfig) -> str:
    """Build the configured tiny target if its folder is missing, where the demo keeps it (or with
    EYRIE_BUILD_TINY=1); real targets are left alone, and a missing one is named with the fix."""
    if target.tiny and not Path(target.model, "config.json").exists():
        if not may_build_tiny(target):
            raise ConfigError(
                f"target.model {target.model} does not exist (no config.json). target.tiny {target.tiny!r} builds the "
                f"demo's tiny target only at {Path(*TINY_HOME, target.tiny)} (or with {BUILD_TINY_ENV}=1): fix "
                "target.model, or remove target.tiny from a config copied from the demo"
            )
        try:
            log = get_run_logger()
        except MissingContextError:  # called outside a run (a test, a script)
            log = logging.getLogger("eyrie")
        log.info(f"building the tiny target {target.tiny!r} at {target.model} (target.tiny)")
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
