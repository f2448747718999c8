"""The train benchmark's measuring tools (benchmarks/train_throughput.py): the bare step's borrowed tensors, kernel
tables and their comparison. A tiny speculators drafter on the CPU."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import train_bench.profiling
        import train_bench.step

        yield types.SimpleNamespace(**{**vars(train_bench.profiling), **vars(train_bench.step)})
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def tiny_drafter(attn: str = "sdpa"):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    tl = LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=256,
        max_position_embeddings=1024,
    )
    tl._attn_implementation = attn
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl,
        draft_vocab_size=64,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="synthetic", architectures=["LlamaForCausalLM"]),
        ),
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(cfg)
    t2d = torch.zeros(256, dtype=torch.bool)
    ids = torch.randperm(256)[:64].sort().values
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(64))
    return model


def test_the_bare_step_borrows_finite_tensors_not_speculators_nan(bench):
    """A drafter built bare holds NaN in the tensors it borrows from the target until load_verifier_weights:
    the bare step as first measured computed on NaN throughout (loss, gradients, weights)."""
    from speculators.losses import resolve_loss_config

    model = tiny_drafter()
    assert torch.isnan(model.embed_tokens.weight).all() and torch.isnan(model.verifier_lm_head.weight).all()
    T = 64
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, T, 96, generator=g),
        input_ids=torch.randint(0, 256, (1, T), generator=g),
        document_ids=torch.zeros(1, T, dtype=torch.long),
        loss_mask=torch.ones(1, T, dtype=torch.bool),
        position_ids=torch.arange(T).unsqueeze(0),
        verifier_last_hidden_states=torch.randn(1, T, 32, generator=g),
        ttt_steps=3,
        loss_config=resolve_loss_config("kl_div", "eager"),
    )
    for variant, finite in (("nan", False), ("finite", True)):
        bench.fill_borrowed(model, variant)
        _, loss, _ = model(**inputs)
        assert bool(torch.isfinite(loss)) is finite, variant
    std = float(model.embed_tokens.weight.std())
    assert 0.015 < std < 0.025  # what the synthetic target's files hold
    with pytest.raises(SystemExit, match="finite or nan"):
        bench.fill_borrowed(model, "zeros")


def trace(tmp_path: Path, kernels: list[tuple[str, str, float]]) -> Path:
    events = [
        {"ph": "X", "cat": cat, "name": name, "ts": i * 10.0, "dur": us} for i, (name, cat, us) in enumerate(kernels)
    ]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0})  # host ops: not counted
    path = tmp_path / f"trace{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_kernel_tables_compare_by_kind_family_and_name_at_one_clock(bench, tmp_path):
    a = bench.kernel_table(
        trace(
            tmp_path,
            [
                ("nvjet_sm90_tst_256x128_NNT", "kernel", 3000.0),
                ("nvjet_sm90_tst_256x128_NNT", "kernel", 3000.0),
                ("triton_tem_fused_flex_attention_3", "kernel", 1000.0),
            ],
        ),
        steps=2,
    )
    b = bench.kernel_table(
        trace(
            tmp_path,
            [
                ("nvjet_sm90_tst_256x128_NNT", "kernel", 3600.0),
                ("nvjet_sm90_tst_256x128_NNT", "kernel", 3600.0),
                ("triton_tem_fused_flex_attention_4", "kernel", 1400.0),
                ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 800.0),
            ],
        ),
        steps=2,
    )
    assert a["gpu_ms_per_step"] == pytest.approx(3.5) and b["gpu_ms_per_step"] == pytest.approx(4.7)
    assert a["rows"][0] == ["nvjet_sm90_tst_256x128_NNT", "matmul", 1.0, 3.0]
    record, text = bench.compare_tables(
        {"name": "bare", "clocks": {"sm_clock_MHz": 1800}, **a},
        {"name": "trainer", "clocks": {"sm_clock_MHz": 1500}, **b},
    )
    kinds = {r[0]: r for r in record["kind"]}
    assert kinds["matmul"][5] == pytest.approx(0.6)  # 3.6 ms against 3.0 a step
    assert kinds["matmul"][6] == pytest.approx(0.0)  # ... all of it the slower clock: 3.6 * 1500 / 1800 = 3.0
    assert kinds["gpu_memcpy HtoD"][4] == pytest.approx(0.4)
    families = {r[0]: r for r in record["family"]}
    assert families["triton_tem_fused_flex_attention"][3:6] == [0.5, 0.7, 0.2]  # _3 and _4: the same kernel
    names = {r[0] for r in record["name"]}
    assert {"triton_tem_fused_flex_attention_3", "triton_tem_fused_flex_attention_4"} <= names
    assert "trainer against bare" in text and "trainer at bare's clock: 3.92 ms" in text
