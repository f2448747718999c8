"""The end-to-end DAG: target -> preflight -> prepare -> preflight (disk) -> extract."""

from __future__ import annotations

from prefect import flow, get_run_logger

from eyrie.config import PipelineConfig
from eyrie.store import RunFolder
from flows.extract import extract_flow
from tasks.prepare import compute_prepare_key, ensure_target, prepare_task
from tasks.preflight import preflight_task


@flow(name="eyrie-pipeline")
def pipeline_flow(config: PipelineConfig, run_dir: str) -> dict:
    log = get_run_logger()
    run = RunFolder(run_dir)
    run.ensure()
    with run.lock():
        ensure_target(config)
        preflight_task(config, str(run.root))  # seconds, before anything expensive
        prepared = prepare_task(config, str(run.prepare), compute_prepare_key(config))
        report = preflight_task(config, str(run.root), tokens=prepared["stats"]["tokens"])
        extracted = extract_flow(config, str(run.root), report)
    outputs = {"run_dir": str(run.root), "prepared": str(run.prepare / "dataset"),
               "hidden_states": extracted["hidden_states"], "shards": extracted["shards"]}
    log.info(f"outputs: {outputs}")
    return outputs
