from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_image_artifact, create_table_artifact

from eyrie.run.faults import fault_point
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.manifest import finished_manifest
from eyrie.stages.evaluate import (
    HELD_OUT,
    TemplateVariant,
    baseline_warnings,
    by_category,
    compare_drafters,
    coverage_markdown,
    coverage_table,
    draft_token_report,
    evaluated_variants,
    evaluation_markdown,
    gap_warning,
    measure,
    measure_throughput,
    measured_gap,
    plot_draft_tokens,
    training_variants,
    variant_coverage,
    variant_set_name,
    with_per_request_metrics,
)
from eyrie.vllm.client import ServerClient
from eyrie.vllm.process import VllmServer
from eyrie.vllm.provenance import differences, served_under
from eyrie.vllm.spec import ServerSpec
from tasks.caching import StageDone, eyrie_task, stage_task
from tasks.serving import serve, stop


@dataclass
class EvaluateJob:
    """One drafter's measurement: served with the target (`spec`, its drafter set here) in `server_dir`, on the
    held-out `prompts`; the result written to `out_path`."""

    label: str  # trained, current, untrained
    drafter: str
    spec: ServerSpec
    server_dir: str
    prompts: list[list[dict]]
    max_tokens: int
    out_path: str
    key: str
    startup_timeout_s: float
    throughput_concurrency: list[int] | None = None  # also tokens/s at these concurrencies, on the same server
    # The measurement this one is compared with (its JSON file): by default the trained drafter's, beside this one
    # in the evaluation folder (the flow measures it first). None for the trained drafter itself.
    reference: str | None = None
    # Named evaluation sets (`eyrie.stages.evaluate.evaluation_sets`): each measured on the same server after the
    # held-out prompts, reported apart (`sets` in the result), per prompt category where its rows name one.
    prompt_sets: dict[str, list[dict]] | None = None
    # Chat-template variants (`eyrie.stages.evaluate.template_variants`): every set (the held-out prompts too) is
    # also measured rendered with each variant's switches, reported as the set "<set>, <variant>".
    template_variants: dict[str, dict] | None = None

    def reference_path(self) -> Path | None:
        if self.reference:
            return Path(self.reference)
        return None if self.label == "trained" else Path(self.out_path).with_name("trained.json")


def stale_against_reference(job: EvaluateJob) -> list[str]:
    """Why this drafter's finished measurement cannot be compared with the reference's (the trained drafter's,
    measured in this run): the server they were measured under differs (`eyrie.vllm.provenance.differences`:
    vLLM version, model runner, attention backend, serving arguments). Empty when it can, or when either is not
    there yet."""
    ref_path = job.reference_path()
    ref = read_json(ref_path) if ref_path else None
    mine = read_json(Path(job.out_path))
    if not ref or not mine:
        return []
    return differences(mine.get("served_under"), ref.get("served_under"))


class MeasuredAlike(StageDone):
    """`StageDone`, and while the finished measurement was made under the same server as the measurement it is
    compared with (issue 25 item 6): when the vLLM version, model runner, attention backend or serving arguments
    changed since, the drafter is measured again before anything is compared with it."""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kw):
        cache_key = super().compute_key(task_ctx, inputs, flow_parameters, **kw)
        job = inputs.get("job")
        if cache_key is None or not isinstance(job, EvaluateJob) or not stale_against_reference(job):
            return cache_key
        return f"{cache_key}-remeasure-{uuid.uuid4().hex}"


