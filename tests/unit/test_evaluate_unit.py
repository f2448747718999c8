"""Evaluation's arithmetic, in-process: vLLM's spec-decode counters to acceptance figures, and the train/serve gap
that says whether validation predicted what vLLM measured."""

from __future__ import annotations

from eyrie.stages.evaluate import acceptance, gap_warning, spec_counters, train_serve_gap

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
    from eyrie.stages.evaluate import draft_token_table, plot_draft_tokens, throughput_rows

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


def test_the_sweep_takes_its_acceptance_from_its_throughput_traffic():
    """The draft-token sweep's server measures acceptance over the throughput runs' own requests (the same greedy
    prompts, once per concurrency) and sends no separate pass; the target alone gives the baseline speed."""
    from contextlib import contextmanager

    from eyrie.stages.evaluate import draft_token_report
    from eyrie.vllm.spec import ServerSpec

    class Fake:
        def __init__(self, drafting: bool):
            self.drafting, self.chats, self.drafts, self.accepted = drafting, 0, 0, [0, 0, 0, 0, 0]

        def chat(self, prompt, max_tokens):
            self.chats += 1
            if self.drafting:  # each request: 2 drafts, positions 1-2 accepted in one, position 1 in the other
                self.drafts += 2
                self.accepted[0] += 2
                self.accepted[1] += 1
            return {"usage": {"completion_tokens": 10}}

        def metrics(self):
            lines = [f'vllm:spec_decode_num_drafts_total{{engine="0"}} {self.drafts}']
            lines += [
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} {n}'
                for i, n in enumerate(self.accepted)
            ]
            lines.append(f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {sum(self.accepted)}')
            return "\n".join(lines)

    clients = {}

    @contextmanager
    def serve(spec, folder):
        clients[folder] = Fake(spec.drafter is not None)
        yield clients[folder]

    spec = ServerSpec(model="t")
    trained = {
        "acceptance_length": 2.0,
        "per_position_acceptance": [0.9, 0.5, 0.2],
        "throughput": [{"concurrency": c, "output_tokens_per_s": 50.0} for c in (1, 4)],
        "num_speculative_tokens": 3,
    }
    prompts = [[{"role": "user", "content": str(i)}] for i in range(6)]
    report = draft_token_report(serve, spec, "drafter", prompts, 8, 5, trained)
    sweep = clients["server-sweep"]
    assert sweep.chats == 2 * (1 + len(prompts))  # one warm-up and the prompts, per concurrency: nothing more
    assert report["swept"]["drafts"] == 2 * sweep.chats
    assert report["swept"]["per_position_acceptance"] == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert [r["k"] for r in report["draft_tokens"]] == [1, 2, 3, 4, 5]
    assert clients["server-target"].chats == 2 * (1 + len(prompts))
    # Beside the table: the best k per measured concurrency, as the schedule the installed vLLM takes.
    assert [b["concurrency"] for b in report["schedule"]["best_k"]] == [1, 4]


def test_validation_is_counted_over_the_draft_starts_vllm_makes():
    """speculators divides `full_acc_i` by the positions whose (i+1)-th target is in the loss mask, so the i starts
    just before each answer (never right: the start is not in the mask) are counted and the i at its end are not.
    Per answer of L tokens the figure is capped at (L - i) / L; the like-for-like figure is counted over the starts
    that can be right, and the gap report shows both."""
    from eyrie.stages.train.validation import draft_start_counts, like_for_like

    # two rows (as stored: the trainer drops each row's first token): answers of 4 and 5 tokens, and one of 3
    rows = [[0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    totals, starts = draft_start_counts(rows, 3)
    assert totals == [12, 12, 12]  # every masked position is a target at every depth
    assert starts == [12, 9, 6]  # 3 answers: one start fewer per answer at each depth
    # a drafter right at every start it can be: speculators reports 9/12 and 6/12 at depths 2 and 3
    metrics = {"full_acc_0_epoch": 1.0, "full_acc_1_epoch": 9 / 12, "full_acc_2_epoch": 6 / 12}
    assert like_for_like(metrics, totals, starts) == [1.0, 1.0, 1.0]
    metrics.update({"full_acc_1_epoch_speculators": 0.75, "full_acc_1_epoch": 1.0})
    row = train_serve_gap(metrics, [1.0, 1.0, 1.0], 0.15, 100)["rows"][1]
    assert row["validation"] == 1.0 and row["validation_speculators"] == 0.75 and row["gap"] == 0.0
