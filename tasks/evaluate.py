from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_image_artifact, create_table_artifact

from eyrie.evaluate import (
    draft_token_report,
    gap_warning,
    measure,
    measure_throughput,
    plot_draft_tokens,
    train_serve_gap,
)
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
    throughput_concurrency: list[int] | None = None,
) -> dict:
    done = read_json(Path(out_path))
    if done and done.get("key") == key:  # measured by a run that died before Prefect recorded the result
        return done
    spec = replace(spec, drafter=drafter)
    server = ExtractionServer(Path(server_dir))
    try:
        client = _serve(spec, Path(server_dir), startup_timeout_s)
        result = measure(client, prompts, max_tokens)
        if throughput_concurrency:  # on the same server: the drafter at the served k, for the draft-token report
            result["throughput"] = [measure_throughput(client, prompts, max_tokens, c) for c in throughput_concurrency]
    finally:
        server.stop(log=get_run_logger().info)
    result.update(label=label, key=key, drafter=drafter, num_speculative_tokens=spec.num_speculative_tokens)
    atomic_write_json(Path(out_path), result)
    fault_point(f"evaluate.{label}.written")
    return result


@task(name="draft-tokens", cache_policy=BY_KEY, retries=1)
def draft_tokens_task(
    drafter: str,
    spec: ServerSpec,
    out_dir: str,
    prompts: list[list[dict]],
    max_tokens: int,
    key: str,
    startup_timeout_s: float,
    sweep: int,
    trained: dict,
) -> dict:
    """How many draft tokens: the trained drafter served drafting `sweep` tokens (acceptance at every k up to it)
    and the target alone (throughput without a drafter), each its own server, beside `trained`, the evaluation's
    measurement at the served k. A table, a plot (`draft_tokens.png`, also an image artifact) and a JSON report."""
    out = Path(out_dir)
    done = read_json(out / "draft_tokens.json")
    if done and done.get("key") == key:
        return done

    @contextmanager
    def serve(spec: ServerSpec, folder: str) -> Iterator[ServerClient]:
        server = ExtractionServer(out / folder)
        try:
            yield _serve(spec, out / folder, startup_timeout_s)
        finally:
            server.stop(log=get_run_logger().info)

    report = draft_token_report(serve, spec, drafter, prompts, max_tokens, sweep, trained)
    table, throughput = report["draft_tokens"], report["throughput"]
    plot = plot_draft_tokens(table, throughput, out / "draft_tokens.png")
    report.update(key=key, plot=str(plot))
    atomic_write_json(out / "draft_tokens.json", report)
    create_table_artifact(table, key="draft-tokens", description="acceptance length for k draft tokens")
    create_table_artifact(throughput, key="throughput", description="output tokens/s with and without the drafter")
    png = base64.b64encode(plot.read_bytes()).decode()
    create_image_artifact(f"data:image/png;base64,{png}", key="draft-tokens-plot", description=str(plot))
    return report


@task(name="report")
def report_task(results: list[dict], out_dir: str, val_metrics: dict | None, max_gap: float) -> dict:
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
    trained = summary["trained"]
    gap = train_serve_gap(val_metrics, trained["per_position_acceptance"], max_gap, trained["drafts"])
    create_table_artifact(
        gap["rows"], key="train-serve-gap", description="validation accuracy vs acceptance in vLLM, per position"
    )
    if warning := gap_warning(gap):
        get_run_logger().warning(warning)
    manifest = {"stage": "evaluate", "results": summary, "train_serve_gap": gap}
    atomic_write_json(Path(out_dir) / "manifest.json", manifest)
    return manifest


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
