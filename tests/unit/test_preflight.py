"""preflight: seconds of checks before any weights load. The case this project exists for: a target whose vLLM
class lacks the EAGLE-3 interface is refused from its config.json alone, never after loading the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import config_dict, write_config

from eyrie.config import parse_config
from eyrie.errors import ConfigError, PreflightError
from eyrie.stages.preflight.check import run_preflight
from eyrie.stages.preflight.target import (
    captured_layer_ids,
    default_aux_layer_ids,
    probe_eagle3,
    resolve_vllm_class,
    validate_aux_layer_ids,
)
from eyrie.target.tiny.tokenizer import build_tokenizer
from flows.cli import main as eyrie_main

# Architectures whose vLLM 0.32 class has no `supports_eagle3` (checked in test_unsupported_architectures_exist).
# OPT's config uses the standard num_hidden_layers/hidden_size keys, so its class is the only problem. OPT and GPT-2
# generate text, so Eyrie's EAGLE-3 compatibility layer (eyrie/vllm/plugin/compat.py) may take them on; the tests of
# the bare refusal turn it off with EYRIE_EAGLE3_COMPAT=0. BertModel (an embedding model) is refused either way.
UNSUPPORTED = {
    "OPTForCausalLM": {
        "model_type": "opt",
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "ffn_dim": 128,
        "word_embed_proj_dim": 64,
        "max_position_embeddings": 1024,
        "do_layer_norm_before": True,
        "vocab_size": 512,
    },
    "GPT2LMHeadModel": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 8,
        "n_head": 2,
        "n_positions": 1024,
        "vocab_size": 512,
        "num_hidden_layers": 8,
        "hidden_size": 64,
    },
    "BertModel": {
        "model_type": "bert",
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        "vocab_size": 512,
    },
}
NO_COMPAT = "EYRIE_EAGLE3_COMPAT"


def unsupported_target(folder: Path, arch: str) -> Path:
    """A tokenizer, the architecture's config.json and a model.safetensors of garbage: loading it would fail."""
    folder.mkdir(parents=True)
    build_tokenizer(folder)
    (folder / "config.json").write_text(
        json.dumps({"architectures": [arch], "torch_dtype": "bfloat16", **UNSUPPORTED[arch]}, indent=2)
    )
    (folder / "model.safetensors").write_bytes(b"\x13\x37 not a safetensors file " * 64)
    return folder


@pytest.fixture(scope="module")
def opt_target(tmp_path_factory) -> Path:
    return unsupported_target(tmp_path_factory.mktemp("unsupported") / "tiny-opt", "OPTForCausalLM")


def test_validate_aux_layer_ids():
    assert validate_aux_layer_ids(None, 8) == ([2, 4, 5], [])
    assert default_aux_layer_ids(61) == [2, 30, 58]
    assert captured_layer_ids([2, 4, 5], 8) == [2, 4, 5, 8]
    ids, problems = validate_aux_layer_ids([2, 4, 8], 8)
    assert ids == [2, 4, 8] and len(problems) == 1
    assert "[8] outside 0..7" in problems[0] and "the target has 8 layers" in problems[0]
    _, problems = validate_aux_layer_ids([-1, 3], 8)
    assert "[-1] outside 0..7" in problems[0]
    _, problems = validate_aux_layer_ids([2, 2, 5], 8)
    assert len(problems) == 1 and "duplicates" in problems[0]
    _, problems = validate_aux_layer_ids(None, 4)  # defaults [2, 2, 1] collide on a 4-layer target
    assert any("duplicates" in p and "[2, 2, 1]" in p for p in problems)
    _, problems = validate_aux_layer_ids([5, 2, 4], 8)
    assert problems == ["extraction.layer_ids [5, 2, 4] is not ascending: list them low to high"]


