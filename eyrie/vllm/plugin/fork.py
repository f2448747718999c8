"""The engine core forked, not spawned, on vLLM's CPU platform (opt-in: EYRIE_CPU_ENGINE_FORK=1).

vLLM starts a server's engine core with the start method VLLM_WORKER_MULTIPROC_METHOD names, `fork` by default (so on
GPU nodes, unless CUDA is initialised in the API server). Its CPU platform sets `spawn` in `check_and_update_config`,
for the OpenMP settings it gives each process. A spawned engine core is a second interpreter that imports torch,
transformers and vLLM again: a tiny target's server took 81 s to ready with it and 44 s forked, on an idle 2-core
machine (benchmarks/RESULTS.md). The tests run vLLM with one OpenMP thread per process and no binding
(`OMP_NUM_THREADS=1`, `VLLM_CPU_OMP_THREADS_BIND=nobind`), where the API server has no OpenMP pool for a fork to lose.
"""

from __future__ import annotations

import os
from typing import Any


def fork_cpu_engine() -> None:
    """Put `fork` back after the CPU platform's `check_and_update_config` set `spawn` (idempotent)."""
    from vllm.platforms import cpu

    platform: Any = cpu.CpuPlatform
    if getattr(platform.check_and_update_config, "_eyrie_forks", False):
        return
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config._eyrie_forks = True  # type: ignore[attr-defined]
    platform.check_and_update_config = classmethod(check_and_update_config)
