"""Preflight names the model runner each vLLM server will use, by the installed vLLM's own rule
(`VllmConfig.use_v2_model_runner`) run on what is known before any load, and refuses a target on Eyrie's
compatibility layer whose runner's hook the installed vLLM lacks. The CPU build has no Triton (always V1); GPU
vLLM's answer is reproduced by giving the same rule Triton."""

from __future__ import annotations

import pytest

from eyrie.config import parse_config
from eyrie.stages.preflight import installed_vllm
from eyrie.stages.preflight.installed_vllm import check_model_runners, parse_server_arguments, server_model_runner
from eyrie.vllm.spec import ServerSpec

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "n_layer": 8, "n_embd": 64}


def _config(tmp_path):
    return parse_config(
        {
            "target": {"model": str(tmp_path / "target"), "max_model_len": 512},
            "data": {"source": str(tmp_path / "data.jsonl"), "max_length": 256},
            "extraction": {"layer_ids": [2, 4, 5], "enforce_eager": True},
        }
    )


def _parsed(config, serving: bool):
    spec = (
        ServerSpec.for_serving(config, "/drafter") if serving else ServerSpec.for_extraction(config, [2, 4, 5, 8], "/s")
    )
    return parse_server_arguments(spec.arguments(8000))


@pytest.fixture
def triton(monkeypatch):
    """GPU vLLM: the same rule with Triton present."""
    from vllm.config import vllm as vllm_config_module

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)


def test_the_cpu_build_runs_v1_for_want_of_triton(tmp_path):
    runner, why = server_model_runner(_parsed(_config(tmp_path), serving=True), LLAMA, {})
    assert (runner, "Triton" in why) == ("V1", True)


def test_with_triton_the_installed_rule_picks_v2_and_the_variable_overrides_it(tmp_path, triton):
    config = _config(tmp_path)
    for serving in (False, True):  # vLLM 0.32 runs extract_hidden_states and eagle3 on V2
        assert server_model_runner(_parsed(config, serving), LLAMA, {})[0] == "V2"
    runner, why = server_model_runner(_parsed(config, True), LLAMA, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert runner == "V1" and "VLLM_USE_V2_MODEL_RUNNER=0" in why


def test_a_compat_target_is_refused_on_a_runner_whose_hook_is_missing(tmp_path, triton, monkeypatch):
    from eyrie.vllm.plugin import compat

    config = _config(tmp_path)
    runners, failures = check_model_runners(config, [2, 4, 5, 8], True, GPT2, "compat")
    assert {r["runner"] for r in runners.values()} == {"V2"} and failures == []
    monkeypatch.setitem(compat.HOOKS, "V2", ("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils", "gone"))
    runners, failures = check_model_runners(config, [2, 4, 5, 8], True, GPT2, "compat")
    assert len(failures) == 2 and all("model runner V2" in f and "gone" in f for f in failures)
    # a native class needs no hook
    assert check_model_runners(config, [2, 4, 5, 8], True, LLAMA, "native")[1] == []


def test_a_rule_reading_what_preflight_cannot_know_says_unknown(tmp_path, monkeypatch):
    from vllm.config import VllmConfig

    def rule(self):
        return self.model_config.something_only_a_load_knows

    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(rule))
    runner, why = server_model_runner(_parsed(_config(tmp_path), True), LLAMA, {})
    assert runner == "unknown" and "model_config.something_only_a_load_knows" in why
    assert installed_vllm.RUNNER_ENV == "VLLM_USE_V2_MODEL_RUNNER"


def test_vllm_0_26s_rule_reads_the_cache_config_and_keeps_moe_targets_on_v1(tmp_path, monkeypatch):
    """vLLM 0.26's rule (read from its source) keeps a MoE target that is not one of its default-V2 architectures on
    V1 and reads sections preflight builds no facts for (`cache_config.kv_sharing_fast_prefill`,
    `ec_transfer_config`): those come from the parsed arguments of the same names, not 'unknown' (as the H200 run
    first printed). The H200's servers ran Kimi's wrapper (MoE) on V1 and Llama and GPT-2 on V2."""
    from vllm.config import VllmConfig

    def rule(self):
        if self.model_config.is_moe and not set(self.model_config.architectures) & {"DeepseekV2ForCausalLM"}:
            return False
        return not self.cache_config.kv_sharing_fast_prefill and self.ec_transfer_config is None

    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(rule))
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"n_routed_experts": 8}}
    parsed = _parsed(_config(tmp_path), True)
    assert server_model_runner(parsed, LLAMA, {})[0] == "V2"
    assert server_model_runner(parsed, kimi, {})[0] == "V1"


def test_the_kept_verdict_is_checked_again_when_the_runner_switch_changes(tmp_path, monkeypatch):
    """The servers inherit VLLM_USE_V2_MODEL_RUNNER, which decides the runner preflight names (and a compat
    target's refusal): a verdict kept under one value is not reused under another."""
    from eyrie.stages.preflight.verdict import verdict_key

    config = _config(tmp_path)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    unset = verdict_key(config, True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert verdict_key(config, True) != unset
