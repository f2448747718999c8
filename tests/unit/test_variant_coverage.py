"""The training data's chat-template variants against evaluation's (issue 25 item 4): the shares counted from what
regeneration and prepare leave on disk (a template mix's per-row record, a regeneration without one, the prepared
data), evaluation's prompts and acceptance per variant, the warnings, and the run summary's table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyrie.stages.evaluate import (
    coverage_markdown,
    evaluated_variants,
    set_variant,
    training_variants,
    variant_coverage,
    variant_set_name,
)


def _dataset(folder: Path, seq_lens: list[int], stage: str, variants: list[str] | None = None, **manifest) -> Path:
    from datasets import Dataset

    Dataset.from_dict({"seq_len": seq_lens}).save_to_disk(str(folder / "dataset"))
    (folder / "manifest.json").write_text(json.dumps({"stage": stage, "num_samples": len(seq_lens), **manifest}))
    if variants is not None:
        (folder / "template_variants.json").write_text(json.dumps(variants))
    return folder


def _measured(prompts: int, per_request: list[tuple[int, int]]) -> dict:
    """A measurement as `measure` returns it: `per_request` (drafts, accepted) for each prompt."""
    requests = [{"drafts": d, "accepted": a, "per_pos": [a]} for d, a in per_request]
    return {"prompts": prompts, "requests": requests}


def test_set_names_map_back_to_their_variant_whatever_the_names():
    assert set_variant(variant_set_name("held-out", "thinking")) == "thinking"
    assert set_variant(variant_set_name("mt-bench.v2", "no-think_2")) == "no-think_2"
    assert set_variant("held-out") == set_variant("mt-bench") == "default"


def test_a_template_mix_counts_conversations_and_tokens_over_the_rows_trained_on(tmp_path):
    # 10 rows; val_fraction 0.2: speculators trains on the first 8 and validates on the last 2 (not counted).
    variants = ["default", "think", "think", "default", "think", "default", "default", "think", "think", "think"]
    seq_lens = [10, 30, 30, 10, 30, 10, 10, 30, 99, 99]
    data = _dataset(tmp_path, seq_lens, "regenerate", variants)
    t = training_variants(data, val_fraction=0.2)
    assert t["source"] == "regenerate" and t["note"] is None
    assert t["conversations"] == {"default": 4, "think": 4}
    assert t["tokens"] == {"default": 40, "think": 120}


def test_regeneration_off_says_the_prepared_data_are_all_the_default_rendering(tmp_path):
    t = training_variants(_dataset(tmp_path, [5, 7, 9, 11], "prepare"), val_fraction=0.25)
    assert t["conversations"] == {"default": 3} and t["tokens"] == {"default": 21}
    assert "regeneration is off" in t["note"] and "default" in t["note"]


def test_a_regeneration_without_a_mix_is_all_default(tmp_path):
    t = training_variants(_dataset(tmp_path, [5, 7], "regenerate"), 0.0)
    assert t["conversations"] == {"default": 2} and "without regenerate.template_mix" in t["note"]


def test_a_per_row_record_that_does_not_match_the_dataset_falls_back_to_the_stages_counts(tmp_path):
    data = _dataset(tmp_path, [5, 7, 9], "regenerate", ["a", "b"], stats={"template_variants": {"a": 2, "b": 1}})
    t = training_variants(data, 0.0)
    assert t["conversations"] == {"a": 2, "b": 1} and t["tokens"] is None
    assert "does not match the dataset's rows" in t["note"]


def _trained_result() -> dict:
    held = _measured(4, [(10, 20)] * 4)  # default rendering: acceptance 3.0
    return {
        **held,
        "sets": {
            "mt-bench": _measured(2, [(10, 20)] * 2),
            variant_set_name("held-out", "think"): _measured(4, [(10, 5)] * 4),  # 1.5
            variant_set_name("mt-bench", "think"): _measured(2, [(10, 5)] * 2),
        },
    }


def test_evaluation_pools_every_set_rendered_with_a_variant():
    ev = evaluated_variants(_trained_result())
    assert ev["default"]["prompts"] == 6 and ev["think"]["prompts"] == 6
    assert ev["default"]["statistics"]["pooled"]["acceptance_length"]["value"] == 3.0
    assert ev["think"]["statistics"]["pooled"]["acceptance_length"]["value"] == 1.5
    assert ev["think"]["sets"] == ["held-out, think", "mt-bench, think"]


def test_a_served_variant_absent_from_the_training_data_is_a_warning_naming_the_fix():
    training = {"source": "prepare", "note": "regeneration is off: ...", "conversations": {"default": 100}}
    cov = variant_coverage(training, evaluated_variants(_trained_result()))
    rows = {r["variant"]: r for r in cov["rows"]}
    assert rows["default"]["training_share"] == 1.0 and rows["think"]["training_share"] == 0.0
    assert rows["think"]["evaluation_share"] == 0.5 and rows["think"]["acceptance_length"]["value"] == 1.5
    assert rows["default"]["training_token_share"] is None  # no token counts given
    [warning] = cov["warnings"]
    assert "'think'" in warning and "none of the 100" in warning and "regenerate.template_mix" in warning
    assert "regeneration is off" in warning


@pytest.mark.parametrize(("think", "warned"), [(3, True), (5, False)])
def test_a_tiny_share_is_flagged_under_the_threshold(think, warned):
    training = {"source": "regenerate", "conversations": {"default": 100 - think, "think": think}}
    cov = variant_coverage(training, evaluated_variants(_trained_result()), tiny=0.05)
    assert bool(cov["warnings"]) is warned
    if warned:
        assert f"only {think} of the 100" in cov["warnings"][0] and "raise its weight" in cov["warnings"][0]


def test_a_trained_variant_evaluation_does_not_measure_is_a_warning():
    training = {"source": "regenerate", "conversations": {"default": 50, "think": 30, "terse": 20}}
    cov = variant_coverage(training, evaluated_variants(_trained_result()))
    assert [r["variant"] for r in cov["rows"]] == ["default", "think", "terse"]
    [warning] = cov["warnings"]
    assert "'terse'" in warning and "evaluate.template_variants" in warning
    terse = cov["rows"][2]
    assert terse["evaluation_prompts"] == 0 and terse["acceptance_length"] is None


def test_the_run_summary_table_shows_shares_and_acceptance_and_is_silent_for_the_default_alone(tmp_path):
    training = {
        "source": "regenerate",
        "conversations": {"default": 60, "think": 40},
        "tokens": {"default": 600, "think": 1400},
    }
    md = "\n".join(coverage_markdown(variant_coverage(training, evaluated_variants(_trained_result()))))
    assert "| think | 40 (40.0%) | 70.0% | 6 (50.0%) | 1.5" in md
    assert "| default | 60 (60.0%) | 30.0% | 6 (50.0%) | 3.0" in md
    alone = variant_coverage({"conversations": {"default": 9}}, evaluated_variants(_measured(2, [(4, 4)] * 2)))
    assert coverage_markdown(alone) == [] and alone["warnings"] == []


def test_the_report_carries_the_variant_table_and_warnings_into_the_manifest_and_the_run_summary(tmp_path, monkeypatch):
    """tasks/evaluate.py's report_task, its Prefect calls (artifacts, logger) recorded in-process: the coverage
    reaches the manifest, its warnings and its markdown section, and a table artifact."""
    import logging

    import tasks.evaluate as te
    from eyrie.stages.evaluate import request_statistics

    artifacts = []
    monkeypatch.setattr(te, "create_table_artifact", lambda table, key, description="": artifacts.append(key))
    monkeypatch.setattr(te, "get_run_logger", lambda: logging.getLogger("test"))
    (tmp_path / "prepare").mkdir()
    data = _dataset(tmp_path / "prepare", [5] * 20, "prepare")
    trained = _trained_result()
    trained.update(
        label="trained",
        acceptance_length=3.0,
        per_position_acceptance=[0.5],
        drafts=40,
        statistics=request_statistics(trained["requests"]),
    )
    for m in trained["sets"].values():
        stats = request_statistics(m["requests"])
        m.update(acceptance_length=1.5, per_position_acceptance=[0.5], drafts=20, statistics=stats)
    out = te.report_task.fn([trained], str(tmp_path), None, 0.15, training_data=str(data), val_fraction=0.1)
    assert "template-variants" in artifacts
    assert out["template_variants"]["rows"][1]["variant"] == "think"
    assert any("'think'" in w and "none of the 18" in w for w in out["warnings"])
    assert any("regeneration is off" in line for line in out["markdown"])
    assert json.loads((tmp_path / "manifest.json").read_text())["template_variants"]["source"] == "prepare"