@pytest.mark.parametrize("arch", sorted(UNSUPPORTED))
def test_unsupported_architectures_exist(arch, monkeypatch):
    """The premise of the key test: the installed vLLM resolves these classes and they lack SupportsEagle3."""
    monkeypatch.setenv(NO_COMPAT, "0")
    cls = resolve_vllm_class(arch)
    assert cls is not None
    assert not getattr(cls, "supports_eagle3", False)
    probe = probe_eagle3({"architectures": [arch]})
    assert probe.path == "unsupported"
    # An embedding model is refused for what it is, whatever its interface; the others for the missing interface.
    assert ("pooling" if arch == "BertModel" else "SupportsEagle3") in probe.reason


def test_unsupported_class_refused_without_loading_weights(opt_target, tmp_path, monkeypatch):
    monkeypatch.setenv(NO_COMPAT, "0")
    config = parse_config(config_dict(opt_target))
    with pytest.raises(PreflightError) as info:
        run_preflight(config, tmp_path / "run")
    err = info.value
    msg = str(err)
    assert "no weights were loaded" in msg
    assert len(err.failures) == 1, err.failures  # the class, and nothing else, is wrong with this target
    assert "vLLM's OPTForCausalLM does not implement SupportsEagle3" in err.failures[0]
    assert "Model does not support EAGLE3 interface" in err.failures[0]  # the failure it saves the user from
    assert "Fix:" in err.failures[0]
    assert "safetensors" not in msg.lower()  # the corrupt weights were never opened
    report = run_preflight(config, tmp_path / "run", raise_on_failure=False)
    assert report.eagle3_path == "unsupported"
    assert report.vllm_class == "vllm.model_executor.models.opt.OPTForCausalLM"


def test_gpt2_target_refused_too(tmp_path, monkeypatch):
    monkeypatch.setenv(NO_COMPAT, "0")
    target = unsupported_target(tmp_path / "tiny-gpt2", "GPT2LMHeadModel")
    with pytest.raises(PreflightError) as info:
        run_preflight(parse_config(config_dict(target)), tmp_path / "run")
    assert any("GPT2LMHeadModel does not implement SupportsEagle3" in f for f in info.value.failures)


@pytest.mark.parametrize(
    "kind, lm", [("tiny-llama", None), ("tiny-deepseek-v3", None), ("tiny-kimi-k25", "DeepseekV3ForCausalLM")]
)
def test_tiny_targets_pass(tiny_target, tmp_path, kind, lm):
    report = run_preflight(
        parse_config(config_dict(tiny_target(kind))), tmp_path / "run", tokens=10_000, serve=False
    )  # an MLA target cannot be served with a drafter on CPU (tested below)
    assert report.failures == []
    assert report.eagle3_path == "native"
    assert (report.num_layers, report.hidden_size) == (8, 64)
    assert report.aux_layer_ids == [2, 4, 5] and report.captured_layer_ids == [2, 4, 5, 8]
    assert report.estimated_bytes == 10_000 * (4 * 64 * 2 + 8)
    if lm:
        assert report.architecture == "KimiK25ForConditionalGeneration"
        assert report.language_model.endswith(lm)


def test_mla_target_refused_for_serving_on_the_cpu_build(tiny_deepseek, tmp_path):
    """Export and evaluation serve target + drafter; vLLM's CPU backend cannot decode an MLA target with a drafter,
    so a whole run is refused up front, and a run that stops at training passes."""
    config = parse_config(config_dict(tiny_deepseek))
    report = run_preflight(config, tmp_path / "run", raise_on_failure=False)
    assert len(report.failures) == 1 and "multi-head latent attention" in report.failures[0]
    assert "--until train" in report.failures[0]
    assert run_preflight(config, tmp_path / "run", raise_on_failure=False, serve=False).failures == []


