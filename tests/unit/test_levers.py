"""The vLLM start-up levers (eyrie.vllm.levers): the decisions on config dicts and vLLM facts (pure logic), the facts
read from the installed vLLM's source against the imported vLLM itself, the chosen flags parsed by its own server
parser, and the spec that applies them."""

from __future__ import annotations

import shutil
import typing
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import config_dict

from eyrie.config import PipelineConfig, StartupConfig, parse_config
from eyrie.run.identity import SCHEDULING_ENV
from eyrie.stages.preflight.installed_vllm import parse_server_arguments, serve_parser
from eyrie.vllm import levers
from eyrie.vllm.levers import (
    LANGUAGE_MODEL_ONLY_FLAG,
    STARTUP_PLAN_ENV,
    TargetFacts,
    VllmFacts,
    decide,
    installed_facts,
    preprocessed_support,
    target_facts,
)
from eyrie.vllm.spec import ServerSpec

# Kimi-K2.5 INT4's config.json, as far as the levers read it: a DeepseekV3 text backbone in a multimodal wrapper,
# its routed experts quantized by compressed-tensors (pack-quantized int4, group 32).
KIMI = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "text_config": {"model_type": "deepseek_v3", "n_routed_experts": 384, "kv_lora_rank": 512},
    "vision_config": {"model_type": "moonvit"},
    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
}
LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8}
FP8_MOE = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "n_routed_experts": 256,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}
ENV = {"VLLM_CACHE_ROOT": "/var/cache/eyrie/vllm"}


@pytest.fixture(scope="module")
def facts() -> VllmFacts:
    """The installed vLLM's facts (0.32 CPU build), as a GPU build of the same version would have them."""
    found = installed_facts()
    assert found is not None and found.version.startswith("0.32")
    return replace(found, cpu_build=False)


def plan(facts, cfg, kind="extraction", tp=1, args=(), env=ENV, **startup):
    return decide(
        facts,
        target_facts(cfg),
        StartupConfig(**startup),
        kind=kind,
        tensor_parallel_size=tp,
        server_args=list(args),
        environ=dict(env),
    )


def lever(p, name):
    return next(lv for lv in p.levers if lv.name == name)


def test_target_facts_read_the_wrapper_and_its_quantization():
    assert target_facts(KIMI) == TargetFacts(True, ("vision_config",), "compressed-tensors", True)
    assert target_facts(LLAMA) == TargetFacts(False, (), None, False)
    assert target_facts(FP8_MOE) == TargetFacts(False, (), "fp8", True)
    # a text_config alone (a text model keeping its decoder config nested) is no multimodal wrapper
    assert not target_facts({"text_config": {"num_hidden_layers": 2}}).multimodal


def test_the_kimi_wrapper_gets_language_model_only_the_startup_plan_and_the_nodes_cache(facts):
    p = plan(facts, KIMI, tp=8)
    assert p.args == [LANGUAGE_MODEL_ONLY_FLAG] and p.language_model_only
    assert p.env == {STARTUP_PLAN_ENV: "1", "VLLM_CACHE_ROOT": "/var/cache/eyrie/vllm"}
    assert "vision_config beside its text_config" in lever(p, "language-model-only").reason
    assert {lv.name: lv.status for lv in p.levers} == {
        "language-model-only": "applied",
        "startup-plan": "applied",
        "compile-cache": "applied",
        "weight-cache": "off",
        "snapshot": "off",
    }
    assert p.refused == []
    # every variable a lever sets only changes how fast the server starts: none is in an output key
    assert set(p.env) <= SCHEDULING_ENV


def test_a_text_model_and_switched_off_levers_pass_nothing(facts):
    p = plan(facts, LLAMA)
    assert lever(p, "language-model-only").status == "not applicable" and p.args == []
    p = plan(facts, KIMI, language_model_only=False, startup_plan=False, compile_cache=False)
    assert p.args == [] and p.env == {}
    assert {lv.status for lv in p.levers} == {"off"}
    # already given by the operator: not passed twice
    p = plan(facts, KIMI, args=[LANGUAGE_MODEL_ONLY_FLAG], env={**ENV, STARTUP_PLAN_ENV: "0"})
    assert p.args == [] and STARTUP_PLAN_ENV not in p.env


