"""A flow run's retries reuse the hub commits its first attempt pinned (flows/opening.py, eyrie/target/pins.py):
a `main` that moves between two attempts of one flow run changes no key; a new flow run pins afresh. In process, on
the session's Prefect server, through the real opening (preflight and prepare on a tiny target)."""

from __future__ import annotations

import pytest
from conftest import DEMO_DATA, HubDatasetRepo, config_dict
from prefect import flow

from eyrie.config import parse_config
from eyrie.run.files import read_json
from eyrie.run.folder import RunFolder
from eyrie.target.hub import Pinned
from eyrie.target.pins import PINS, pin_for_flow_run
from flows.opening import open_run

FIRST, MOVED = "4" * 40, "5" * 40

pytestmark = pytest.mark.usefixtures("flow_api")


def test_a_retried_flow_run_keeps_the_commits_its_first_attempt_pinned(tmp_path, tiny_llama):
    rows = DEMO_DATA.read_text()
    data = HubDatasetRepo({FIRST: {"train.jsonl": rows}, MOVED: {"train.jsonl": rows}})
    try:
        config = parse_config(config_dict(tiny_llama, source=data.repo, max_samples=16, shard_size=8))
        run = RunFolder(tmp_path / "run")
        run.ensure()
        seen: list[str | None] = []

        @flow(retries=1, retry_delay_seconds=0)
        def opening_then_a_failure():
            with run.lock():
                seen.append(open_run(config, run).config.data.revision)
            if len(seen) == 1:
                data.point_main_at(MOVED)  # a push to the hub between the attempts
                raise RuntimeError("a stage failed after the opening: Prefect retries the flow run")

        opening_then_a_failure()
        assert seen == [FIRST, FIRST]  # the retry kept the first attempt's commit
        assert read_json(run.root / PINS)["commits"]["data"] == FIRST
        assert read_json(run.root / "preflight.json")["revisions"]["data"] == FIRST
        # A new flow run pins afresh (the week's commit): the next test, without a second opening's cost.
    finally:
        data.remove()


def test_pins_are_reused_only_by_the_same_flow_run_asking_the_same(tmp_path, monkeypatch):
    """The record is read only for its own flow run and request; a run without a flow run id pins and records
    nothing."""
    import eyrie.target.pins as pins

    config = parse_config({"target": {"model": "org/model"}, "data": {"source": "org/data", "revision": "main"}})
    commit = iter(f"{i}" * 40 for i in range(1, 10))
    monkeypatch.setattr(
        pins,
        "pin_revisions",
        lambda target, data, t, d: Pinned(target, data.model_copy(update={"revision": next(commit)})),
    )
    first, reused = pin_for_flow_run(config.target, config.data, tmp_path, "run-a", False, True)
    assert (first.data.revision, reused) == ("1" * 40, False)
    again, reused = pin_for_flow_run(config.target, config.data, tmp_path, "run-a", False, True)
    assert (again.data.revision, reused) == ("1" * 40, True)
    other, _ = pin_for_flow_run(config.target, config.data, tmp_path, "run-b", False, True)
    assert other.data.revision == "2" * 40
    branch = config.model_copy(update={"data": config.data.model_copy(update={"revision": "dev"})})
    assert pin_for_flow_run(branch.target, branch.data, tmp_path, "run-b", False, True)[0].data.revision == "3" * 40
    (tmp_path / PINS).unlink()
    assert pin_for_flow_run(config.target, config.data, tmp_path, None, False, True)[0].data.revision == "4" * 40
    assert not (tmp_path / PINS).exists()
