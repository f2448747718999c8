from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from eyrie.evaluate import measure
from eyrie.export import export_and_prove
from eyrie.faults import fault_point
from eyrie.promote import decide_and_promote
from eyrie.server import ExtractionServer, ServerClient, ServerSpec
from eyrie.store import atomic_write_json, read_json
from tasks.caching import BY_KEY


def _serve(spec: ServerSpec, folder: Path, timeout_s: float) -> ServerClient:
    return ExtractionServer(folder).ensure(spec, timeout_s, log=get_run_logger().info)


@task(name="export", cache_policy=BY_KEY, retries=1)
def export_task(
    checkpoint: str,
    out_dir: str,
    target_model: str,
    aux_ids: list[int],
    hidden_size: int,
    key: str,
    spec: ServerSpec,
    probe: list[dict],
    startup_timeout_s: float,
) -> dict:
    """Write the drafter, then prove vLLM serves it as eagle3 (the server stays up for evaluation to reuse)."""
    out = Path(out_dir)

    def serve(drafter: str) -> ServerClient:
        return _serve(replace(spec, drafter=drafter), out / "server-trained", startup_timeout_s)

    return export_and_prove(Path(checkpoint), out, target_model, aux_ids, hidden_size, key, serve, probe)


@task(name="evaluate", task_run_name="evaluate-{label}", cache_policy=BY_KEY, retries=1)
def evaluate_task(
    label: str,
    drafter: str,
    spec: ServerSpec,
    server_dir: str,
    prompts: list[list[dict]],
    max_tokens: int,
    out_path: str,
    key: str,
    startup_timeout_s: float,
) -> dict:
    done = read_json(Path(out_path))
    if done and done.get("key") == key:  # measured by a run that died before Prefect recorded the result
        return done
    spec = replace(spec, drafter=drafter)
    server = ExtractionServer(Path(server_dir))
    try:
        result = measure(_serve(spec, Path(server_dir), startup_timeout_s), prompts, max_tokens)
    finally:
        server.stop(log=get_run_logger().info)
    result.update(label=label, key=key, drafter=drafter, num_speculative_tokens=spec.num_speculative_tokens)
    atomic_write_json(Path(out_path), result)
    fault_point(f"evaluate.{label}.written")
    return result


@task(name="report")
def report_task(results: list[dict], out_dir: str) -> dict:
    rows = [
        {
            "drafter": r["label"],
            "acceptance_length": r["acceptance_length"],
            **{f"accept@{i + 1}": v for i, v in enumerate(r["per_position_acceptance"])},
            "drafts": r["drafts"],
            "prompts": r["prompts"],
        }
        for r in results
    ]
    create_table_artifact(rows, key="evaluation", description="acceptance length on held-out prompts")
    summary = {r["label"]: r for r in results}
    atomic_write_json(Path(out_dir) / "manifest.json", {"stage": "evaluate", "results": summary})
    return summary


@task(name="promote")
def promote_task(
    promo_dir: str, drafter: str, version: str, candidate: dict, current: dict | None, context: dict
) -> dict:
    """Point `<promo_dir>/current` at the new drafter if it is at least as good as the current one."""
    decision = decide_and_promote(Path(promo_dir), Path(drafter), version, candidate, current, context)
    log = get_run_logger()
    (log.info if decision["promoted"] else log.warning)(
        f"{'promoted' if decision['promoted'] else 'not promoted'}: {decision['reason']} ({decision['current']})"
    )
    return decision
