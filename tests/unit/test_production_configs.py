"""Preflight on the real production targets, from their published metadata alone (tests/fixtures/production: each
model's config.json and a trimmed copy of its safetensors weight index, no weights): the vLLM class and EAGLE-3 path,
the layer ids, the tensors the drafter borrows (found in the real index), the drafter's layer shape, the disk
estimate and the tensor-parallel split, as the Kimi node's preflight would see them."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from conftest import REPO, config_dict

from eyrie.config import parse_config
from eyrie.stages.preflight import run_preflight
from eyrie.target.drafter import draft_layer_config
from eyrie.target.tiny.tokenizer import build_tokenizer

FIXTURES = REPO / "tests" / "fixtures" / "production"
PREFIX = {"kimi-k2.5": "language_model."}  # the wrapper keeps its text model under `language_model`
# model -> (architecture, layers, hidden size, vLLM class module)
EXPECTED = {
    "kimi-k2.5": ("KimiK25ForConditionalGeneration", 61, 7168, "kimi_k25"),
    "deepseek-v3": ("DeepseekV3ForCausalLM", 61, 7168, "deepseek_v2"),
    "qwen3-235b-a22b": ("Qwen3MoeForCausalLM", 94, 4096, "qwen3_moe"),
    "llama-3.1-405b-instruct": ("LlamaForCausalLM", 126, 16384, "llama"),
    "gpt-oss-120b": ("GptOssForCausalLM", 36, 2880, "gpt_oss"),
}
TOKENS = 10_000  # prepared tokens: the disk estimate preflight makes before extraction


def production_target(tmp_path: Path, name: str) -> Path:
    """The fixture's metadata plus a tokenizer with a chat template (the real ones are not stored here)."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    build_tokenizer(folder)
    return folder


# Every preflight here passes serve=False: these targets are served on GPU nodes, and the CPU build's one serving
# limit (an MLA target with a drafter) is not theirs.
def production_config(folder: Path, tp: int = 8):
    # trust_remote_code stays off: the fixtures do not carry the models' own Python files (the Kimi node's copy does,
    # and its preset turns it on); preflight reads these model types with transformers' own classes, as vLLM does.
    data = config_dict(folder, max_length=2048, vocab={"draft_vocab_size": 32000})
    data["target"]["tensor_parallel_size"] = tp
    # As the Kimi preset: the capture proof cannot rebuild these targets' aux layers (a quantized checkpoint, or a
    # prefix past its budget), which preflight refuses by default (tests/unit/test_preflight.py).
    data["extraction"]["unproven_aux_layers"] = "warn"
    return parse_config(data)


