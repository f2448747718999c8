"""On vLLM's CPU platform, vLLM's inspection of a model class it has not cached runs in the asking process instead of
a subprocess importing vLLM again (eyrie/vllm/plugin/model_inspection.py); elsewhere vLLM's subprocess stays."""

from __future__ import annotations

import os

from vllm.model_executor.models import registry
from vllm.platforms import current_platform

from eyrie.vllm.plugin.model_inspection import inspect_models_in_process


def test_on_the_cpu_platform_the_inspection_runs_in_this_process(monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "_run_in_subprocess", registry._run_in_subprocess)  # put back after the test
    assert current_platform.is_cpu()
    inspect_models_in_process()
    runner = registry._run_in_subprocess
    assert runner(os.getpid) == os.getpid()  # run here, not in a child
    inspect_models_in_process()
    assert registry._run_in_subprocess is runner  # idempotent
    # vLLM's own path on an empty cache: inspected here, and cached for the next process as before
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    info = registry.ModelRegistry.models["LlamaForCausalLM"].inspect_model_cls()
    assert info.is_text_generation_model and not info.is_pooling_model
    assert [p.name for p in (tmp_path / "modelinfos").iterdir()] == [
        "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    ]


def test_on_another_platform_vllm_keeps_its_subprocess(monkeypatch):
    original = registry._run_in_subprocess
    monkeypatch.setattr(registry, "_run_in_subprocess", original)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    inspect_models_in_process()
    assert registry._run_in_subprocess is original