@eyrie_task(
    "evaluate",
    cache_policy=MeasuredAlike(argument="job.key", manifest="{job.out_path}"),
    task_run_name="evaluate-{job.label}",
    retries=1,
)
def evaluate_task(job: EvaluateJob) -> dict:
    log = get_run_logger()
    measured = finished_manifest(Path(job.out_path), job.key)  # by a run that died before Prefect recorded it
    if measured and (changed := stale_against_reference(job)):
        log.warning(
            f"the {job.label} drafter's measurement in {job.out_path} was made under another server than the "
            f"measurement it is compared with ({'; '.join(changed)}): measuring it again"
        )
        measured = None
    if measured:
        return measured
    spec = replace(job.spec, drafter=job.drafter)
    state = VllmServer(Path(job.server_dir)).state
    if not (state and state.get("fingerprint") == spec.fingerprint()):
        # A server of its own: with vLLM's per-request acceptance in each response. The trained drafter's server,
        # left up by export's proof, is reused as it is (another target load costs more than `measure`'s fallback,
        # which reads the counters around each prompt sent alone).
        spec = replace(spec, server_args=with_per_request_metrics(spec.server_args))
    try:
        client = serve(spec, Path(job.server_dir), job.startup_timeout_s)
        result = measure(client, job.prompts, job.max_tokens)
        # What it was measured under: compared before this measurement is compared with any other.
        result["served_under"] = served_under(_log_text(Path(job.server_dir)), spec)
        if job.prompt_sets:
            result["sets"] = {name: measure_set(client, rows, job.max_tokens) for name, rows in job.prompt_sets.items()}
        for variant, switches in (job.template_variants or {}).items():
            rendered = TemplateVariant(client, switches)
            sets = result.setdefault("sets", {})
            held = [{"messages": p, "category": None} for p in job.prompts]
            sets[variant_set_name(HELD_OUT, variant)] = measure_set(rendered, held, job.max_tokens)
            for name, rows in (job.prompt_sets or {}).items():
                sets[variant_set_name(name, variant)] = measure_set(rendered, rows, job.max_tokens)
        if job.throughput_concurrency:  # on the same server: the drafter at the served k, for the draft-token report
            result["throughput"] = [
                measure_throughput(client, job.prompts, job.max_tokens, c) for c in job.throughput_concurrency
            ]
    finally:
        stop(Path(job.server_dir))
    result.update(label=job.label, key=job.key, drafter=job.drafter, num_speculative_tokens=spec.num_speculative_tokens)
    atomic_write_json(Path(job.out_path), result)
    fault_point(f"evaluate.{job.label}.written")
    return result


def measure_set(client, rows: list[dict], max_tokens: int) -> dict:
    """One named evaluation set on a server already up: `measure`'s figures, and per prompt category."""
    out = measure(client, [r["messages"] for r in rows], max_tokens)
    out["categories"] = by_category(out["requests"], [r.get("category") for r in rows])
    return out


def _log_text(server_dir: Path) -> str:
    try:
        return VllmServer(server_dir).log_path.read_text(errors="replace")
    except OSError:
        return ""


@dataclass
class DraftTokensJob:
    drafter: str
    spec: ServerSpec
    out_dir: str
    prompts: list[list[dict]]
    max_tokens: int
    key: str
    startup_timeout_s: float
    sweep: int  # the most draft tokens served


@stage_task("draft-tokens", manifest="{job.out_dir}/draft_tokens.json", argument="job.key", retries=1)
def draft_tokens_task(job: DraftTokensJob, trained: dict) -> dict:
    """How many draft tokens: the trained drafter served drafting `sweep` tokens (acceptance at every k up to it)
    and the target alone (throughput without a drafter), each its own server, beside `trained`, the evaluation's
    measurement at the served k. A table, a plot (`draft_tokens.png`, also an image artifact) and a JSON report."""
    out, key, startup_timeout_s = Path(job.out_dir), job.key, job.startup_timeout_s
    if measured := finished_manifest(out / "draft_tokens.json", key):
        return measured

    @contextmanager
    def serving(spec: ServerSpec, folder: str) -> Iterator[ServerClient]:
        try:
            yield serve(spec, out / folder, startup_timeout_s)
        finally:
            stop(out / folder)

    report = draft_token_report(serving, job.spec, job.drafter, job.prompts, job.max_tokens, job.sweep, trained)
    table, throughput = report["draft_tokens"], report["throughput"]
    plot = plot_draft_tokens(table, throughput, out / "draft_tokens.png")
    # The schedule vLLM takes, beside the table and the plot: the speculative config to serve with.
    schedule = report["schedule"]
    atomic_write_json(out / "speculative_config.json", schedule["speculative_config"])
    report.update(key=key, plot=str(plot), speculative_config=str(out / "speculative_config.json"))
    create_table_artifact(
        schedule["best_k"],
        key="draft-tokens-schedule",
        description=f"the best draft-token count per concurrency; serve with {out / 'speculative_config.json'}"
        + (f" ({schedule['note']})" if schedule.get("note") else ""),
    )
    atomic_write_json(out / "draft_tokens.json", report)
    create_table_artifact(table, key="draft-tokens", description="acceptance length for k draft tokens")
    create_table_artifact(throughput, key="throughput", description="output tokens/s with and without the drafter")
    png = base64.b64encode(plot.read_bytes()).decode()
    create_image_artifact(f"data:image/png;base64,{png}", key="draft-tokens-plot", description=str(plot))
    return report