def test_a_vllm_without_a_lever_names_it_unavailable_and_passes_nothing(facts):
    old = replace(
        facts,
        version="0.10.0",
        flags=facts.flags - {LANGUAGE_MODEL_ONLY_FLAG},
        env_vars=facts.env_vars - {STARTUP_PLAN_ENV},
        load_formats=facts.load_formats - {"ipc_cache"},
        subcommands=facts.subcommands - {"snapshot", "preload"},
    )
    p = plan(old, KIMI, weight_cache=True, snapshot=True)
    assert p.args == [] and STARTUP_PLAN_ENV not in p.env
    assert lever(p, "language-model-only").reason == "unavailable in vLLM 0.10.0: it has no --language-model-only flag"
    assert lever(p, "startup-plan").reason.startswith("unavailable in vLLM 0.10.0: it has no VLLM_ENABLE_STARTUP_PLAN")
    # asked for and unavailable: refused (preflight fails); not asked and unavailable: only named
    assert {lv.name for lv in p.refused} == {"weight-cache", "snapshot"}
    unknown = plan(None, KIMI)
    assert unknown.args == [] and unknown.env == {}
    assert {lv.status for lv in unknown.levers} == {"unavailable", "off"}


def test_the_weight_cache_is_refused_for_the_int4_moe_method_and_applied_for_fp8(facts):
    p = plan(facts, KIMI, tp=8, weight_cache=True)
    refused = lever(p, "weight-cache")
    assert refused.status == "refused" and p.refused == [refused]
    assert "compressed-tensors MoE method" in refused.reason
    assert "supports_pre_processed_weights" in refused.reason and "UnsupportedQuantForIPCError" in refused.reason
    assert "--load-format" not in p.args
    p = plan(facts, FP8_MOE, weight_cache=True)
    assert lever(p, "weight-cache").status == "applied" and p.args == ["--load-format", "ipc_cache"]
    assert "vllm preload" in lever(p, "weight-cache").reason
    # asked through server_args instead: checked alike, not passed twice
    p = plan(facts, KIMI, args=["--load-format=ipc_cache"])
    assert lever(p, "weight-cache").status == "refused"
    p = plan(facts, LLAMA, args=["--load-format", "ipc_cache"])
    assert lever(p, "weight-cache").status == "applied" and p.args == []
    # vLLM's CPU build: CUDA IPC only
    p = plan(replace(facts, cpu_build=True), FP8_MOE, weight_cache=True)
    assert lever(p, "weight-cache").status == "refused" and "CPU build" in lever(p, "weight-cache").reason


def test_which_quantization_methods_the_installed_vllm_lets_the_weight_cache_load(facts):
    assert preprocessed_support(facts, None)[0] is True
    assert preprocessed_support(facts, "fp8")[0] is True
    for method in ("compressed-tensors", "awq", "gptq"):
        ok, why = preprocessed_support(facts, method)
        assert ok is False, (method, why)
    ok, why = preprocessed_support(facts, "no-such-method")
    assert ok is None and "no method classes" in why


def test_the_declarations_read_from_source_are_the_classes_own(facts):
    """What read_facts reads of vLLM's quantization methods is what the imported classes say."""
    import importlib

    quant = "vllm.model_executor.layers.quantization."
    for path, cls, ok in sorted(facts.quant_methods):
        if path not in ("fp8.py", "compressed_tensors/compressed_tensors.py", "mxfp4.py", "auto_gptq.py"):
            continue
        real = getattr(importlib.import_module(quant + path[:-3].replace("/", ".")), cls)
        value = real.supports_pre_processed_weights
        if ok is None:  # a property: decided per instance
            assert isinstance(value, property), cls
        else:
            assert value is ok, cls


def test_snapshot_is_refused_for_tensor_parallelism_and_speculative_decoding(facts):
    p = plan(facts, KIMI, tp=8, snapshot=True)
    why = lever(p, "snapshot").reason
    assert lever(p, "snapshot").status == "refused" and p.refused == [lever(p, "snapshot")]
    assert "tensor parallel size 8" in why and "speculative decoding (extract_hidden_states)" in why
    assert (
        "speculative decoding (eagle3)" in lever(plan(facts, LLAMA, kind="serving", snapshot=True), "snapshot").reason
    )
    baseline = lever(plan(facts, LLAMA, kind="target", snapshot=True), "snapshot")
    assert baseline.status == "refused" and "not wired" in baseline.reason


