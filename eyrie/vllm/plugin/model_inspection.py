"""vLLM's model-class inspection in the process that asks, on the CPU platform.

Before it builds an engine, vLLM inspects the target's class (and the speculative model's: `extract_hidden_states`,
Eagle3) for what it supports. A class not yet in its cache (`VLLM_CACHE_ROOT/modelinfos`, keyed by the module's
source) is inspected in a subprocess, so that importing it cannot initialise CUDA in the API server: another
interpreter importing vLLM, 15-17 s each on a 2-core machine. On a fresh install the extraction server paid two of
them and the serving server one, 49 s of the demo's two starts (benchmarks/RESULTS.md). With no CUDA to keep out, the
CPU platform's inspection can run where it is asked; GPU nodes keep vLLM's subprocess.
"""

from __future__ import annotations


def inspect_models_in_process() -> None:
    """On vLLM's CPU platform, vLLM's registry runs its inspection in this process (idempotent)."""
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(registry._run_in_subprocess, "_eyrie_in_process", False):
        return

    def run_here(inspect):
        return inspect()

    run_here._eyrie_in_process = True  # type: ignore[attr-defined]
    registry._run_in_subprocess = run_here
