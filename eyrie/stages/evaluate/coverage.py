"""The training data's chat-template variants against evaluation's: what share of the conversations the drafter was
trained on each variant had, beside its share of the evaluation prompts and the trained drafter's acceptance on it.

A drafter learns the format it was trained on: a variant production serves (a `thinking` switch, say) that was a
tiny share of the training data, or none of it, is a format the drafter barely saw, and its acceptance there is
what that costs (tokenspeed #1305: a template suffix moved a drafter from 3.87 to 2.08). Each regenerated row
records its variant (`regenerate.template_mix`: the dataset's rows in order in `template_variants.json`); without a
mix, or without regeneration (the prepared data, rendered with the template's own rendering), every row is
`default`. Evaluation measures the held-out prompts and each named set with the default rendering and, again, with
each `evaluate.template_variants` entry (the sets `<set>, <variant>`).
"""

from __future__ import annotations

from pathlib import Path

from eyrie.run.files import read_json
from eyrie.stages.evaluate.intervals import request_statistics
from eyrie.stages.evaluate.sets import HELD_OUT

DEFAULT_VARIANT = "default"  # the template's own rendering, no switches (regenerate's name for it too)
# A variant evaluated (served) on less than this share of the training conversations is flagged: too few examples
# of its format for the drafter to have learnt it.
TINY_SHARE = 0.05
VARIANTS_FILE = "template_variants.json"  # beside a regenerated dataset: each row's variant, in row order


def set_variant(set_name: str) -> str:
    """The chat-template variant an evaluation set was rendered with: `<set>, <variant>` (`variant_set_name`; set and
    variant names hold no comma), else the default rendering."""
    return set_name.rsplit(", ", 1)[1] if ", " in set_name else DEFAULT_VARIANT


def _seq_lens(dataset_dir: Path) -> list[int] | None:
    if not (dataset_dir / "dataset_info.json").exists():
        return None
    from datasets import load_from_disk

    return [int(n) for n in load_from_disk(str(dataset_dir)).with_format(None)["seq_len"]]


def training_variants(data_dir: Path, val_fraction: float = 0.0) -> dict:
    """The variant of each conversation the drafter was trained on, counted from what is on disk in `data_dir` (the
    folder extraction and training read: `regenerate/` or `prepare/`): conversations and tokens per variant, over
    the rows trained on (the first `1 - val_fraction` of the dataset, as speculators splits it; the rest it
    validates on). `source`: the stage the data came from; `note`: how its rows were rendered, when not per row."""
    data_dir = Path(data_dir)
    manifest = read_json(data_dir / "manifest.json") or {}
    source = manifest.get("stage") or data_dir.name
    seq_lens = _seq_lens(data_dir / "dataset")
    recorded = read_json(data_dir / VARIANTS_FILE)
    note = None
    if source != "regenerate":
        note = (
            "regeneration is off: the prepared data were rendered with the target's chat template's own (default) "
            "rendering, no chat_template_kwargs, so every training conversation is `default`"
        )
    elif recorded is None:
        note = "regenerated without regenerate.template_mix: every conversation rendered with the default template"
    if recorded is None and seq_lens is not None:
        recorded = [DEFAULT_VARIANT] * len(seq_lens)
    if recorded is None or (seq_lens is not None and len(recorded) != len(seq_lens)):
        # No per-row record to match the dataset's rows: the stage's own counts, over all its rows, no tokens.
        counts = (manifest.get("stats") or {}).get("template_variants") or {}
        if not counts:
            rows = manifest.get("num_samples") or len(seq_lens or [])
            counts = {DEFAULT_VARIANT: rows} if rows else {}
        why = f"{data_dir / VARIANTS_FILE} does not match the dataset's rows" if recorded is not None else None
        return {"source": source, "note": why or note, "conversations": dict(counts), "tokens": None}
    trained = int(len(recorded) * (1 - val_fraction))  # speculators' ArrowDataset split
    conversations: dict[str, int] = {}
    tokens: dict[str, int] | None = {} if seq_lens is not None else None
    for i in range(trained):
        v = recorded[i]
        conversations[v] = conversations.get(v, 0) + 1
        if tokens is not None and seq_lens is not None:
            tokens[v] = tokens.get(v, 0) + seq_lens[i]
    return {"source": source, "note": note, "conversations": conversations, "tokens": tokens}


