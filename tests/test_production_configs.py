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
from eyrie.preflight import run_preflight
from eyrie.tiny.tokenizer import build_tokenizer
from eyrie.train import draft_layer_config

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


def test_kimi_preset_on_kimi_metadata(tmp_path):
    """configs/kimi-k2.5-tp8.yaml against Kimi-K2.5's metadata: ids [2, 30, 58] plus 61, 57,352 bytes per token of
    hidden states, TP 8 over 64 heads, and nothing else to fix but the remote-code flag the fixture cannot honour."""
    import yaml

    preset = yaml.safe_load((REPO / "configs" / "kimi-k2.5-tp8.yaml").read_text())
    folder = production_target(tmp_path, "kimi-k2.5")
    preset["target"].update(model=str(folder), revision=None, trust_remote_code=False)
    preset["promotion"]["dir"] = str(tmp_path / "drafters")
    preset["extraction"]["min_free_disk_gib"] = 0
    report = run_preflight(parse_config(preset), tmp_path / "run", tokens=1, raise_on_failure=False, serve=False)
    assert report.failures == remote_code_failures(folder)
    assert report.captured_layer_ids == [2, 30, 58, 61] and report.max_model_len == 8192
    assert report.estimated_bytes == 4 * 7168 * 2 + 8 == 57352


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
