"""evaluate: acceptance length on held-out prompts, read from vLLM's speculative-decoding counters.

Acceptance length is mean tokens per target step with the bonus token: 1 + accepted / drafts. Per-position rates are
accepted_at_position_i / drafts. Counters are read from the server's Prometheus /metrics before and after the
prompts, so a reused server's earlier traffic does not count.

Two figures, side by side, each with a 95% confidence interval, overall and per position (`request_statistics`):
the **pooled** acceptance length (every request's drafts together: what a server's counters and vLLM's own
benchmarks report, weighted by how long each request drafted) and the **mean of the per-request** acceptance
lengths (what one user's request sees on average; vllm #42508 is the two taken for each other). The per-request
counts come from vLLM's per-request speculative-decoding metrics in each response (`--per-request-spec-decode-
metrics summary`, added to the server's arguments where the installed vLLM has it), else from the counters read
around each prompt sent alone (then the pooled figure is that same traffic's; `measure`), each read once the
server's metrics count the answered requests finished (`settled_counters`). The pooled interval is the ratio
estimator's (the delta method over requests), not a binomial over drafts: drafts of one request are not independent.

Two drafters measured on the same prompts are compared pairwise (`paired_difference`): the difference of their
pooled acceptance lengths with the standard error of that difference over the prompts, which is what promotion
decides on and what tells a trained drafter from a useless one (`baseline_warnings`).
"""

from __future__ import annotations

from eyrie.stages.evaluate.baselines import BASELINES, baseline_warnings, compare_drafters, served_apart
from eyrie.stages.evaluate.counters import (
    PER_REQUEST_METRICS,
    acceptance,
    measure,
    request_counts,
    spec_counters,
    vllm_has_per_request_metrics,
    with_per_request_metrics,
)
from eyrie.stages.evaluate.coverage import (
    coverage_markdown,
    coverage_table,
    evaluated_variants,
    set_variant,
    training_variants,
    variant_coverage,
)
from eyrie.stages.evaluate.draft_tokens import (
    draft_token_report,
    draft_token_table,
    measure_throughput,
    plot_draft_tokens,
    throughput_rows,
)
from eyrie.stages.evaluate.gap import gap_sentence, gap_warning, measured_gap, train_serve_gap
from eyrie.stages.evaluate.intervals import (
    CLEARLY_BETTER_Z,
    FLOOR,
    Z95,
    floor_comparison,
    mean_estimate,
    paired_difference,
    ratio_estimate,
    request_statistics,
)
from eyrie.stages.evaluate.keys import draft_tokens_key, evaluate_key
from eyrie.stages.evaluate.markdown import evaluation_markdown
from eyrie.stages.evaluate.schedule import (
    SCHEDULE_FIELD,
    batch_size_schedule,
    best_k_per_concurrency,
    vllm_has_batch_size_schedule,
)
from eyrie.stages.evaluate.sets import (
    HELD_OUT,
    VALIDATION,
    by_category,
    evaluation_sets,
    prompt_rows,
    validation_prompts,
)
from eyrie.stages.evaluate.variants import (
    TemplateVariant,
    template_variant_warnings,
    template_variants,
    variant_set_name,
)

__all__ = [
    "BASELINES",
    "CLEARLY_BETTER_Z",
    "FLOOR",
    "HELD_OUT",
    "VALIDATION",
    "PER_REQUEST_METRICS",
    "SCHEDULE_FIELD",
    "TemplateVariant",
    "Z95",
    "acceptance",
    "baseline_warnings",
    "batch_size_schedule",
    "best_k_per_concurrency",
    "by_category",
    "compare_drafters",
    "coverage_markdown",
    "coverage_table",
    "draft_token_report",
    "draft_token_table",
    "draft_tokens_key",
    "evaluate_key",
    "evaluated_variants",
    "evaluation_markdown",
    "evaluation_sets",
    "floor_comparison",
    "gap_sentence",
    "gap_warning",
    "mean_estimate",
    "measure",
    "measure_throughput",
    "measured_gap",
    "paired_difference",
    "plot_draft_tokens",
    "prompt_rows",
    "ratio_estimate",
    "request_counts",
    "request_statistics",
    "served_apart",
    "set_variant",
    "spec_counters",
    "template_variant_warnings",
    "template_variants",
    "throughput_rows",
    "train_serve_gap",
    "training_variants",
    "variant_coverage",
    "validation_prompts",
    "variant_set_name",
    "vllm_has_batch_size_schedule",
    "vllm_has_per_request_metrics",
    "with_per_request_metrics",
]
