"""The keys of evaluate's results: one drafter's measurement, and the draft-token sweep."""

from __future__ import annotations

from eyrie.stages.evaluate.sets import HELD_OUT


def evaluate_key(
    config, label: str, drafter_identity: str, prompts: list[list[dict]], server: str, sets: dict | None = None
) -> str:
    """What one drafter's measurement depends on (`eyrie.run.identity.STAGES["evaluate"]`): which drafter, the
    prompts and how much is generated, and what its server computes (`server`: the serving spec's
    `output_identity`, with this drafter: target identity, drafter content, draft tokens, output-shaping arguments,
    vLLM version). The target moving, or vLLM, measures again. `sets`: the named evaluation sets
    (`evaluation_sets`), by content, with the held-out prompts."""
    from eyrie.target.metadata import stage_key

    measured = {HELD_OUT: prompts, **sets} if sets else prompts
    return stage_key("evaluate", config, label=label, drafter_id=drafter_identity, prompts=measured, server=server)


def draft_tokens_key(config, trained_key: str) -> str:
    from eyrie.target.metadata import stage_key

    return stage_key("draft_tokens", config, trained=trained_key)
