"""prepare's key with its fingerprints remembered in the run folder: the same key as computed afresh, no tokenizer
load on a re-run while nothing changed, and a new key whenever the tokenizer's files, the target's files, the data's
files or a config field change (the memo never hides a change)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import DEMO_DATA

import eyrie.stages.prepare.key as prep
from eyrie.config import DataConfig, TargetConfig


def _data(source, **kw) -> DataConfig:
    return DataConfig(source=str(source), **{"max_length": 256, "shard_size": 4, "eval_fraction": 0.0, **kw})


@pytest.fixture
def setup(tmp_path, tiny_llama):
    model = tmp_path / "target"
    shutil.copytree(tiny_llama, model)
    data = tmp_path / "data.jsonl"
    shutil.copy(DEMO_DATA, data)
    return TargetConfig(model=str(model)), data, tmp_path / "run" / "fingerprints.json"


def _no_tokenizer_load(monkeypatch):
    def refuse(target):
        raise AssertionError("the tokenizer was loaded although nothing it depends on changed")

    monkeypatch.setattr(prep, "load_tokenizer", refuse)


def _edit_template(target: TargetConfig) -> None:
    template = Path(target.model, "chat_template.jinja")
    if template.is_file():
        template.write_text(template.read_text() + "{# edited #}")
    else:
        cfg_path = Path(target.model, "tokenizer_config.json")
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] += "{# edited #}"
        cfg_path.write_text(json.dumps(cfg))


def test_memo_gives_the_same_key_and_skips_the_tokenizer(setup, monkeypatch):
    target, data, memo = setup
    memo.parent.mkdir()
    fresh = prep.prepare_key(target, _data(data))
    assert prep.prepare_key(target, _data(data), memo) == fresh
    assert memo.is_file()
    with monkeypatch.context() as m:
        _no_tokenizer_load(m)
        assert prep.prepare_key(target, _data(data), memo) == fresh
        # A config field is keyed afresh: it changes the key with no tokenizer load.
        assert prep.prepare_key(target, _data(data, max_length=128), memo) != fresh


def test_memo_never_hides_a_change(setup):
    target, data, memo = setup
    memo.parent.mkdir()
    before = prep.prepare_key(target, _data(data), memo)
    _edit_template(target)  # the tokenizer's files: a new chat template
    after_template = prep.prepare_key(target, _data(data), memo)
    assert after_template != before
    assert after_template == prep.prepare_key(target, _data(data))
    # The data: the same size, rewritten in place (same path and inode).
    text = data.read_text()
    edited = text.replace("apple", "appel", 1)
    assert len(edited) == len(text) and edited != text
    with open(data, "r+") as f:
        f.write(edited)
    after_data = prep.prepare_key(target, _data(data), memo)
    assert after_data not in (before, after_template)
    assert after_data == prep.prepare_key(target, _data(data))


def test_a_damaged_or_foreign_memo_is_not_trusted(setup, monkeypatch):
    target, data, memo = setup
    memo.parent.mkdir()
    fresh = prep.prepare_key(target, _data(data))
    memo.write_text("{not json")
    assert prep.prepare_key(target, _data(data), memo) == fresh
    # Another run's memo (other ids) planted here: its values are never read for this target and data.
    memo.write_text(json.dumps({"tokenizer": {"other": "x" * 64}, "source": {"other": "y" * 64}}))
    assert prep.prepare_key(target, _data(data), memo) == fresh
    # A read-only folder: computed each time, the same key.
    memo.unlink()
    memo.parent.chmod(0o500)
    try:
        assert prep.prepare_key(target, _data(data), memo) == fresh
    finally:
        memo.parent.chmod(0o700)


def test_regeneration_reads_the_template_fingerprint_prepare_remembered(setup, monkeypatch):
    """Regeneration keys its shards on the template: on a re-run it reads the fingerprint prepare remembered (no
    transformers import), the value computed afresh; a new template is fingerprinted again, and the source's memo
    entry stays."""
    target, data, memo = setup
    memo.parent.mkdir()
    fresh = prep.tokenizer_fingerprint(prep.load_tokenizer(target))
    prep.prepare_key(target, _data(data), memo)
    with monkeypatch.context() as m:
        _no_tokenizer_load(m)
        assert prep.remembered_tokenizer_fingerprint(target, memo) == fresh
    _edit_template(target)
    edited = prep.remembered_tokenizer_fingerprint(target, memo)
    assert edited != fresh and edited == prep.tokenizer_fingerprint(prep.load_tokenizer(target))
    assert set(json.loads(memo.read_text())) == {"tokenizer", "source"}
    with monkeypatch.context() as m:
        _no_tokenizer_load(m)
        assert prep.remembered_tokenizer_fingerprint(target, memo) == edited
