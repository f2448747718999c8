"""Preflight and the vLLM start-up levers: each server's levers recorded in the report, and a lever the operator
asks for that cannot work for the target refused before any load, with the reason."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import config_dict

from eyrie.config import parse_config
from eyrie.errors import PreflightError
from eyrie.stages.preflight.check import run_preflight
from eyrie.stages.preflight.report import report_markdown, report_text
from eyrie.vllm import levers


@pytest.fixture
def kimi(tmp_path, tiny_kimi) -> Path:
    return Path(shutil.copytree(tiny_kimi, tmp_path / "kimi"))


def test_preflight_records_each_servers_levers(kimi, tmp_path):
    report = run_preflight(parse_config(config_dict(kimi)), tmp_path / "run", serve=False)
    assert report.failures == []
    found = report.startup_levers["extraction"]
    assert found["language-model-only"]["status"] == "applied"
    assert found["startup-plan"]["status"] == "applied"  # vLLM 0.32 has VLLM_ENABLE_STARTUP_PLAN
    assert found["weight-cache"]["status"] == "off" and found["snapshot"]["status"] == "off"
    assert any(
        n.startswith("start-up lever for the extraction server: language-model-only (--language-model-only)")
        for n in report.notes
    ), report.notes
    # both renderings name each server's applied levers (compile-cache only where VLLM_CACHE_ROOT is not a
    # temporary folder: a checkout under /tmp warns instead)
    applied = ", ".join(name for name, lever in found.items() if lever["status"] == "applied")
    assert applied.startswith("language-model-only, startup-plan"), found
    assert f"| start-up levers | extraction: {applied} |" in report_markdown(report)
    assert f"levers        extraction: {applied}" in report_text(report)


def test_a_lever_that_cannot_work_is_refused_before_any_load(kimi, tmp_path):
    config = parse_config(config_dict(kimi, extraction={"startup": {"weight_cache": True, "snapshot": True}}))
    with pytest.raises(PreflightError) as info:
        run_preflight(config, tmp_path / "run", serve=False)
    failures = [f for f in info.value.failures if "start-up lever" in f]
    assert len(failures) == 2, info.value.failures
    weight, snapshot = sorted(failures, key=lambda f: "snapshot" in f)
    assert "weight-cache (refused)" in weight and "CPU build" in weight  # the installed vLLM is its CPU build
    assert "snapshot (refused)" in snapshot and "speculative decoding (extract_hidden_states)" in snapshot
    assert "Fix: set it off" in weight


def test_the_int4_moe_method_is_refused_for_the_weight_cache(kimi, tmp_path, monkeypatch):
    """Kimi-K2.5 INT4's quantization (compressed-tensors) on a GPU build of the installed vLLM: its MoE methods
    declare no `supports_pre_processed_weights`, so vLLM's IPC loader would refuse every expert layer after the
    daemon read the weights; preflight refuses it from config.json."""
    gpu = replace(levers.installed_facts(), cpu_build=False)
    monkeypatch.setattr(levers, "installed_facts", lambda: gpu)
    cfg = json.loads((kimi / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (kimi / "config.json").write_text(json.dumps(cfg))
    args = [*config_dict(kimi)["extraction"]["server_args"], "--load-format", "ipc_cache"]
    config = parse_config(config_dict(kimi, extraction={"server_args": args, "unproven_aux_layers": "warn"}))
    report = run_preflight(config, tmp_path / "run", serve=False, raise_on_failure=False)
    refused = [f for f in report.failures if "start-up lever" in f]
    assert len(refused) == 1, report.failures
    assert "weight-cache (refused)" in refused[0] and "compressed-tensors MoE method" in refused[0]
    assert "UnsupportedQuantForIPCError" in refused[0]
    assert report.startup_levers["extraction"]["weight-cache"]["asked"] is True