def test_aux_ids_the_capture_proof_cannot_recompute_are_decided_before_the_load(tiny_llama, tmp_path, monkeypatch):
    """From the target's config alone (a meta-device build, no weights): aux ids whose prefix is past the capture
    proof's budget (a tiny one here, standing for an 8B target's L//2 and L-3) fail preflight by default, named with
    the reason and the fix; `extraction.unproven_aux_layers: warn` makes them a warning."""
    from eyrie.hidden_states import proof
    from eyrie.target.metadata import text_config

    counts = proof._prefix_params(text_config(json.loads((tiny_llama / "config.json").read_text())), 6)
    monkeypatch.setattr(proof, "RECOMPUTE_MAX_PARAMS", (counts[3] + counts[4]) // 2)  # streams 0..3: id 2 only
    report = run_preflight(parse_config(config_dict(tiny_llama)), tmp_path / "a", raise_on_failure=False, serve=False)
    assert report.aux_layer_ids == [2, 4, 5] and len(report.failures) == 1, report.failures
    refusal = report.failures[0]
    assert "cannot recompute aux layer ids [4, 5]" in refusal and "(it proves ids [2])" in refusal, refusal
    assert "the proof rebuilds at most" in refusal and "extraction.unproven_aux_layers: warn" in refusal, refusal
    warn = config_dict(tiny_llama, extraction={"unproven_aux_layers": "warn"})
    report = run_preflight(parse_config(warn), tmp_path / "b", raise_on_failure=False, serve=False)
    assert report.failures == [], report.failures
    assert [w for w in report.warnings if "cannot recompute aux layer ids [4, 5]" in w], report.warnings


def test_tokenizer_larger_than_the_vocabulary_refused(tmp_path, tiny_llama):
    folder = tmp_path / "small-vocab"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = 256  # the tokenizer has more tokens than the embedding has rows
    (folder / "config.json").write_text(json.dumps(cfg))
    report = run_preflight(parse_config(config_dict(folder)), tmp_path / "run", raise_on_failure=False)
    assert any("but the model's vocabulary has 256 rows" in f for f in report.failures), report.failures


def test_preflight_lists_every_problem(tiny_llama, tmp_path):
    config = parse_config(config_dict(tiny_llama, layer_ids=[2, 4, 9], vocab={"draft_vocab_size": 100_000}))
    with pytest.raises(PreflightError) as info:
        run_preflight(config, tmp_path / "run", tokens=10**15)  # petabytes of hidden states
    failures = info.value.failures
    assert len(failures) == 3, failures
    assert "[9] outside 0..7" in failures[0]
    assert "vocab.draft_vocab_size 100000 is larger than the target's vocabulary (512)" in failures[1]
    assert "hidden states need about" in failures[2] and "free" in failures[2]


def test_preflight_refuses_missing_template_and_missing_target(tiny_llama, tmp_path):
    folder = tmp_path / "no-template"
    folder.mkdir()
    build_tokenizer(folder, chat_template=None)
    shutil.copy(tiny_llama / "config.json", folder / "config.json")
    with pytest.raises(PreflightError, match="has no chat template"):
        run_preflight(parse_config(config_dict(folder)), tmp_path / "run")
    with pytest.raises(ConfigError, match="does not exist"):
        run_preflight(parse_config(config_dict(tmp_path / "nowhere")), tmp_path / "run")


# Classes no EAGLE-3 path can serve: refused for what they are, with the compatibility layer on, from config alone.
NOT_DECODER_LMS = {
    "BertModel": ("bert", "pooling"),
    "Qwen2ForRewardModel": ("qwen2", "pooling"),
    "WhisperForConditionalGeneration": ("whisper", "encoder-decoder"),
    "MambaForCausalLM": ("mamba", "attention-free"),
}


@pytest.mark.parametrize("arch", sorted(NOT_DECODER_LMS))
def test_models_that_are_not_decoder_lms_are_refused(arch, tmp_path, monkeypatch):
    monkeypatch.delenv(NO_COMPAT, raising=False)
    from transformers import AutoConfig

    model_type, why = NOT_DECODER_LMS[arch]
    # The real config class's defaults (Whisper's is_encoder_decoder among them), shrunk to a tiny width.
    fields = AutoConfig.for_model(
        model_type,
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=2,
        d_model=64,
        encoder_layers=2,
        decoder_layers=8,
    ).to_dict()
    folder = tmp_path / arch
    folder.mkdir()
    build_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({**fields, "architectures": [arch]}))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(PreflightError) as info:
        run_preflight(parse_config(config_dict(folder)), tmp_path / "run")
    failures = info.value.failures
    assert any(why in f and "decoder-only" in f and "Fix: point target.model" in f for f in failures), failures
    assert not any("compatibility layer gives it" in f for f in failures)
    assert "safetensors" not in str(info.value).lower()


