"""The train/serve gap compares validation with what vLLM served on the validation conversations' own prompts (the
same population), not on the held-out prompts: a prompt repeated in the data is held out whole by the hash split, so
a kind of prompt can be absent from training (the demo's "Name three colors.", 75 of its 256 held-out prompts) and
show as a gap though training and serving agree."""

from __future__ import annotations

import json

import pytest
from conftest import config_dict

from eyrie.config import parse_config
from eyrie.errors import ConfigError
from eyrie.stages.evaluate import (
    VALIDATION,
    evaluation_sets,
    gap_sentence,
    gap_warning,
    measured_gap,
    validation_prompts,
)


def _conversation(i: int, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": "be brief"}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"q{i}.{t}"}, {"role": "assistant", "content": f"a{i}.{t}"}]
    return {"messages": messages}


def _data(tmp_path, rows: int, lines: int | None = None):
    from datasets import Dataset

    data_dir = tmp_path / "regenerate"
    Dataset.from_dict({"seq_len": [10] * rows}).save_to_disk(str(data_dir / "dataset"))
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text(
        "".join(json.dumps(_conversation(i, turns=1 + i % 2)) + "\n" for i in range(rows if lines is None else lines))
    )
    return data_dir, conversations


def test_the_validation_prompts_are_the_trainers_split_cut_before_the_first_answer(tmp_path):
    data_dir, conversations = _data(tmp_path, 10)
    rows = validation_prompts(data_dir, conversations, 0.25, limit=100)
    # speculators' split: int(10 * 0.75) = 7, so rows 7, 8 and 9 are validated on.
    assert [r["messages"][-1]["content"] for r in rows] == ["q7.0", "q8.0", "q9.0"]
    assert all(r["messages"][-1]["role"] == "user" and r["category"] is None for r in rows)
    assert rows[0]["messages"][0] == {"role": "system", "content": "be brief"}
    assert len(validation_prompts(data_dir, conversations, 0.25, limit=2)) == 2
    assert validation_prompts(data_dir, conversations, 0.0, limit=100) == []  # no validation split


def test_conversations_that_do_not_line_up_with_the_rows_give_no_validation_prompts(tmp_path):
    data_dir, conversations = _data(tmp_path, 10, lines=11)  # regeneration lost a row: no row-by-row match
    assert validation_prompts(data_dir, conversations, 0.25, limit=100) == []
    assert validation_prompts(tmp_path / "missing", conversations, 0.25, limit=100) == []


def _trained(held_out: list[float], drafts: int, own: list[float] | None = None, own_drafts: int = 130) -> dict:
    out = {"per_position_acceptance": held_out, "drafts": drafts}
    if own is not None:
        out["sets"] = {VALIDATION: {"per_position_acceptance": own, "drafts": own_drafts}}
    return out


VAL = {"full_acc_0_epoch": 0.97, "full_acc_1_epoch": 0.94, "full_acc_2_epoch": 0.91}


def test_the_gap_is_measured_on_the_validation_prompts_when_they_were_served():
    # The AVX2 demo's shape: validation 0.97/0.94/0.91, held-out 0.86/0.79/0.68 over 1,091 drafts (a kind of prompt
    # training never saw), the validation conversations' own prompts served at 0.95/0.92/0.89.
    held_out = [0.86, 0.79, 0.68]
    gap = measured_gap(VAL, _trained(held_out, 1091, own=[0.95, 0.92, 0.89]), 0.15)
    assert gap["served_on"] == VALIDATION and gap["drafts"] == 130
    assert gap["flagged"] == [] and gap_warning(gap) is None
    assert [r["served"] for r in gap["rows"]] == [0.95, 0.92, 0.89]
    assert [r["held_out"] for r in gap["rows"]] == held_out  # shown beside, not compared
    assert "validation conversations' own prompts" in gap_sentence(gap)


def test_a_real_train_serve_difference_still_shows_on_the_validation_prompts():
    gap = measured_gap(VAL, _trained([0.86, 0.79, 0.68], 1091, own=[0.9, 0.6, 0.4]), 0.15)
    assert gap["flagged"] == [2, 3]
    warning = gap_warning(gap)
    assert warning.startswith("training does not predict serving")
    assert "validation conversations' own prompts" in warning and "training and serving differ" in warning


def test_without_the_validation_prompts_the_gap_falls_back_to_the_held_out_prompts_and_says_so():
    gap = measured_gap(VAL, _trained([0.86, 0.79, 0.68], 1091), 0.15)
    assert gap["served_on"] == "held-out" and gap["flagged"] == [3]
    assert all("held_out" not in r for r in gap["rows"])
    warning = gap_warning(gap)
    assert "held-out prompts are another population" in warning
    assert "on the held-out prompts" in gap_sentence(gap)
    # a validation set served with no drafts (every answer one token) is no measurement: the held-out prompts
    assert (
        measured_gap(VAL, _trained([0.86, 0.79, 0.68], 1091, own=[0.0, 0.0, 0.0], own_drafts=0), 0.15)["served_on"]
        == "held-out"
    )


def test_a_configured_set_cannot_take_the_validation_prompts_name(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"turns": ["hi"]}) + "\n")
    cfg = config_dict(
        tmp_path / "t", evaluate={"prompt_sets": [{"name": VALIDATION, "path": str(tmp_path / "p.jsonl")}]}
    )
    with pytest.raises(ConfigError, match=f"the name '{VALIDATION}' is taken"):
        evaluation_sets(parse_config(cfg))
