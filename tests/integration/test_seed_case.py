"""The seed's own case, reproduced on the installed vLLM: Kimi-K2.5's wrapper and its DeepseekV3 backbone as they
were in vLLM 0.16/0.17, without the EAGLE-3 interface (the test-only switch EYRIE_TEST_HIDE_EAGLE3 hides it in
preflight and in every vLLM process). Without Eyrie's compatibility layer preflight refuses the target in seconds,
naming the error the original team met after a 27-minute load; with it, preflight reports `compat` and the tiny
Kimi-K2.5 target's hidden states, extracted through the compatibility layer, match transformers for every aux id and
the last layer.

The extraction runs as production does: tensor parallelism 2 and vLLM's default multi-process engine (API server,
engine core and one worker per rank, each loading Eyrie's plugin), so the layer is proved in every vLLM process. On
the CPU build, two ranks need their threads bound to a core each (VLLM_CPU_OMP_THREADS_BIND); the other tests run
vLLM's engine in one process to start faster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import config_dict, register_server_folder, stop_server
from safetensors.torch import load_file
from test_extraction_correctness import MESSAGES, REL_TOL, _hf_reference, _rel_err

from eyrie.config import parse_config
from eyrie.stages.extract.answered import _wait_and_release
from eyrie.stages.extract.checks import load_checked
from eyrie.stages.preflight import run_preflight
from eyrie.stages.prepare import tokenize_conversation
from eyrie.vllm.plugin import HIDE_EAGLE3
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec

OLD_VLLM = "KimiK25ForConditionalGeneration,DeepseekV3ForCausalLM"


@pytest.fixture
def old_vllm(monkeypatch):
    monkeypatch.setenv(HIDE_EAGLE3, OLD_VLLM)


def test_refused_without_the_compatibility_layer(old_vllm, tiny_kimi, tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_EAGLE3_COMPAT", "0")
    report = run_preflight(parse_config(config_dict(tiny_kimi)), tmp_path / "run", raise_on_failure=False, serve=False)
    assert report.eagle3_path == "unsupported"
    assert (
        len(report.failures) == 1
        and "KimiK25ForConditionalGeneration does not implement SupportsEagle3" in report.failures[0]
        and "Model does not support EAGLE3 interface" in report.failures[0]
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kimi_through_the_compatibility_layer_matches_transformers(old_vllm, tiny_kimi, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    config = parse_config(config_dict(tiny_kimi, layer_ids=[1, 2, 4, 5]))
    report = run_preflight(config, tmp_path / "run", serve=False)
    assert report.eagle3_path == "compat" and "compatibility layer" in report.eagle3_reason

    folder = register_server_folder(tmp_path / "server")
    spec = ServerSpec(
        model=str(tiny_kimi.resolve()),
        layer_ids=report.captured_layer_ids,
        storage_path=str(folder / "staging"),
        max_model_len=256,
        tensor_parallel_size=2,
    )
    try:
        client = VllmServer(folder).ensure(spec, startup_timeout_s=800, log=lambda *_: None)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tiny_kimi))
        ids, _, _ = tokenize_conversation(tok, MESSAGES, 256)
        path = client.extract(ids, 120)
        _wait_and_release(path)
        load_checked(Path(path), ids, len(spec.layer_ids), report.hidden_size)
        hs = load_file(path)["hidden_states"]
        os.unlink(path)
        log = (folder / "server.log").read_text(errors="replace")
    finally:
        stop_server(folder)
    assert "Model does not support EAGLE3 interface" not in log
    # Grafted in each tensor-parallel worker, and no engine ran in the API server's process.
    assert {
        line.split()[0]
        for line in log.splitlines()
        if "compatibility layer serves KimiK25ForConditionalGeneration" in line
    } == {"(Worker_TP0", "(Worker_TP1"}
    assert "(EngineCore" in log
    hf_states, last_pre_norm = _hf_reference(tiny_kimi / "text_model", ids)
    errors = {
        k: _rel_err(hs[:, j], last_pre_norm if k == report.num_layers else hf_states[k])
        for j, k in enumerate(spec.layer_ids)
    }
    print(f"tiny-kimi-k25 through the compatibility layer: relative L2 error per captured id {errors}")
    assert set(errors) == {1, 2, 4, 5, 8} and all(e < REL_TOL for e in errors.values()), errors
