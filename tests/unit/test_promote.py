"""Promotion's decisions and its on-disk swap (pure logic over folders; the real-stack retraining is in
test_pipeline.py), and fault-injection parsing."""

from __future__ import annotations

import json
import os

import pytest

from eyrie.run.faults import InjectedFault, armed_faults, fault_point
from eyrie.stages.promote import CURRENT, check_base, choose_base, current_version, decide, decide_and_promote


def make_drafter(folder, weights=b"w1", vocab=256, aux=(2, 4, 5), verifier="/targets/t"):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "draft_vocab_size": vocab,
                "eagle_aux_hidden_state_layer_ids": list(aux),
                "speculators_config": {"verifier": {"name_or_path": verifier}},
            }
        )
    )
    return folder


def test_decide_promotes_only_when_better():
    assert decide({"acceptance_length": 1.2}, None)[0]  # the first drafter
    assert not decide({"acceptance_length": 1.5}, {"acceptance_length": 1.5})[0]  # a tie keeps the current one
    ok, why = decide({"acceptance_length": 1.4}, {"acceptance_length": 1.5})
    assert not ok and "1.4 is not above the current drafter's 1.5" in why
    ok, why = decide({"acceptance_length": None}, {"acceptance_length": 1.5})
    assert not ok and "could not be measured" in why


def test_promotion_swaps_the_link_and_a_worse_drafter_leaves_it(tmp_path):
    promo = tmp_path / "drafters"
    first = make_drafter(tmp_path / "a")
    d = decide_and_promote(promo, first, "v1", {"acceptance_length": 1.3}, None, {"run_dir": "r1"})
    assert d["promoted"] and "no current drafter" in d["reason"]
    assert os.readlink(promo / CURRENT) == os.path.join("versions", "v1")  # relative: the folder can move
    assert (promo / CURRENT / "model.safetensors").read_bytes() == b"w1"
    assert json.loads((promo / CURRENT / "promotion.json").read_text())["run_dir"] == "r1"

    worse = make_drafter(tmp_path / "b", b"w2")
    d = decide_and_promote(promo, worse, "v2", {"acceptance_length": 1.1}, {"acceptance_length": 1.3}, {})
    assert not d["promoted"] and "not above" in d["reason"]
    assert current_version(promo).name == "v1" and not (promo / "versions" / "v2").exists()

    better = make_drafter(tmp_path / "c", b"w3")
    d = decide_and_promote(promo, better, "v3", {"acceptance_length": 1.6}, {"acceptance_length": 1.3}, {})
    assert d["promoted"] and current_version(promo).name == "v3"
    assert (promo / CURRENT / "model.safetensors").read_bytes() == b"w3"
    assert (promo / "versions" / "v1" / "model.safetensors").read_bytes() == b"w1"  # kept, never changed

    again = decide_and_promote(promo, better, "v3", {"acceptance_length": 1.0}, None, {})
    assert again["promoted"] and "already the current" in again["reason"]
    history = [json.loads(line) for line in (promo / "history.jsonl").read_text().splitlines()]
    assert [(h["version"], h["promoted"]) for h in history] == [("v1", True), ("v2", False), ("v3", True)]
    assert [p.name for p in promo.iterdir() if p.name.startswith(".")] == []  # no staging or link left behind


def test_the_warm_start_base_is_fixed_per_data(tmp_path):
    record = tmp_path / "train" / "warm_start.json"
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    assert choose_base(record, "data-1", v1) == v1
    assert choose_base(record, "data-1", v2) == v1  # a re-run of the same data: the same base
    assert choose_base(record, "data-2", v2) == v2  # a new snapshot: today's current drafter
    assert choose_base(record, "data-3", None) is None


def test_a_warm_start_that_cannot_fit_is_refused_with_the_fix(tmp_path):
    base = make_drafter(tmp_path / "d", vocab=256, aux=(2, 4, 5), verifier="/targets/t")
    assert check_base(base, "/targets/t", 256, [2, 4, 5]) == []
    [msg] = check_base(base, "/targets/other", 512, [1, 2, 3])
    for part in (
        "trained for the target /targets/t",
        "256 tokens, vocab.draft_vocab_size is 512",
        "reads layers [2, 4, 5], this run extracts [1, 2, 3]",
        "promotion.warm_start: false",
    ):
        assert part in msg


def test_fault_points(tmp_path, monkeypatch):
    monkeypatch.delenv("EYRIE_FAULTS", raising=False)
    fault_point("anything")  # unarmed: a no-op
    monkeypatch.setenv("EYRIE_FAULTS", "extract.shard-00001=raise, vocab.before-manifest=enospc")
    assert armed_faults() == {"extract.shard-00001": "raise", "vocab.before-manifest": "enospc"}
    with pytest.raises(InjectedFault):
        fault_point("extract.shard-00001")
    with pytest.raises(OSError) as err:
        fault_point("vocab.before-manifest")
    assert err.value.errno == 28
    fault_point("extract.shard-00002")
    monkeypatch.setenv("EYRIE_FAULTS_WHILE", str(tmp_path / "armed"))
    fault_point("extract.shard-00001")  # disarmed: the file does not exist
    (tmp_path / "armed").touch()
    with pytest.raises(InjectedFault):
        fault_point("extract.shard-00001")
    monkeypatch.setenv("EYRIE_FAULTS", "x=explode")
    with pytest.raises(ValueError, match="must be one of kill, raise, enospc"):
        armed_faults()
