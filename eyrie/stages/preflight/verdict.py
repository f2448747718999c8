"""Preflight's verdict on the target, the installed vLLM and the config, as a keyed result.

Checking the target's vLLM class, vLLM's own server parser and its variable registry imports vLLM: about 8 s of a
fully cached `eyrie run` that otherwise reads a few manifests. The verdict depends only on what its key holds
(`eyrie.run.identity.VERDICTS["preflight"]`): the config sections it reads, the target's files and tokenizer files,
the installed vLLM, transformers, torch and speculators, the source of the checks and the variables they read, and
whether serving was checked. So a passing verdict is kept in the run folder (`preflight-verdict.json`) under that
key, and a later preflight with the same key reuses it without importing vLLM. A failing verdict is never kept: what
made it fail may be fixed outside the key (a package installed), and checking again costs seconds. The checks of the
node (GPUs, the run lock's flock, /dev/shm, the disk, the promotion folder) are not part of it and run every time.

Only a stamped run folder keeps a verdict (`eyrie preflight` on a folder that is not a run's writes nothing there).
"""

from __future__ import annotations

import os
from dataclasses import fields
from functools import lru_cache
from pathlib import Path

from eyrie.config import PipelineConfig
from eyrie.run.files import atomic_write_json, read_json, sha256_file, sha256_json
from eyrie.run.folder import STAMP
from eyrie.run.identity import VERDICTS, key
from eyrie.run.vllm_python import one_environment, vllm_environment
from eyrie.stages.preflight.report import PreflightReport
from eyrie.target.metadata import file_identity

VERDICT = "preflight-verdict.json"
# The variables the checks read (eyrie.stages.preflight.target: the compatibility layer's switch; the test hook that
# hides a class's EAGLE-3 interface; installed_vllm: vLLM's model-runner switch, which the servers inherit (up to
# 0.33: 0.34 has only V2 and does not read it, and the runner rule says so);
# startup: where the servers' vLLM cache is and whether the start-up plan is set already, eyrie.vllm.levers).
ENVIRONMENT = (
    "EYRIE_EAGLE3_COMPAT",
    "EYRIE_TEST_HIDE_EAGLE3",
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_CACHE_ROOT",
    "XDG_CACHE_HOME",
    "VLLM_ENABLE_STARTUP_PLAN",
)
# What the verdict holds of the vLLM interpreter's environment when it is not this one (eyrie.run.vllm_env_facts).
VLLM_ENVIRONMENT_FACTS = ("python", "vllm", "vllm_distribution", "cpu_build", "libraries", "eyrie_source")
# The code whose decisions the verdict records: a change of any of it checks again.
_EYRIE = Path(__file__).resolve().parents[2]
CHECK_SOURCES = (
    "stages/preflight",
    "target/metadata.py",
    "target/drafter.py",
    "target/hub.py",
    "target/labels.py",
    "stages/evaluate/sets.py",  # the evaluation sets read
    "stages/evaluate/variants.py",  # the chat-template variant warnings
    "vllm/spec.py",
    "vllm/levers.py",  # the start-up levers each server gets
    "vllm/loading.py",  # where vLLM's cache is
    "vllm/plugin",
    "hidden_states/encoding.py",
    "config.py",
)


@lru_cache(maxsize=1)
def checks_identity() -> str:
    """The source of the checks, by content."""
    files = []
    for rel in CHECK_SOURCES:
        p = _EYRIE / rel
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return sha256_json([(f.relative_to(_EYRIE).as_posix(), sha256_file(f)) for f in files if f.is_file()])[:16]


def verdict_key(config: PipelineConfig, serve: bool) -> str:
    """The verdict's key: the whole config, since its declaration (`VERDICTS["preflight"]`) keys whole sections."""
    decl = VERDICTS["preflight"]
    files = {kind: file_identity(kind, config.target) for kind in decl.files}
    environment: dict = {name: os.environ.get(name) for name in ENVIRONMENT}
    if not one_environment():  # the checks run in the vLLM interpreter's environment: what it holds counts
        facts = vllm_environment()
        environment["vllm_environment"] = {k: facts.get(k) for k in VLLM_ENVIRONMENT_FACTS}
    return key("preflight", config, files, serve=serve, checks=checks_identity(), environment=environment)


def load_verdict(run_dir: Path, verdict_key: str) -> PreflightReport | None:
    """The passing verdict kept under `verdict_key` in `run_dir`, as a report (reused), or None."""
    kept = read_json(Path(run_dir) / VERDICT)
    if not isinstance(kept, dict) or kept.get("key") != verdict_key or not isinstance(kept.get("report"), dict):
        return None
    names = {f.name for f in fields(PreflightReport)}
    data = kept["report"]
    if not names >= set(data) or data.get("failures"):
        return None
    report = PreflightReport(**data)
    report.verdict_key, report.verdict_reused = verdict_key, True
    return report


def save_verdict(run_dir: Path, verdict_key: str, report: PreflightReport) -> None:
    """Keep a passing verdict in a stamped run folder."""
    report.verdict_key = verdict_key
    if report.failures or not (Path(run_dir) / STAMP).is_file():
        return
    atomic_write_json(Path(run_dir) / VERDICT, {"key": verdict_key, "report": report.as_dict()})
