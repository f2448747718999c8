"""How a finished run reads in Prefect: warnings in the flow run's state message and tags (a run with warnings was
a bare green "Completed"), and the run summary's sentence on the train/serve gap said from its own table."""

from __future__ import annotations

import pytest
from conftest import config_dict
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from eyrie.config import parse_config
from eyrie.stages.evaluate import gap_sentence, train_serve_gap
from flows.pipeline import WARNINGS_TAG, _summary_markdown, completion

WARNINGS = ["training does not predict serving: at draft position(s) [1, 2, 3] ...", "undertrained: ..."]


@flow(name="eyrie-outcome-probe")
def _probe(warnings: list[str]):
    return completion({"run_dir": "r", "warnings": warnings})


def _tags(state) -> list[str]:
    with get_client(sync_client=True) as client:
        return list(client.read_flow_run(state.state_details.flow_run_id).tags)


@pytest.mark.usefixtures("flow_api")
def test_warnings_reach_the_state_message_and_the_tags():
    state = _probe(WARNINGS, return_state=True)
    assert state.is_completed()
    assert state.message.startswith("Completed with 2 warning(s)") and WARNINGS[0] in state.message
    assert WARNINGS_TAG in _tags(state)
    assert state.result()["warnings"] == WARNINGS  # the caller (eyrie run) still gets the outputs
    assert _probe(WARNINGS)["run_dir"] == "r"

    clean = _probe([], return_state=True)
    assert clean.is_completed() and "warning" not in (clean.message or "")
    assert WARNINGS_TAG not in _tags(clean)


def _gap(validation: list[float], served: list[float], drafts: int = 1000) -> dict:
    metrics = {f"full_acc_{i}_epoch": v for i, v in enumerate(validation)}
    return train_serve_gap(metrics, served, 0.15, drafts)


@pytest.mark.parametrize(
    ("validation", "served", "says"),
    [
        ([0.9, 0.8, 0.7], [0.5, 0.4, 0.3], "does not predict serving: every position is over the bound of 0.15"),
        ([0.9, 0.8, 0.7], [0.88, 0.79, 0.69], "Training predicts serving within 0.15 per position"),
        ([0.9, 0.8, 0.7], [0.88, 0.4, 0.3], "within 0.15 at position(s) [1], not at [2, 3] (over the bound)"),
    ],
)
def test_the_summary_sentence_says_what_its_table_shows(validation, served, says, tmp_path):
    gap = _gap(validation, served)
    if not gap["rows"]:
        pytest.fail(f"no rows: the validation metrics' names changed ({gap})")
    assert says in gap_sentence(gap)
    config = parse_config(config_dict(tmp_path))
    outputs = {
        "run_dir": "r",
        "drafter": "d",
        "promotion": None,
        "warnings": [],
        "hidden_states": "h",
        "evaluation": "e",
    }
    summary = {"trained": {"acceptance_length": 2.0, "per_position_acceptance": served}}
    text = _summary_markdown(config, outputs, summary, gap)
    assert says in text
    flagged = text.count("(over the bound) |")
    assert flagged == len(gap["flagged"])
    if len(gap["flagged"]) == len(gap["rows"]):
        assert "predicts serving within" not in text


@pytest.mark.usefixtures("flow_api")
def test_a_run_leaves_one_preflight_card(tiny_llama, tmp_path):
    """Preflight runs before prepare and again after it (the disk check on the real token count): the flow run shows
    one card, the last one's (three identical cards before)."""
    from flows.pipeline import pipeline_flow

    config = parse_config(config_dict(tiny_llama, max_samples=16))
    state = pipeline_flow(config, str(tmp_path / "run"), until="prepare", return_state=True)
    assert state.is_completed()
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    cards = [a for a in found if a.key == "preflight"]
    assert len(cards) == 1 and "| hidden states (estimate) | 0.0 GiB |" in cards[0].data  # the last one's