def test_the_compile_cache_is_never_a_temporary_folder(facts, tmp_path):
    p = plan(facts, LLAMA, env={"VLLM_CACHE_ROOT": "/tmp/vllm-cache"})
    assert lever(p, "compile-cache").status == "not applicable" and "VLLM_CACHE_ROOT" not in p.env
    assert "temporary folder" in lever(p, "compile-cache").reason
    p = plan(facts, LLAMA, env={"XDG_CACHE_HOME": "/home/op/.cache"})
    assert p.env["VLLM_CACHE_ROOT"] == "/home/op/.cache/vllm"


def test_the_facts_read_from_source_are_the_imported_vllms_own():
    """read_facts reads vLLM's files without importing it; what it finds is what the imported vLLM says."""
    import vllm
    from vllm import envs
    from vllm.model_executor.model_loader import LoadFormats

    facts = installed_facts()
    assert facts is not None and facts.version == vllm.__version__
    assert facts.env_vars == {name for name in envs.environment_variables if name.startswith("VLLM_")}
    assert facts.load_formats == set(typing.get_args(LoadFormats))
    assert {"serve", "preload", "snapshot"} <= facts.subcommands
    options = set(serve_parser()._option_string_actions)
    assert LANGUAGE_MODEL_ONLY_FLAG in options and LANGUAGE_MODEL_ONLY_FLAG in facts.flags
    assert "--load-format" in options and "--load-format" in facts.flags
    # read from a folder with none of vLLM's files: nothing is available
    empty = levers.read_facts(Path("/nonexistent"), "0.0")
    assert not (empty.flags or empty.env_vars or empty.subcommands or empty.load_formats or empty.quant_methods)


@pytest.fixture
def kimi(tmp_path, tiny_kimi) -> Path:
    """The tiny Kimi-K2.5 (a DeepseekV3 text backbone in the multimodal wrapper), a copy the test may edit."""
    import shutil

    return Path(shutil.copytree(tiny_kimi, tmp_path / "kimi"))


def _config(target: Path, **startup) -> PipelineConfig:
    return parse_config(config_dict(target, extraction={"startup": startup}))


def test_the_installed_vllms_parser_accepts_the_chosen_flags(kimi, monkeypatch, facts):
    """The levers a server is started with, parsed by the installed vLLM's own `vllm serve` parser (a GPU build's
    facts, so that the weight cache applies: the tiny Kimi's config.json says fp8)."""
    import json

    monkeypatch.setattr(levers, "installed_facts", lambda: facts)
    cfg = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    config = _config(kimi, weight_cache=True)
    for spec in (ServerSpec.for_extraction(config, [2, 4], "/staging"), ServerSpec.for_serving(config, "/drafter")):
        assert spec.language_model_only and spec.startup_args == ["--load-format", "ipc_cache"]
        parsed = parse_server_arguments(spec.arguments(8000))
        assert parsed.language_model_only is True
        assert parsed.load_format == "ipc_cache"


