"""Preflight's report: what was found, every failure and warning, as `preflight.json` and as markdown."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class PreflightReport:
    architecture: str
    vllm_class: str | None
    eagle3_path: str
    eagle3_reason: str
    language_model: str | None
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    captured_layer_ids: list[int]
    vllm_version: str
    max_model_len: int
    # What the train stage needs from the target, decided here (see `eyrie.stages.train.trainer.training_command`):
    # `verifier_weights`, speculators' names for the tensors the drafter borrows -> the checkpoint's, and
    # `mask_token_id`.
    target_facts: dict = field(default_factory=dict)
    final_norm: str | None = None  # the target's final norm class (speculators applies it as an RMSNorm)
    revisions: dict = field(default_factory=dict)  # hub revisions as this run pinned them (commits)
    estimated_bytes: int | None = None
    free_bytes: int | None = None
    hidden_states: str = "offline"  # train.hidden_states: online runs have no extract stage (`eyrie status` reads it)
    # The vLLM start-up levers of each server ({server: {lever: {status, reason, asked}}}, eyrie.vllm.levers).
    startup_levers: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # information, not a problem: e.g. the label transforms applied
    failures: list[str] = field(default_factory=list)
    # What this host could not judge (no GPU here for a GPU config...): said in the verdict, never a silent pass.
    unjudged: list[str] = field(default_factory=list)
    # The key of the verdict on the target, vLLM and the config (eyrie.stages.preflight.verdict), and whether this
    # report reused a passing one from the run folder (no vLLM import) or checked afresh.
    verdict_key: str | None = None
    verdict_reused: bool = False
    # The interpreter that runs the servers when it is not the flow's own ($EYRIE_VLLM_PYTHON): the verdict on vLLM
    # was reached there, through a probe process. Set on every preflight, never part of the kept verdict.
    vllm_python: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def report_markdown(report: PreflightReport) -> str:
    """The report as a user reads it in Prefect's UI: the verdict first, then every problem and what was found."""
    verdict = (
        f"**FAILED**: {len(report.failures)} problem(s), no weights were loaded"
        if report.failures
        else f"passed: `{report.architecture}` via the {report.eagle3_path} EAGLE-3 path"
        + (f"; not judged on this host: {'; '.join(report.unjudged)}" if report.unjudged else "")
    )
    weights = report.target_facts.get("verifier_weights", {})
    rows = [
        ("architecture", f"`{report.architecture}` (vLLM `{report.vllm_class}`)"),
        ("EAGLE-3 path", f"{report.eagle3_path}: {report.eagle3_reason}"),
        ("layers / hidden / vocab", f"{report.num_layers} / {report.hidden_size} / {report.vocab_size}"),
        ("captured layer ids", str(report.captured_layer_ids)),
        ("max_model_len", str(report.max_model_len)),
        ("borrowed tensors", ", ".join(f"`{v}`" for v in weights.values()) or "-"),
        ("hidden states (estimate)", f"{report.estimated_bytes / 2**30:.1f} GiB" if report.estimated_bytes else "-"),
        ("vLLM", report.vllm_version + (f" (`{report.vllm_python}`)" if report.vllm_python else "")),
        ("start-up levers", _levers(report.startup_levers) or "-"),
        ("verdict", f"{'reused' if report.verdict_reused else 'checked'} (key `{report.verdict_key}`)"),
    ]
    return "\n".join(
        [
            f"# Preflight {verdict}",
            "",
            *(f"- {f}" for f in report.failures),
            "",
            *(f"- warning: {w}" for w in report.warnings),
            *(f"- {n}" for n in report.notes),
            "",
            "| check | found |",
            "|---|---|",
            *(f"| {k} | {v} |" for k, v in rows),
        ]
    )


def _levers(levers: dict) -> str:
    """Each server's applied start-up levers, in one line."""
    return "; ".join(
        f"{server}: {', '.join(n for n, lv in found.items() if lv['status'] == 'applied') or 'none'}"
        for server, found in levers.items()
    )


def report_text(report: PreflightReport) -> str:
    """The report as `eyrie preflight` prints it: the one-line verdict first, then every problem, warning and note,
    then what was found (the whole report is `--json`)."""
    if report.failures:
        head = [f"preflight FAILED ({len(report.failures)}), no weights were loaded:"]
        head += [f"  - {f}" for f in report.failures]
    else:
        head = [
            f"preflight passed: {report.architecture} via the {report.eagle3_path} EAGLE-3 path, "
            f"capturing layers {report.captured_layer_ids}"
            + (" (except what this host cannot judge, below)" if report.unjudged else "")
        ]
    head += [f"  not judged on this host: {u}" for u in report.unjudged]
    found = [
        f"  target        {report.architecture} (vLLM {report.vllm_class}), {report.num_layers} layers, hidden "
        f"{report.hidden_size}, vocabulary {report.vocab_size}",
        f"  vLLM          {report.vllm_version}"
        + (f" ({report.vllm_python})" if report.vllm_python else "")
        + f", max_model_len {report.max_model_len}",
        f"  verdict       {'reused' if report.verdict_reused else 'checked'} (key {report.verdict_key})",
    ]
    if report.startup_levers:
        found.append(f"  levers        {_levers(report.startup_levers)}")
    return "\n".join(
        [
            *head,
            *(f"  warning: {w}" for w in report.warnings),
            *(f"  note: {n}" for n in report.notes),
            "found:",
            *found,
        ]
    )
