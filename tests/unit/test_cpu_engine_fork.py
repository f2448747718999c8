"""EYRIE_CPU_ENGINE_FORK: the CPU platform's `spawn` is put back to `fork` after its config check, once."""

from __future__ import annotations

import os

from vllm.platforms import cpu

from eyrie.vllm.plugin.fork import fork_cpu_engine


def test_the_engine_core_is_forked_after_the_cpu_platform_chose_spawn(monkeypatch):
    calls = []

    def like_vllm(cls, vllm_config):  # what vLLM's CpuPlatform.check_and_update_config does to the start method
        calls.append(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(like_vllm))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    fork_cpu_engine()
    fork_cpu_engine()  # vLLM may load its plugins more than once in a process: one wrapper, not two
    cpu.CpuPlatform.check_and_update_config("config")
    assert calls == ["config"]  # the platform's own checks still run, once
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
