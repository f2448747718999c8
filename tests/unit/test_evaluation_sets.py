"""Issue 25 item 3: named evaluation sets (the held-out prompts plus each prompt file the config lists, MT-Bench-style
`turns` or `messages`), each measured apart and per prompt category, and the run summary's acceptance section:
pooled and mean-of-per-request acceptance side by side, each with its interval, per position."""

from __future__ import annotations

import json

import pytest
from conftest import config_dict
from test_acceptance_statistics import FakeClient

from eyrie.config import parse_config
from eyrie.errors import ConfigError
from eyrie.stages.evaluate import (
    HELD_OUT,
    by_category,
    evaluate_key,
    evaluation_markdown,
    evaluation_sets,
    measure,
    prompt_rows,
)
from tasks.evaluate import measure_set


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_files_of_either_shape_and_a_bad_row_named(tmp_path):
    mt = _write(
        tmp_path / "mt.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now in French."]},
            {"question_id": 82, "category": "math", "turns": ["What is 2+2?"]},
        ],
    )
    rows = prompt_rows(mt, "mt")
    assert rows == [
        {"messages": [{"role": "user", "content": "Write a haiku."}], "category": "writing"},
        {"messages": [{"role": "user", "content": "What is 2+2?"}], "category": "math"},
    ]
    conv = tmp_path / "conv.json"  # one JSON list, `messages` cut before the first assistant turn
    conv.write_text(
        json.dumps(
            [
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "Bye"},
                    ]
                }
            ]
        )
    )
    [row] = prompt_rows(conv, "conv")
    assert [m["role"] for m in row["messages"]] == ["system", "user"] and row["category"] is None
    bad = _write(tmp_path / "bad.jsonl", [{"turns": ["ok"]}, {"prompt": "no shape Eyrie takes"}])
    with pytest.raises(ConfigError, match=r"'bad': row 2 of .*bad.jsonl has no prompt: give each row `turns`"):
        prompt_rows(bad, "bad")
    with pytest.raises(ConfigError, match="cannot read its prompt file"):
        prompt_rows(tmp_path / "missing.jsonl", "missing")


def test_the_config_names_the_sets_and_the_key_holds_their_prompts(tmp_path):
    mt = _write(tmp_path / "mt.jsonl", [{"category": c, "turns": [f"q{i}"]} for i, c in enumerate("aabbb")])
    config = parse_config(
        config_dict(tmp_path / "t", evaluate={"prompt_sets": [{"name": "mt-bench", "path": str(mt), "limit": 4}]})
    )
    sets = evaluation_sets(config)
    assert list(sets) == ["mt-bench"] and len(sets["mt-bench"]) == 4
    prompts = [[{"role": "user", "content": "held"}]]
    plain = evaluate_key(config, "trained", "d", prompts, "server")
    assert plain == evaluate_key(config, "trained", "d", prompts, "server", {})  # no sets: the key as before
    with_sets = evaluate_key(config, "trained", "d", prompts, "server", sets)
    assert with_sets != plain
    sets["mt-bench"][0]["messages"][0]["content"] = "changed"
    assert evaluate_key(config, "trained", "d", prompts, "server", sets) != with_sets  # by content
    with pytest.raises(ConfigError, match="the name 'held-out' is taken"):
        evaluation_sets(
            parse_config(config_dict(tmp_path / "t", evaluate={"prompt_sets": [{"name": HELD_OUT, "path": str(mt)}]}))
        )


def test_each_set_and_category_is_reported_apart_with_both_figures_and_intervals():
    hists = {f"p{i}": [i % 3, 1, 2, 1 + i] for i in range(12)}
    client = FakeClient(hists, per_request=True)
    rows = [
        {"messages": [{"role": "user", "content": f"p{i}"}], "category": "math" if i < 6 else "writing"}
        for i in range(12)
    ]
    held = measure(client, [r["messages"] for r in rows[:8]], 16)
    held["label"] = "trained"
    held["sets"] = {"mt-bench": measure_set(client, rows, 16)}
    cats = held["sets"]["mt-bench"]["categories"]
    assert list(cats) == ["math", "writing"] and cats["math"]["requests"] == 6
    assert by_category(held["requests"], [None] * 8) == {}  # the held-out prompts name no category
    lines = evaluation_markdown({"trained": held})
    text = "\n".join(lines)
    assert "Acceptance on `held-out`" in text and "Acceptance on `mt-bench`" in text
    assert "`mt-bench` per prompt category, trained drafter:" in text
    header = "| drafter | figure | acceptance length | accept@1 | accept@2 | accept@3 | requests |"
    assert header in lines
    pooled = next(line for line in lines if line.startswith("| trained | pooled |"))
    mean = next(line for line in lines if line.startswith("| trained | mean of per-request |"))
    stats = held["statistics"]
    fig = stats["pooled"]["acceptance_length"]
    assert f"{fig['value']} [{fig['ci95'][0]}, {fig['ci95'][1]}]" in pooled
    fig = stats["per_request_mean"]["acceptance_length"]
    assert f"{fig['value']} [{fig['ci95'][0]}, {fig['ci95'][1]}]" in mean
    assert pooled.count("[") == 4 and mean.count("[") == 4  # the length and three positions, each an interval
    assert any(line.startswith("| math | pooled |") for line in lines)
    assert any(line.startswith("| writing | mean of per-request |") for line in lines)
