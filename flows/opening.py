"""The one opening of a run, for every flow that starts one (the pipeline, the extraction fan-out): temporary files
of interrupted writes removed, the target there, hub revisions pinned, preflight, prepare, preflight on the prepared
data's length. A flow that opened a run another way would key its stages on other revisions (a hub-sourced fan-out
once gave its nodes `main`, not the commit the pipeline keys on)."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import get_run_logger, runtime

from eyrie.config import PipelineConfig
from eyrie.run.folder import RunFolder, remove_staging
from eyrie.stages.prepare import is_hub_source
from eyrie.target.metadata import is_local_target
from eyrie.target.pins import pin_for_flow_run
from tasks.preflight import preflight_task
from tasks.prepare import compute_prepare_key, ensure_target, prepare_task


@dataclass
class OpenedRun:
    config: PipelineConfig  # with its hub revisions pinned: what every later stage (and every node) must be given
    prepare_key: str
    prepared: dict  # prepare's manifest
    report: dict  # preflight's, on the prepared data's length


def open_run(config: PipelineConfig, run: RunFolder, serve: bool = False, card: bool = True) -> OpenedRun:
    """Open `run` (its lock held by the caller). `serve`: the run goes on to export and evaluation, which serve
    target + drafter in vLLM (preflight checks that too). `card`: the preflight after prepare leaves the run's
    preflight card (False where a later preflight, after regeneration, leaves it)."""
    log = get_run_logger()
    # Holding the lock, no writer is in flight here: a temporary file left by an atomic write is from a crash.
    # Not walked: the hidden states (one file per sample), where no atomic write happens.
    removed = remove_staging(run.root, skip=run.write_once_folders)
    if removed:
        log.info(f"removed {removed} temporary files left by an interrupted run")
    ensure_target(config.target)
    # Hub revisions pinned to the commits they point at now: every stage keys on those, and a weekly run against a
    # moved `main` retrains (the pinned config is in the run's parameters and preflight.json). A retry of this flow
    # run reuses the commits its first attempt pinned (eyrie/target/pins.py): a `main` moved meanwhile changes no key.
    flow_run_id = str(runtime.flow_run.id) if runtime.flow_run.id else None
    pinned, reused = pin_for_flow_run(
        config.target,
        config.data,
        run.root,
        flow_run_id,
        not is_local_target(config.target),
        is_hub_source(config.data),
    )
    config = config.model_copy(update=pinned._asdict())
    if config.target.revision or config.data.revision:
        how = "as this flow run's first attempt pinned them" if reused else "pinned"
        log.info(f"hub revisions {how}: target {config.target.revision}, data {config.data.revision}")
    preflight_task(config, str(run.root), serve=serve, card=False)  # seconds, before anything expensive
    # The tokenizer's and the data's fingerprints remembered in the run folder under what determines them: a
    # re-run loads no tokenizer (seconds: transformers' import) while nothing it depends on changed.
    prepare_stage_key = compute_prepare_key(config.target, config.data, str(run.fingerprints))
    prepared = prepare_task(config.target, config.data, str(run.prepare), prepare_stage_key)
    report = preflight_task(
        config,
        str(run.root),
        tokens=prepared["stats"]["tokens"],
        serve=serve,
        prepare_key=prepare_stage_key,
        card=card,
    )
    return OpenedRun(config, prepare_stage_key, prepared, report)