def test_the_spec_applies_the_levers_and_keys_only_what_changes_the_server(kimi, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/var/cache/eyrie/vllm")  # the worker unit's
    spec = ServerSpec.for_extraction(_config(kimi), [2, 4], "/staging")
    assert spec.language_model_only and LANGUAGE_MODEL_ONLY_FLAG in spec.arguments(8000)
    assert spec.startup_env == {STARTUP_PLAN_ENV: "1", "VLLM_CACHE_ROOT": "/var/cache/eyrie/vllm"}
    env = spec.environment(environ={}, cpu_build=False)
    assert env[STARTUP_PLAN_ENV] == "1" and env["VLLM_CACHE_ROOT"] == spec.startup_env["VLLM_CACHE_ROOT"]
    # start-up-only levers are not in the server's fingerprint; --language-model-only is
    quiet = ServerSpec.for_extraction(_config(kimi, startup_plan=False, compile_cache=False), [2, 4], "/staging")
    assert quiet.startup_env == {} and quiet.fingerprint() == spec.fingerprint()
    whole = ServerSpec.for_extraction(_config(kimi, language_model_only=False), [2, 4], "/staging")
    assert not whole.language_model_only and LANGUAGE_MODEL_ONLY_FLAG not in whole.arguments(8000)
    assert whole.fingerprint() != spec.fingerprint()
    # what the server computes for text is the same: its output identity does not move
    assert whole.output_identity() == spec.output_identity()
    # server_env wins over a lever's variable
    spec.server_env = {STARTUP_PLAN_ENV: "0"}
    assert spec.environment(environ={}, cpu_build=False)[STARTUP_PLAN_ENV] == "0"


def test_the_facts_of_another_vllm_layout_are_read_and_what_it_lacks_is_unavailable(tmp_path, facts):
    """A vLLM whose flag comes from an EngineArgs field only, whose loaders' table is elsewhere, and which has no
    startup plan: the flag and the formats are found, the plan is named unavailable in that version."""
    package = tmp_path / "vllm"
    (package / "engine").mkdir(parents=True)
    (package / "engine" / "arg_utils.py").write_text(
        "class EngineArgs:\n    model: str = 'x'\n    language_model_only: bool = False\n"
    )
    (package / "envs.py").write_text('environment_variables = {\n    "VLLM_CACHE_ROOT": lambda: None,\n}\n')
    (package / "model_executor" / "model_loader").mkdir(parents=True)
    (package / "model_executor" / "model_loader" / "__init__.py").write_text(
        'LoadFormats = Literal[\n    "auto",\n    "safetensors",\n]\n'
    )
    (package / "entrypoints" / "cli").mkdir(parents=True)
    (package / "entrypoints" / "cli" / "serve.py").write_text("")
    old = levers.read_facts(package, "0.30.0")
    assert LANGUAGE_MODEL_ONLY_FLAG in old.flags and "--model" in old.flags
    assert old.load_formats == {"auto", "safetensors"} and old.subcommands == {"serve"}
    p = plan(old, KIMI, weight_cache=True)
    assert p.args == [LANGUAGE_MODEL_ONLY_FLAG] and p.env == {"VLLM_CACHE_ROOT": "/var/cache/eyrie/vllm"}
    assert lever(p, "startup-plan").reason.startswith("unavailable in vLLM 0.30.0")
    assert lever(p, "weight-cache").reason == "unavailable in vLLM 0.30.0: it has no --load-format ipc_cache"
    assert [lv.name for lv in p.refused] == ["weight-cache"]


def test_a_hub_targets_levers_read_its_config_from_the_hub_cache_without_asking_the_hub(tmp_path, monkeypatch):
    """The spec is built in the flow's process on every server start: a hub target's config.json comes from the
    hub cache (preflight downloaded it), and a target not in the cache has no lever that needs its config."""
    import json
    import uuid

    from huggingface_hub import constants

    from eyrie.config import TargetConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = f"eyrie-test/wrapper-{uuid.uuid4().hex[:8]}"
    root = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    try:
        snap = root / "snapshots" / ("c" * 40)
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(KIMI))
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text("c" * 40)
        assert levers._target_config(TargetConfig(model=repo)) == KIMI
        assert levers._target_config(TargetConfig(model=repo, revision="c" * 40)) == KIMI
        assert levers._target_config(TargetConfig(model=repo + "-absent")) == {}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_facts_of_another_interpreters_vllm_are_read_from_its_package_folder(monkeypatch, tmp_path):
    """With EYRIE_VLLM_PYTHON naming another environment, the facts come from that environment's vLLM folder (the
    site-packages its facts name), not from this interpreter's."""
    import vllm

    from eyrie.run import vllm_python

    site = Path(vllm.__file__).parent.parent
    monkeypatch.setattr(vllm_python, "one_environment", lambda: False)
    there = {"vllm": vllm.__version__, "cpu_build": True, "watch": ["/other/python", str(tmp_path), str(site)]}
    monkeypatch.setattr(vllm_python, "vllm_environment", lambda python=None: there)
    facts = installed_facts()
    assert facts is not None and STARTUP_PLAN_ENV in facts.env_vars and "ipc_cache" in facts.load_formats
    there = {**there, "watch": ["/other/python", str(tmp_path)]}
    assert installed_facts() is None  # no vLLM folder there: no facts, every lever unavailable
