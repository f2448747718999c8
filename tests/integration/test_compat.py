"""Targets whose vLLM classes lack the EAGLE-3 interface (GPT-2 and OPT in the installed vLLM) go through the whole
pipeline on Eyrie's compatibility layer: preflight reports the path, extraction runs through the flow and matches
transformers, and vLLM serves the exported drafter as `eagle3` for evaluation."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import REPO, build_tiny_target, eyrie_run, register_server_folder, write_config
from safetensors.torch import load_file

from eyrie.config import TargetConfig
from eyrie.run.files import read_json
from eyrie.stages.preflight import probe_eagle3, resolve_vllm_class
from eyrie.target.metadata import read_target_config

LAYER_IDS = [2, 4, 5]


ARCHS = [("tiny-gpt2", "GPT2LMHeadModel"), ("tiny-opt", "OPTForCausalLM")]


@pytest.mark.parametrize("kind, arch", ARCHS)
def test_preflight_reports_the_compatibility_path(kind, arch):
    cls = resolve_vllm_class(arch)
    assert not getattr(cls, "supports_eagle3", False), f"{arch} implements the interface in this vLLM now"
    probe = probe_eagle3(read_target_config(TargetConfig(model=str(build_tiny_target(kind)))))
    assert probe.path == "compat" and "compatibility layer" in probe.reason


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.usefixtures("flow_api")
@pytest.mark.parametrize("kind, arch", ARCHS)
def test_whole_pipeline_through_the_compatibility_layer(tmp_path, kind, arch):
    target = build_tiny_target(kind)
    config, _ = write_config(
        tmp_path / "config.yaml",
        target,
        kind,
        max_samples=32,
        shard_size=16,
        layer_ids=LAYER_IDS,
        name="compat",
        train={"epochs": 1, "lr": 3e-3, "max_seq_len": 512},
        evaluate={"num_prompts": 4, "max_tokens": 16, "num_speculative_tokens": 2, "untrained_baseline": "never"},
    )  # test_pipeline.py compares
    run = tmp_path / "run"
    for folder in (run / "extract", run / "export" / "server-trained"):
        register_server_folder(folder)
    cmd = eyrie_run(config, run)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1700)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]

    preflight = read_json(run / "preflight.json")
    assert preflight["eagle3_path"] == "compat" and preflight["architecture"] == arch
    # A sample extracted through the flow matches transformers' residual stream entering each aux layer.
    sample = load_file(str(run / "extract" / "hidden_states" / "hs_0.safetensors"))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32)
    with torch.no_grad():
        ref = hf(sample["token_ids"][None], output_hidden_states=True).hidden_states
    for j, k in enumerate(LAYER_IDS):
        got, want = sample["hidden_states"][:, j].float(), ref[k][0]
        assert ((got - want).norm() / want.norm()).item() < 0.03, f"layer {k}"

    export = read_json(run / "export" / "manifest.json")
    assert export["vllm_proof"]["completion_tokens"] > 0
    assert (
        json.loads((run / "export" / export["drafter"] / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
        == LAYER_IDS
    )
    result = read_json(run / "evaluate" / "trained.json")
    assert result["drafts"] > 0 and result["acceptance_length"] >= 1.0