def _ci(figure: dict) -> str:
    if figure.get("value") is None:
        return "-"
    return (
        f"{figure['value']} [{figure['ci95'][0]}, {figure['ci95'][1]}]" if figure.get("ci95") else str(figure["value"])
    )


def statistics_rows(results: list[dict]) -> list[dict]:
    """Pooled and mean-of-per-request acceptance side by side, each with its 95% interval, per drafter."""
    rows = []
    for r in results:
        stats = r.get("statistics")
        if not stats:
            continue
        for kind in ("pooled", "per_request_mean"):
            s = stats[kind]
            rows.append(
                {
                    "drafter": r["label"],
                    "figure": "pooled" if kind == "pooled" else "mean of per-request",
                    "acceptance_length": _ci(s["acceptance_length"]),
                    **{f"accept@{i + 1}": _ci(f) for i, f in enumerate(s["per_position"])},
                    "requests": stats["requests_with_drafts"],
                }
            )
    return rows


@eyrie_task("report")
def report_task(
    results: list[dict],
    out_dir: str,
    val_metrics: dict | None,
    max_gap: float,
    training_data: str | None = None,
    val_fraction: float = 0.0,
) -> dict:
    """The evaluation's tables, warnings and run-summary section. `training_data`: the folder training read (its
    dataset and, regenerated with a template mix, each row's chat-template variant), for the variant coverage."""
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
    for r in results:  # each named evaluation set apart
        for name, m in (r.get("sets") or {}).items():
            rows.append(
                {
                    "drafter": f"{r['label']} ({name})",
                    "acceptance_length": m["acceptance_length"],
                    **{f"accept@{i + 1}": v for i, v in enumerate(m["per_position_acceptance"])},
                    "drafts": m["drafts"],
                    "prompts": m["prompts"],
                }
            )
    create_table_artifact(rows, key="evaluation", description="acceptance length per drafter and evaluation set")
    if stats := statistics_rows(results):
        create_table_artifact(
            stats,
            key="evaluation-intervals",
            description="pooled vs mean of per-request acceptance, with 95% confidence intervals",
        )
    summary = {r["label"]: r for r in results}
    trained = summary["trained"]
    # The trained drafter against the untrained baseline and the current drafter, paired on the same prompts:
    # promotion decides on these (eyrie.stages.promote.decide), and one not clearly better is a warning.
    comparisons = compare_drafters(summary)
    trained["versus"] = comparisons
    warnings = baseline_warnings(summary, comparisons)
    coverage = None
    if training_data:  # the training data's chat-template variants against evaluation's (issue 25 item 4)
        coverage = variant_coverage(training_variants(Path(training_data), val_fraction), evaluated_variants(trained))
        warnings += coverage["warnings"]
        create_table_artifact(
            coverage_table(coverage),
            key="template-variants",
            description="chat-template variants: share of the training data and of the evaluation prompts, and "
            "the trained drafter's acceptance on each" + (f" ({coverage['note']})" if coverage.get("note") else ""),
        )
    # Validation against vLLM on the validation conversations' own prompts when they were served (the same
    # population); the held-out prompts otherwise.
    gap = measured_gap(val_metrics, trained, max_gap)
    create_table_artifact(
        gap["rows"], key="train-serve-gap", description="validation accuracy vs acceptance in vLLM, per position"
    )
    log = get_run_logger()
    if warning := gap_warning(gap):
        log.warning(warning)
    for warning in warnings:
        log.warning(warning)
    manifest = {
        "stage": "evaluate",
        "results": summary,
        "comparisons": comparisons,
        "train_serve_gap": gap,
        "warnings": warnings,
        # The run summary's acceptance section (flows/pipeline.py puts it in the run-summary artifact): pooled and
        # mean-of-per-request acceptance with intervals, per position, per evaluation set and prompt category.
        "markdown": evaluation_markdown(summary) + (coverage_markdown(coverage) if coverage else []),
        "template_variants": coverage,
    }
    atomic_write_json(Path(out_dir) / "manifest.json", manifest)
    return manifest
