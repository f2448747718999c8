from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from eyrie.stages.export import export_and_prove
from eyrie.vllm.client import ServerClient
from eyrie.vllm.spec import ServerSpec
from tasks.caching import stage_task
from tasks.serving import serve


@stage_task("export", retries=1)
def export_task(
    checkpoint: str,
    out_dir: str,
    target_model: str,
    aux_ids: list[int],
    hidden_size: int,
    key: str,
    spec: ServerSpec,
    probe: list[dict],
    startup_timeout_s: float,
) -> dict:
    """Write the drafter, then prove vLLM serves it as eagle3 (the server stays up for evaluation to reuse)."""
    out = Path(out_dir)

    def serve_drafter(drafter: str) -> ServerClient:
        return serve(replace(spec, drafter=drafter), out / "server-trained", startup_timeout_s)

    return export_and_prove(Path(checkpoint), out, target_model, aux_ids, hidden_size, key, serve_drafter, probe)