def test_cli_preflight_exit_codes(opt_target, tiny_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(NO_COMPAT, "0")
    bad, _ = write_config(tmp_path / "opt.yaml", opt_target)
    assert eyrie_main(["preflight", "--config", str(bad), "--run-dir", str(tmp_path / "run-opt")]) == 1
    out = capsys.readouterr()
    # The verdict is the first line, then each problem; no JSON unless asked for.
    assert out.err.startswith("preflight FAILED (1)") and "OPTForCausalLM does not implement SupportsEagle3" in out.err
    assert "{" not in out.out + out.err.splitlines()[0]
    assert eyrie_main(["preflight", "--json", "--config", str(bad), "--run-dir", str(tmp_path / "run-opt")]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["eagle3_path"] == "unsupported" and out.err.startswith("preflight FAILED (1)")

    good, _ = write_config(tmp_path / "llama.yaml", tiny_llama)
    assert eyrie_main(["preflight", "--config", str(good), "--run-dir", str(tmp_path / "run-llama")]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(
        "preflight passed: LlamaForCausalLM via the native EAGLE-3 path, capturing layers [2, 4, 5, 8]"
    )

    # A bad config is a usage error (2), reported before anything runs.
    broken = tmp_path / "broken.yaml"
    broken.write_text(good.read_text().replace("shard_size", "shard_sise"))
    assert eyrie_main(["preflight", "--config", str(broken)]) == 2
    assert "unknown key `data.shard_sise`" in capsys.readouterr().err


def test_a_recorded_warm_start_base_since_deleted_is_refused_before_anything_loads(tiny_llama, tmp_path):
    """An earlier run of this data chose a base (train/warm_start.json) that was deleted since: refused at
    preflight with what to do, not at the train stage after extraction. A record for other data refuses nothing."""
    from eyrie.run.files import atomic_write_json, sha256_json
    from eyrie.run.folder import RunFolder
    from eyrie.stages.preflight.warm_start import check_recorded_base

    promo = tmp_path / "drafters"
    config = parse_config(config_dict(tiny_llama, promotion={"dir": str(promo), "warm_start": True}))
    run = RunFolder(tmp_path / "run")
    run.ensure()
    run.prepare.mkdir()
    atomic_write_json(run.prepare / "shards.json", [{"index": i, "start": 0, "stop": 8} for i in range(2)])
    run.shard_manifests.mkdir(parents=True)
    for i in range(2):
        atomic_write_json(run.shard_manifests / f"shard-{i:05d}.json", {"key": f"extract-key-{i}"})
    base = promo / "v1-deleted"
    data_id = sha256_json(["prepare-key", ["extract-key-0", "extract-key-1"]])
    atomic_write_json(run.train / "warm_start.json", {"data": data_id, "base": str(base)})

    report = run_preflight(config, run.root, raise_on_failure=False, serve=False, prepare_key="prepare-key")
    [failure] = [f for f in report.failures if "warm-start base" in f]
    assert str(base) in failure and "no longer exists" in failure
    assert "delete" in failure and "warm_start.json" in failure and "promotion.warm_start: false" in failure
    with pytest.raises(PreflightError, match="no longer exists"):
        run_preflight(config, run.root, serve=False, prepare_key="prepare-key")

    assert (
        check_recorded_base(config.promotion, config.train, config.regenerate, run.root, "other-data") == []
    )  # the run records its own base
    assert (
        check_recorded_base(config.promotion, config.train, config.regenerate, run.root, None) == []
    )  # before prepare: the data is not known yet
    (base).mkdir(parents=True)
    (base / "config.json").write_text("{}")
    assert (
        check_recorded_base(config.promotion, config.train, config.regenerate, run.root, "prepare-key") == []
    )  # restored