def remote_code_failures(folder: Path) -> list[str]:
    """The one failure a target that ships code gets with trust_remote_code off (the fix is in the message)."""
    import json

    if "auto_map" not in json.loads((folder / "config.json").read_text()):
        return []
    return [f"{folder} ships its own code (config.json `auto_map`): set target.trust_remote_code: true if you trust it"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_production_target_passes_preflight(name, tmp_path, record_property):
    arch, layers, hidden, module = EXPECTED[name]
    folder = production_target(tmp_path, name)
    config = production_config(folder)
    t0 = time.monotonic()
    report = run_preflight(config, tmp_path / "run", tokens=TOKENS, raise_on_failure=False, serve=False)
    record_property("preflight_s", round(time.monotonic() - t0, 1))
    assert report.failures == remote_code_failures(folder)
    assert report.architecture == arch and report.eagle3_path == "native"
    assert report.vllm_class.startswith(f"vllm.model_executor.models.{module}.")
    assert (report.num_layers, report.hidden_size) == (layers, hidden)
    assert report.aux_layer_ids == [2, layers // 2, layers - 3]
    assert report.captured_layer_ids[-1] == layers
    unproven = f"the capture proof cannot recompute aux layer ids {report.aux_layer_ids}"
    assert [w for w in report.warnings if w.startswith(unproven)], report.warnings
    prefix = PREFIX.get(name, "")
    assert report.target_facts["verifier_weights"] == {
        "embed_tokens.weight": f"{prefix}model.embed_tokens.weight",
        "model.norm.weight": f"{prefix}model.norm.weight",
        "lm_head.weight": f"{prefix}lm_head.weight",
    }
    # 4 captured layers x hidden x bf16 per token, plus 8 bytes of token id
    assert report.estimated_bytes == TOKENS * (4 * hidden * 2 + 8)
    draft = draft_layer_config(config.target, 1)
    assert draft.hidden_size == hidden and draft.hidden_act == "silu" and not draft.tie_word_embeddings


KIMI_PRESET = REPO / "configs" / "kimi-k2.5-tp8.yaml"


def kimi_preset(tmp_path: Path) -> tuple[dict, Path]:
    """The Kimi preset as a dict, pointed at Kimi-K2.5's metadata in `tmp_path`, and that folder."""
    import yaml

    preset = yaml.safe_load(KIMI_PRESET.read_text())
    folder = production_target(tmp_path, "kimi-k2.5")
    preset["target"].update(model=str(folder), revision=None, trust_remote_code=False)
    preset["promotion"]["dir"] = str(tmp_path / "drafters")
    preset["extraction"]["min_free_disk_gib"] = 0
    return preset, folder


def test_kimi_preset_on_kimi_metadata(tmp_path):
    """configs/kimi-k2.5-tp8.yaml against Kimi-K2.5's metadata: ids [2, 30, 58] plus 61, 57,352 bytes per token of
    hidden states, TP 8 over 64 heads, its server arguments and variables accepted by the installed vLLM, and nothing
    else to fix but the remote-code flag the fixture cannot honour."""
    preset, folder = kimi_preset(tmp_path)
    report = run_preflight(parse_config(preset), tmp_path / "run", tokens=1, raise_on_failure=False, serve=False)
    assert report.failures == remote_code_failures(folder)
    assert len(report.warnings) == 1, report.warnings  # its INT4 experts: the aux layers unproven (the preset says)
    assert report.warnings[0].startswith("the capture proof cannot recompute aux layer ids [2, 30, 58]")
    assert "quantized" in report.warnings[0]
    assert report.captured_layer_ids == [2, 30, 58, 61] and report.max_model_len == 8192
    assert report.estimated_bytes == 4 * 7168 * 2 + 8 == 57352


def test_kimi_preset_runs_what_is_known_to_work(monkeypatch):
    """What published Kimi-K2.5 EAGLE-3 recipes on vLLM run extraction with, as the installed vLLM's own server
    parser and variable registry read the preset: prefix caching and chunked prefill off, few sequences (and as
    many requests in flight), an execute-model timeout above vLLM's default; and the version it states is met."""
    import vllm
    from vllm import envs

    from eyrie.config import load_config
    from eyrie.stages.preflight import check_vllm_version, parse_server_arguments, serve_parser
    from eyrie.vllm.spec import ServerSpec

    config = load_config(KIMI_PRESET)
    assert serve_parser() is not None, "the installed vLLM's `vllm serve` parser was not found"
    spec = ServerSpec.from_config(config, layer_ids=[2, 30, 58, 61], storage_path="/staging")
    args = parse_server_arguments(spec.arguments(8000))
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is False
    assert 1 <= args.max_num_seqs <= 16 and config.extraction.concurrency == args.max_num_seqs
    assert args.tensor_parallel_size == 8 and args.max_model_len == 8192  # Eyrie's own flags parse too
    assert args.safetensors_load_strategy == "prefetch"  # the weights read ahead, in parallel (vllm #36012)
    name = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
    monkeypatch.delenv(name, raising=False)
    default = envs.environment_variables[name]()
    monkeypatch.setenv(name, config.extraction.server_env[name])
    assert envs.environment_variables[name]() >= 4 * default  # 1800 s against vLLM's 300
    assert check_vllm_version(config.target.vllm_version, vllm.__version__) == []


DENSE_PRESET = REPO / "configs" / "dense-8b-70b.yaml"


@pytest.mark.parametrize("tp", [1, 8])
def test_dense_preset_on_llama_metadata(tp, tmp_path):
    """configs/dense-8b-70b.yaml against a Llama-3.1 target's metadata (the fixture's 126 layers, no weights), at one
    GPU as written and at TP 8 as its comment offers: nothing to fix, its layer ids the target's own 2, L//2, L-3
    (none in the preset), and the one warning its `unproven_aux_layers: warn` accepts."""
    import yaml

    preset = yaml.safe_load(DENSE_PRESET.read_text())
    assert "layer_ids" not in preset["extraction"]  # the ids follow the target's depth
    folder = production_target(tmp_path, "llama-3.1-405b-instruct")
    preset["target"].update(model=str(folder), revision=None, tensor_parallel_size=tp)
    preset["extraction"]["min_free_disk_gib"] = 0
    report = run_preflight(parse_config(preset), tmp_path / "run", tokens=1, raise_on_failure=False, serve=False)
    assert report.failures == []
    assert report.captured_layer_ids == [2, 63, 123, 126] and report.max_model_len == 8192
    assert len(report.warnings) == 1, report.warnings
    assert report.warnings[0].startswith("the capture proof cannot recompute aux layer ids [2, 63, 123]")
    assert report.estimated_bytes == 4 * 16384 * 2 + 8


def _bump(version: str) -> str:
    """A requirement `version` does not meet: the next minor release or later."""
    from packaging.version import Version

    v = Version(version)
    return f">={v.major}.{v.minor + 1}"


# How a preset breaks against the installed vLLM -> what the one failure must name (besides vLLM's version).
BROKEN_PRESETS = {
    "unknown flag": (
        lambda p: p["extraction"]["server_args"].append("--enable-prefix-cachng"),
        ["unrecognized arguments: --enable-prefix-cachng", "--enable-prefix-cachng in extraction.server_args"],
    ),
    "value the flag refuses": (
        lambda p: p["extraction"]["server_args"].append("--max-num-seqs=eight"),
        ["argument --max-num-seqs: invalid int value: 'eight'", "--max-num-seqs in extraction.server_args"],
    ),
    "flag Eyrie sets from the config": (
        lambda p: p["extraction"]["server_args"].append("--max-model-len=16384"),
        ["sets --max-model-len, which Eyrie passes to vLLM from target.max_model_len"],
    ),
    "unknown variable": (
        lambda p: p["extraction"]["server_env"].update(VLLM_EXECUTE_MODEL_TIMEOUT_SECOND="1800"),
        ["sets VLLM_EXECUTE_MODEL_TIMEOUT_SECOND, which vLLM", "Did you mean VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS?"],
    ),
    "value the variable refuses": (
        lambda p: p["extraction"]["server_env"].update(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="30 minutes"),
        ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS='30 minutes'", "cannot read this value"],
    ),
    "unmet version": (
        lambda p: p["target"].update(vllm_version=_bump(__import__("vllm").__version__)),
        ["target.vllm_version asks for vLLM >="],
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_PRESETS))
def test_preflight_names_what_the_installed_vllm_lacks(case, tmp_path):
    """A preset that asks the installed vLLM for a flag, a value, a variable or a version it does not have fails
    preflight, before any weights load, with one failure naming the setting and the installed vLLM's version; so
    does a server argument that would override one Eyrie sets from the config."""
    import vllm

    preset, folder = kimi_preset(tmp_path)
    breaks, named = BROKEN_PRESETS[case]
    breaks(preset)
    report = run_preflight(parse_config(preset), tmp_path / "run", raise_on_failure=False, serve=False)
    failures = [f for f in report.failures if f not in remote_code_failures(folder)]
    assert len(failures) == 1, failures
    version = [] if "Eyrie sets" in case else [f"vLLM {vllm.__version__}"]  # a conflict, whatever the version
    for text in [*version, *named]:
        assert text in failures[0], failures[0]


def test_tensor_parallel_split_checked(tmp_path):
    folder = production_target(tmp_path, "llama-3.1-405b-instruct")  # 128 heads, 8 KV heads
    report = run_preflight(production_config(folder, tp=6), tmp_path / "run", raise_on_failure=False, serve=False)
    assert (
        len(report.failures) == 1
        and "tensor_parallel_size 6 does not divide the target's 128 attention heads" in report.failures[0]
    )
    folder = production_target(tmp_path / "q", "qwen3-235b-a22b")  # 64 heads, 4 KV heads: replicated over TP 8
    assert (
        run_preflight(production_config(folder, tp=8), tmp_path / "run", raise_on_failure=False, serve=False).failures
        == []
    )


def test_missing_head_in_the_weight_index_is_refused(tmp_path):
    """A checkpoint whose index lacks a tensor the drafter borrows is refused before anything loads."""
    import json

    folder = production_target(tmp_path, "deepseek-v3")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["lm_head.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    report = run_preflight(production_config(folder), tmp_path / "run", raise_on_failure=False, serve=False)
    failures = [f for f in report.failures if f not in remote_code_failures(folder)]
    assert len(failures) == 1 and "no tensor for the output head `lm_head.weight`" in failures[0], failures
