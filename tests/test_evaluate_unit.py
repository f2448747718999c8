"""Evaluation's arithmetic, in-process: vLLM's spec-decode counters to acceptance figures, and the train/serve gap
that says whether validation predicted what vLLM measured."""

from __future__ import annotations

from eyrie.evaluate import acceptance, gap_warning, spec_counters, train_serve_gap

METRICS = """
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="2"} 2.0
"""


def test_acceptance_counts_only_the_traffic_between_two_reads():
    before = {"drafts": 4.0, "draft_tokens": 12.0, "accepted": 5.0, "per_pos": {0: 3.0, 1: 2.0}}
    result = acceptance(before, spec_counters(METRICS))
    assert result["drafts"] == 6 and result["accepted_tokens"] == 10
    assert result["acceptance_length"] == round(1 + 10 / 6, 4)
    assert result["per_position_acceptance"] == [round(5 / 6, 4), 0.5, round(2 / 6, 4)]


def test_the_gap_is_flagged_per_position_beyond_the_bound():
    val = {"full_acc_0_epoch": 0.9, "full_acc_1_epoch": 0.7, "full_acc_2_epoch": 0.6, "loss_epoch": 1.0}
    gap = train_serve_gap(val, [0.85, 0.45, 0.5], bound=0.15)
    assert [r["gap"] for r in gap["rows"]] == [0.05, 0.25, 0.1]
    assert gap["flagged"] == [2]
    assert gap_warning(gap).startswith("training does not predict serving")
    assert "position(s) [2]" in gap_warning(gap) and "validation 0.7 vs served 0.45" in gap_warning(gap)
    # Served far better than validation is a mismatch too; within the bound, no warning.
    better = train_serve_gap(val, [0.9, 0.9, 0.6], 0.15)
    assert better["flagged"] == [2] and gap_warning(better).startswith("serving beats validation")
    assert gap_warning(train_serve_gap(val, [0.88, 0.65, 0.55], 0.15)) is None
    # The same gaps measured on 25 drafts are within the noise of the served estimate: not flagged.
    noisy = train_serve_gap(val, [0.85, 0.45, 0.5], 0.15, drafts=25)
    assert noisy["flagged"] == [] and noisy["rows"][1]["margin"] == round(2 * (0.45 * 0.55 / 25) ** 0.5, 4)
    assert train_serve_gap(val, [0.85, 0.45, 0.5], 0.15, drafts=5000)["flagged"] == [2]
    # A gross mismatch (served near zero) is flagged whatever the number of drafts.
    assert train_serve_gap(val, [0.05, 0.0, 0.0], 0.15, drafts=25)["flagged"] == [1, 2, 3]
    # More served positions than trained ones (k > ttt_steps): only the positions both have are compared.
    assert len(train_serve_gap(val, [0.9, 0.7, 0.6, 0.3, 0.1], 0.15)["rows"]) == 3


def test_draft_token_table_and_throughput_rows(tmp_path):
    from eyrie.evaluate import draft_token_table, plot_draft_tokens, throughput_rows

    swept = {"per_position_acceptance": [0.8, 0.6, 0.4, 0.2, 0.1]}
    served = {"per_position_acceptance": [0.82, 0.61, 0.38], "acceptance_length": 2.81}
    table = draft_token_table(swept, served)
    assert [r["acceptance_length"] for r in table] == [1.8, 2.4, 2.8, 3.0, 3.1]
    assert [("measured_acceptance_length" in r) for r in table] == [False, False, True, False, False]
    alone = [{"concurrency": 1, "output_tokens_per_s": 100.0}, {"concurrency": 8, "output_tokens_per_s": 400.0}]
    k3 = [{"concurrency": 1, "output_tokens_per_s": 180.0}, {"concurrency": 8, "output_tokens_per_s": 500.0}]
    k5 = [{"concurrency": 1, "output_tokens_per_s": 150.0}, {"concurrency": 8, "output_tokens_per_s": 380.0}]
    rows = throughput_rows(alone, {5: k5, 3: k3})
    assert rows[0] == {
        "concurrency": 1,
        "target_alone": 100.0,
        "drafter_k3": 180.0,
        "speedup_k3": 1.8,
        "drafter_k5": 150.0,
        "speedup_k5": 1.5,
    }
    assert rows[1]["speedup_k5"] == 0.95  # a slowdown is reported as one
    png = plot_draft_tokens(table, rows, tmp_path / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
