"""prepare: both conversation forms, an assistant-only loss mask, truncation, bad rows counted by reason, a
deterministic shard plan, and a clear refusal of tokenizers without a chat template. No model weights load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import DEMO_DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from eyrie.config import DataConfig, TargetConfig
from eyrie.errors import DataError
from eyrie.stages.prepare import (
    RowError,
    iter_eval_prompts,
    load_dataset_rows,
    load_shards,
    normalize,
    plan_shards,
    prepare,
    prepare_key,
    tokenize_conversation,
)
from eyrie.target.metadata import load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "Spell the word apple."},
    {"role": "assistant", "content": "The word apple is spelled a-p-p-l-e."},
]
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "You are a helpful assistant."},
        {"from": "human", "value": "What is 2 plus 3?"},
        {"from": "gpt", "value": "2 plus 3 is 5."},
        {"from": "human", "value": "Spell the word apple."},
        {"from": "gpt", "value": "The word apple is spelled a-p-p-l-e."},
    ]
}


@pytest.fixture(scope="module")
def target(tiny_llama) -> TargetConfig:
    return TargetConfig(model=str(tiny_llama))


@pytest.fixture(scope="module")
def tok(target):
    return load_tokenizer(target)


def _spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _data(source: Path, **kw) -> DataConfig:
    return DataConfig(source=str(source), **{"max_length": 256, "shard_size": 4, "eval_fraction": 0.0, **kw})


# ---------------------------------------------------------------------------------------------------------------
# One conversation


def test_messages_and_sharegpt_forms_normalize_alike():
    assert normalize({"messages": CONVERSATION}) == CONVERSATION
    assert normalize(SHAREGPT) == CONVERSATION
    # ShareGPT rows with role/content keys and OpenAI content parts are read too.
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 plus 3?"}]},
            {"role": "model", "content": "5"},
        ]
    }
    assert normalize(parts) == [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
        ({"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown_role"),
        ({"text": "hello"}, "no_conversation_field"),
        ({"messages": []}, "malformed_turn"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                    {"role": "assistant", "content": "x"},
                ]
            },
            "non_text_content",
        ),
        (["not", "a", "dict"], "not_a_mapping"),
    ],
)
def test_bad_rows_raise_with_reason(row, reason):
    with pytest.raises(RowError) as info:
        normalize(row)
    assert info.value.reason == reason


def test_loss_mask_covers_exactly_assistant_content(tok):
    ids, mask, truncated = tokenize_conversation(tok, CONVERSATION, max_length=256)
    assert not truncated and len(ids) == len(mask)
    # The whole render is the chat template's text, token for token.
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    spans = [tok.decode(s) for s in _spans(ids, mask)]
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert len(spans) == len(answers)
    for span, answer in zip(spans, answers):
        # Each masked span is the answer and the end-of-turn token; the ChatML template's newline after
        # <|im_end|> belongs to the turn too. Nothing of the role header, the user or the system is masked.
        assert span.startswith(answer + tok.eos_token), span
        assert span[len(answer + tok.eos_token) :].strip() == "", span
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    for m in CONVERSATION:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    assert sum(mask) == sum(len(s) for s in _spans(ids, mask))


def test_sharegpt_and_messages_tokenize_identically(tok):
    a = tokenize_conversation(tok, normalize({"messages": CONVERSATION}), 256)
    b = tokenize_conversation(tok, normalize(SHAREGPT), 256)
    assert a == b


def test_truncation(tok):
    long_answer = ", ".join(str(i) for i in range(1, 60)) + "."
    messages = [{"role": "user", "content": "Count from 1 to 59."}, {"role": "assistant", "content": long_answer}]
    full_ids, full_mask, truncated = tokenize_conversation(tok, messages, 10_000)
    assert not truncated
    n = len(full_ids) // 2
    ids, mask, truncated = tokenize_conversation(tok, messages, n)
    assert truncated and len(ids) == n
    assert (ids, mask) == (full_ids[:n], full_mask[:n])
    assert any(mask)
    # Cut before the answer starts: no loss tokens left, so the row is dropped with its own reason.
    first_masked = full_mask.index(1)
    with pytest.raises(RowError) as info:
        tokenize_conversation(tok, messages, first_masked)
    assert info.value.reason == "no_assistant_tokens_within_max_length"


# ---------------------------------------------------------------------------------------------------------------
# The stage


def test_prepare_counts_bad_rows_by_reason(tmp_path, target, tok):
    good = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:10]]
    rows = (
        good[:5]
        + [
            '{"messages": [{"role": "user", "content": "truncated line',  # malformed json
            {"messages": [{"role": "user", "content": "no answer"}]},  # no assistant turn
            {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]},  # unknown role
            {"prompt": "hi", "completion": "there"},  # no conversation field
            SHAREGPT,
        ]
        + good[5:]
    )
    source = _jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "prepare"
    manifest = prepare(target, _data(source), out)

    stats = json.loads((out / "stats.json").read_text())
    assert stats["dropped"] == {
        "malformed_json": 1,
        "no_assistant_turn": 1,
        "unknown_role": 1,
        "no_conversation_field": 1,
    }
    assert stats["rows_read"] == len(rows) == 15
    assert stats["rows_used"] == 11 == manifest["num_samples"]
    assert "mixed.jsonl:6" in stats["examples"]["malformed_json"]  # where the bad line is
    assert stats["examples"]["unknown_role"].startswith("row 7:")

    from datasets import load_from_disk

    ds = load_from_disk(str(out / "dataset")).with_format(None)
    assert len(ds) == 11 and set(ds.column_names) >= {"input_ids", "loss_mask", "seq_len"}
    assert [len(r) for r in ds["input_ids"]] == ds["seq_len"]
    assert sum(map(sum, ds["loss_mask"])) == stats["loss_tokens"]
    # Row order is kept: the ShareGPT row is the 6th used row.
    assert ds["input_ids"][5] == tokenize_conversation(tok, normalize(SHAREGPT), 256)[0]
    import torch

    freq = torch.load(out / "dataset" / "token_freq.pt")
    assert sum(freq.values()) == stats["loss_tokens"]
    shards = load_shards(out)
    assert [(s.start, s.stop) for s in shards] == [(0, 4), (4, 8), (8, 11)]
    assert not list(tmp_path.glob("*.staging-*"))


def test_prepare_with_nothing_usable_is_an_error(tmp_path, target):
    source = _jsonl(
        tmp_path / "bad.jsonl",
        ["{not json", {"messages": [{"role": "user", "content": "x"}]}, {"text": "no conversation"}],
    )
    with pytest.raises(DataError) as info:
        prepare(target, _data(source), tmp_path / "prepare")
    msg = str(info.value)
    assert "no usable conversations" in msg and "3 rows read" in msg
    for reason in ("malformed_json: 1", "no_assistant_turn: 1", "no_conversation_field: 1"):
        assert reason in msg
    assert not (tmp_path / "prepare").exists()
    empty = _jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="the source is empty"):
        prepare(target, _data(empty), tmp_path / "prepare")


def test_shard_plan_is_deterministic():
    rows = [[i] * (i + 1) for i in range(10)]
    a, b = plan_shards(rows, 4), plan_shards([list(r) for r in rows], 4)
    assert a == b
    assert [(s.index, s.start, s.stop, s.num_tokens) for s in a] == [(0, 0, 4, 10), (1, 4, 8, 26), (2, 8, 10, 19)]
    assert [s.name for s in a] == ["shard-00000", "shard-00001", "shard-00002"]
    changed = [list(r) for r in rows]
    changed[5][0] = 99
    c = plan_shards(changed, 4)
    assert [x.fingerprint == y.fingerprint for x, y in zip(a, c)] == [True, False, True]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=6), max_size=30), shard_size=st.integers(1, 8))
def test_shard_plan_tiles_the_rows(rows, shard_size):
    shards = plan_shards(rows, shard_size)
    assert [s.index for s in shards] == list(range(len(shards)))
    assert [s.start for s in shards] == list(range(0, len(rows), shard_size))
    assert all(0 < s.stop - s.start <= shard_size for s in shards)
    assert (shards[-1].stop if shards else 0) == len(rows)  # contiguous, nothing left out
    assert sum(s.num_tokens for s in shards) == sum(map(len, rows))
    assert plan_shards(rows, shard_size) == shards


def test_prepare_is_deterministic_and_keyed(tmp_path, target):
    data = _data(DEMO_DATA, max_samples=20, shard_size=8)
    key = prepare_key(target, data)
    assert key == prepare_key(target, data)
    m1 = prepare(target, data, tmp_path / "a", key=key)
    m2 = prepare(target, data, tmp_path / "b")
    took = m1.pop("seconds")
    assert took >= 0 and m2.pop("seconds") >= 0  # each run's own time (`eyrie status`)
    assert m1 == m2 and m1["num_samples"] == 20 and m1["key"] == key
    assert (tmp_path / "a" / "shards.json").read_bytes() == (tmp_path / "b" / "shards.json").read_bytes()
    assert load_dataset_rows(tmp_path / "a", 0, 20) == load_dataset_rows(tmp_path / "b", 0, 20)
    # A finished stage with the same key is reused as is.
    before = (tmp_path / "a" / "manifest.json").stat().st_mtime_ns
    assert prepare(target, data, tmp_path / "a", key=key) == {**m1, "seconds": took}
    assert (tmp_path / "a" / "manifest.json").stat().st_mtime_ns == before
    # What is read and how it is cut are part of the key.
    assert prepare_key(target, _data(DEMO_DATA, max_samples=20, shard_size=4)) != key
    assert prepare_key(target, _data(DEMO_DATA, max_samples=21, shard_size=8)) != key
    edited = tmp_path / "edited.jsonl"
    shutil.copy(DEMO_DATA, edited)
    edited_key = prepare_key(target, _data(edited, max_samples=20, shard_size=8))
    assert prepare_key(target, _data(edited, max_samples=20, shard_size=8)) == edited_key
    edited.write_text(edited.read_text().replace("apple", "apricot", 1))  # same path, new content
    assert prepare_key(target, _data(edited, max_samples=20, shard_size=8)) != edited_key


def test_eval_split_holds_out_prompts(tmp_path, target):
    data = _data(DEMO_DATA, max_samples=40, eval_fraction=0.3)
    manifest = prepare(target, data, tmp_path / "p")
    stats = manifest["stats"]
    assert stats["rows_eval"] > 0 and stats["rows_used"] == 40
    assert stats["rows_read"] == stats["rows_used"] + stats["rows_eval"]
    prompts = list(iter_eval_prompts(tmp_path / "p"))
    assert len(prompts) == stats["rows_eval"]
    assert all(p and p[-1]["role"] == "user" and all(m["role"] != "assistant" for m in p) for p in prompts)


def test_tokenizer_without_chat_template_is_refused(tmp_path, tiny_llama):
    from eyrie.target.tiny.tokenizer import build_tokenizer

    folder = tmp_path / "no-template"
    folder.mkdir()
    build_tokenizer(folder, chat_template=None)
    shutil.copy(tiny_llama / "config.json", folder / "config.json")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    target = TargetConfig(model=str(folder))
    with pytest.raises(DataError) as info:
        load_tokenizer(target)
    msg = str(info.value)
    assert "has no chat template" in msg and str(folder) in msg and "chat_template" in msg
    with pytest.raises(DataError, match="has no chat template"):
        prepare(target, _data(DEMO_DATA, max_samples=4), tmp_path / "prepare")


def test_missing_source_and_target_are_clear(tmp_path, target):
    from eyrie.errors import ConfigError

    with pytest.raises(DataError, match="does not exist"):
        prepare(target, _data(tmp_path / "missing.jsonl"), tmp_path / "p")
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(TargetConfig(model=str(tmp_path / "no-such-model")))


def test_an_eval_prompt_never_reaches_training_across_snapshots(tmp_path, target, tok):
    """The split is by the prompt evaluation sends (the conversation before its first answer), not by the whole
    conversation: a prompt answered again (a second answer in the data, an edited answer in a later snapshot, an
    answer regenerated by the target) stays held out with all its answers, and what one snapshot held out the next
    holds out too."""
    from eyrie.stages.prepare import _render

    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:80]]

    def answered_again(row: dict, n: int) -> dict:
        messages = normalize(row)
        return {
            "messages": [m if m["role"] != "assistant" else {**m, "content": f"Another answer {n}."} for m in messages]
        }

    first = _jsonl(tmp_path / "snapshot-1.jsonl", rows[:60])
    second = _jsonl(tmp_path / "snapshot-2.jsonl", rows + [answered_again(r, i) for i, r in enumerate(rows)])
    held_out, training = [], []
    for source, out in ((first, tmp_path / "p1"), (second, tmp_path / "p2")):
        manifest = prepare(target, _data(source, eval_fraction=0.25), out)
        held_out.append([json.dumps(p, sort_keys=True) for p in iter_eval_prompts(out)])
        training.append(load_dataset_rows(out, 0, manifest["num_samples"]))
    assert held_out[0] and set(held_out[0]) <= set(held_out[1])
    for prompt in {p for snapshot in held_out for p in snapshot}:
        prompt_ids = _render(tok, json.loads(prompt), True)
        leaks = [i for snapshot in training for i, ids in enumerate(snapshot) if ids[: len(prompt_ids)] == prompt_ids]
        assert not leaks, f"a held-out prompt is trained on (rows {leaks}): {prompt[:200]}"
