from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from eyrie.stages.export import export_and_prove
from eyrie.vllm.client import ServerClient
from eyrie.vllm.spec import ServerSpec
from tasks.caching import stage_task
from tasks.serving import serve, stop


@dataclass
class ExportJob:
    checkpoint: str  # the trained drafter's checkpoint
    out_dir: str
    target_model: str
    aux_ids: list[int]
    hidden_size: int
    key: str
    spec: ServerSpec  # target + drafter, as evaluation serves it (the drafter set here)
    probe: list[dict]  # the conversation the proof sends
    startup_timeout_s: float


@stage_task("export", manifest="{job.out_dir}/manifest.json", argument="job.key", retries=1)
def export_task(job: ExportJob) -> dict:
    """Write the drafter, then prove vLLM serves it as eagle3 (the server stays up for evaluation to reuse)."""
    out = Path(job.out_dir)

    def serve_drafter(drafter: str) -> ServerClient:
        return serve(replace(job.spec, drafter=drafter), out / "server-trained", job.startup_timeout_s)

    try:
        return export_and_prove(
            Path(job.checkpoint), out, job.target_model, job.aux_ids, job.hidden_size, job.key, serve_drafter, job.probe
        )
    except Exception:
        # A failed proof leaves no server holding the GPUs for an evaluation that will not come (a kill or a crash
        # of the flow process keeps it, for the retry to reuse).
        stop(out / "server-trained")
        raise