def evaluated_variants(result: dict) -> dict[str, dict]:
    """One drafter's measurement per variant: its prompts and `request_statistics` over every set rendered with it
    (the held-out prompts and each named set)."""
    groups: dict[str, dict] = {}
    parts = [(HELD_OUT, result)] if "prompts" in result else []
    parts += list((result.get("sets") or {}).items())
    for name, m in parts:
        g = groups.setdefault(set_variant(name), {"prompts": 0, "requests": [], "sets": []})
        g["prompts"] += int(m.get("prompts") or 0)
        g["requests"] += m.get("requests") or []
        g["sets"].append(name)
    return {
        v: {"prompts": g["prompts"], "sets": g["sets"], "statistics": request_statistics(g["requests"])}
        for v, g in groups.items()
    }


def _share(part: int | None, total: int) -> float | None:
    return round(part / total, 4) if part is not None and total else None


def variant_coverage(training: dict, evaluated: dict[str, dict], tiny: float = TINY_SHARE) -> dict:
    """The table (one row per variant, evaluated ones first) and the warnings: a variant evaluated (so served) with
    no share, or less than `tiny`, of the training conversations; a variant trained on that evaluation does not
    measure."""
    convs = training.get("conversations") or {}
    tokens = training.get("tokens")
    n_convs, n_tokens = sum(convs.values()), sum((tokens or {}).values())
    n_prompts = sum(e["prompts"] for e in evaluated.values())
    rows, warnings = [], []
    for v in [*evaluated, *(v for v in convs if v not in evaluated)]:
        e = evaluated.get(v)
        pooled = e["statistics"]["pooled"]["acceptance_length"] if e else None
        rows.append(
            {
                "variant": v,
                "training_conversations": convs.get(v, 0),
                "training_share": _share(convs.get(v, 0), n_convs),
                "training_token_share": _share((tokens or {}).get(v, 0), n_tokens) if tokens is not None else None,
                "evaluation_prompts": e["prompts"] if e else 0,
                "evaluation_share": _share(e["prompts"] if e else 0, n_prompts),
                "acceptance_length": pooled,
                "requests_with_drafts": e["statistics"]["requests_with_drafts"] if e else 0,
            }
        )
    why = f" ({training['note']})" if training.get("note") else ""
    for row in rows:
        v, share = row["variant"], row["training_share"] or 0.0
        if row["evaluation_prompts"] and n_convs and share == 0:
            warnings.append(
                f"chat-template variant {v!r} is evaluated (production serves it) but none of the "
                f"{n_convs} training conversations was rendered with it{why}: its acceptance is that of a format "
                "the drafter never saw; mix it into the training data (regenerate.enabled with "
                f"regenerate.template_mix naming {v!r})"
            )
        elif row["evaluation_prompts"] and n_convs and share < tiny:
            warnings.append(
                f"chat-template variant {v!r} is evaluated (production serves it) but only "
                f"{row['training_conversations']} of the {n_convs} training conversations ({share:.1%}, under "
                f"{tiny:.0%}) were rendered with it: raise its weight in regenerate.template_mix"
            )
        elif not row["evaluation_prompts"] and row["training_conversations"]:
            warnings.append(
                f"the drafter was trained on chat-template variant {v!r} ({share:.1%} of the training "
                "conversations) but evaluation does not measure it: declare it in evaluate.template_variants with "
                "the chat_template_kwargs production sends"
            )
    return {"source": training.get("source"), "note": training.get("note"), "rows": rows, "warnings": warnings}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def coverage_markdown(coverage: dict) -> list[str]:
    """The run summary's variant section; nothing when training and evaluation both used the default alone."""
    rows = coverage.get("rows") or []
    if [r["variant"] for r in rows] in ([], [DEFAULT_VARIANT]):
        return []
    lines = [
        f"Chat-template variants, the training data (`{coverage.get('source')}`) against evaluation"
        + (f"; {coverage['note']}" if coverage.get("note") else "")
        + ":",
        "",
        "| variant | training conversations | training tokens | evaluation prompts | acceptance length (trained) "
        "| requests |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        al = r["acceptance_length"]
        ci = al.get("ci95") if al else None
        figure = "-" if not al or al.get("value") is None else f"{al['value']}" + (f" [{ci[0]}, {ci[1]}]" if ci else "")
        lines.append(
            f"| {r['variant']} | {r['training_conversations']} ({_pct(r['training_share'])}) "
            f"| {_pct(r['training_token_share'])} | {r['evaluation_prompts']} ({_pct(r['evaluation_share'])}) "
            f"| {figure} | {r['requests_with_drafts']} |"
        )
    return [*lines, ""]


def coverage_table(coverage: dict) -> list[dict]:
    """The rows as a table artifact's (flat values, intervals as text)."""
    out = []
    for r in coverage.get("rows") or []:
        al = r["acceptance_length"] or {}
        out.append({**r, "acceptance_length": al.get("value"), "acceptance_ci95": al.get("ci95")})
    return out
