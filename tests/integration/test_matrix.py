"""The compatibility matrix: every tiny architecture the project builds, through preflight, then (slow) prepare, a
training step and export on the real trainer.

Preflight's verdict is a row per architecture: accepted ones name their EAGLE-3 path and the checkpoint tensors the
drafter borrows; refused ones give their reason. For each accepted architecture, speculators' trainer then builds a
drafter from exactly the tensors preflight resolved and trains a step (the trained drafter's borrowed tensors checked
bit for bit against the target's checkpoint: frozen), and the export checks it. Hidden states are synthetic here
(conftest.synthetic_training_inputs): that they match transformers is test_extraction_correctness.py's subject.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, build_tiny_target, config_dict, synthetic_training_inputs
from safetensors.torch import load_file

from eyrie.config import parse_config
from eyrie.stages.export import export_drafter
from eyrie.stages.preflight import run_preflight
from eyrie.stages.train.trainer import run_training, untrained_drafter

MATRIX_PAGE = REPO / "docs" / "design" / "compatibility.md"  # the compatibility matrix, as users read it

# kind -> the EAGLE-3 path preflight must report (every tiny target the project builds).
ACCEPTED = {
    "tiny-llama": "native",
    "tiny-deepseek-v3": "native",
    "tiny-kimi-k25": "native",
    "tiny-qwen2": "native",
    "tiny-qwen3": "native",
    "tiny-qwen3-moe": "native",
    "tiny-mistral": "native",
    "tiny-phi3": "native",
    "tiny-gpt-neox": "native",  # through vLLM's Transformers backend; its head is stored as `embed_out`
    "tiny-gemma2": "compat",  # tied embeddings: the head is the embedding
    "tiny-falcon": "compat",
    "tiny-stablelm": "compat",
    "tiny-gpt2": "compat",
    "tiny-opt": "compat",
}
# Every accepted target trains a step here, except those trained, exported and served end to end elsewhere
# (test_pipeline.py, test_compat.py).
TRAIN_STEP = sorted(set(ACCEPTED) - {"tiny-llama", "tiny-gpt2", "tiny-opt"})
ROWS: dict[str, str] = {}


def _config(target: Path, **kw):
    return parse_config(config_dict(target, max_samples=6, shard_size=6, max_length=128, layer_ids=[2, 4, 5], **kw))


@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_preflight_verdict(kind, tmp_path):
    target = build_tiny_target(kind)
    # serve=False: MLA targets cannot be served with a drafter on the CPU build (test_preflight.py checks that
    # refusal); the matrix is about extraction and training.
    report = run_preflight(_config(target), tmp_path / "run", raise_on_failure=False, serve=False)
    weights = report.target_facts["verifier_weights"]
    ROWS[kind] = (
        f"| {kind} | `{report.architecture}` | {report.eagle3_path} | `{weights.get('embed_tokens.weight')}`"
        f" | `{weights.get('model.norm.weight')}` | `{weights.get('lm_head.weight', '(tied)')}` |"
    )
    assert report.failures == [], report.failures
    assert report.eagle3_path == ACCEPTED[kind]
    names = (
        set(json.loads((target / "model.safetensors.index.json").read_text())["weight_map"])
        if (target / "model.safetensors.index.json").exists()
        else set(load_file(str(target / "model.safetensors")))
    )
    assert {"embed_tokens.weight", "model.norm.weight"} <= set(weights)
    assert set(weights.values()) <= names, f"resolved names not in the checkpoint: {weights}"


def test_matrix_table_in_the_docs():
    """The docs keep the table these rows make (refused architectures are test_preflight.py's and
    test_refusals.py's rows)."""
    table = "\n".join(ROWS[k] for k in sorted(ROWS))
    print("\n" + table)
    assert len(ROWS) == len(ACCEPTED)
    assert table in MATRIX_PAGE.read_text(), "docs/design/compatibility.md differs from preflight's verdicts:\n" + table


UNTRAINED = "tiny-kimi-k25"  # also built untrained (a trainer launch more): the seed's target, its names prefixed


def _assert_borrowed(drafter: Path, target: Path, report, inputs) -> None:
    """The drafter's embedding and head rows (those of its draft vocabulary) are the target's own tensors."""
    weights = load_file(str(drafter / "model.safetensors"))
    names = report.target_facts["verifier_weights"]
    source = load_file(str(target / "model.safetensors"))
    keep = torch.from_numpy(np.load(inputs.t2d)).bool()
    assert torch.equal(weights["embed_tokens.weight"].float(), source[names["embed_tokens.weight"]].float())
    head = source[names.get("lm_head.weight", names["embed_tokens.weight"])]
    assert torch.equal(weights["lm_head.weight"].float(), head[keep].float())


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", TRAIN_STEP)
def test_drafter_borrows_the_resolved_tensors_and_trains(kind, tmp_path):
    target = build_tiny_target(kind)
    config = _config(target, train={"epochs": 1, "max_seq_len": 256}, vocab={"draft_vocab_size": 128})
    report, inputs, seq_lens = synthetic_training_inputs(config, tmp_path)
    if kind == UNTRAINED:  # speculators' --dry-run, the untrained baseline's drafter (`untrained_baseline: always`)
        _assert_borrowed(untrained_drafter(config, tmp_path / "train", "u", inputs), target, report, inputs)

    trained = run_training(config, tmp_path / "train", "k", inputs, seq_lens, log=print)
    assert trained["global_step"] and trained["global_step"] > 0
    # The borrowed tensors are frozen: the trained drafter still holds the target's own, bit for bit.
    _assert_borrowed(Path(trained["checkpoint"]), target, report, inputs)
    exported = export_drafter(
        Path(trained["checkpoint"]), tmp_path / "export", str(target), report.aux_layer_ids, report.hidden_size, "e"
    )
    cfg = json.loads((Path(exported["drafter"]) / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == report.aux_layer_ids
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target.resolve())
