"""Named evaluation sets: the prompt files the config lists, read into prompts, and statistics per category."""

from __future__ import annotations

import json
from pathlib import Path

from eyrie.stages.evaluate.intervals import request_statistics

# ---------------------------------------------------------------------------------------------------------------
# Named evaluation sets (issue 25 item 3): the held-out prompts, plus each prompt file the config lists, each
# reported apart, per prompt category where the file has one.

HELD_OUT = "held-out"
# The prompts of the conversations the trainer validates on, served apart: the train/serve gap compares validation
# with vLLM's acceptance on these, the same conversations (eyrie.stages.evaluate.gap). The held-out prompts are
# another population: split by a hash of each prompt, a prompt repeated in the data lands whole on one side, and a
# kind of prompt can be held out entirely (the demo's "Name three colors.").
VALIDATION = "train-validation"


def prompt_rows(path: Path, name: str, category_field: str = "category", limit: int | None = None) -> list[dict]:
    """A prompt file's rows as `{"messages": [...], "category": str | None}`, in file order: JSON lines (or one
    JSON list) whose rows hold MT-Bench-style `turns` (a list of user turns: the first is sent, later turns need the
    target's own answer to the one before), or `messages` (a conversation, cut before its first assistant turn,
    as the held-out prompts are). A row of neither shape is an error that names the row and the shapes taken."""
    from eyrie.errors import ConfigError

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"evaluation set {name!r}: cannot read its prompt file {path}: {e}") from e
    stripped = text.lstrip()
    rows_raw: list = json.loads(stripped) if stripped.startswith("[") else []
    if not rows_raw:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows_raw.append(json.loads(line))
                except ValueError as e:
                    raise ConfigError(f"evaluation set {name!r}: line {n} of {path} is not JSON ({e})") from e
    rows = []
    for n, row in enumerate(rows_raw, 1):
        messages = None
        if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            first = row["turns"][0]
            messages = [{"role": "user", "content": first if isinstance(first, str) else json.dumps(first)}]
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            cut = next((i for i, m in enumerate(row["messages"]) if m.get("role") == "assistant"), None)
            messages = row["messages"][:cut]
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ConfigError(
                f"evaluation set {name!r}: row {n} of {path} has no prompt: give each row `turns` (a list of user "
                "turns, MT-Bench style) or `messages` (a list of {role, content} with at least one turn before the "
                "first assistant turn)"
            )
        category = row.get(category_field)
        rows.append({"messages": messages, "category": None if category is None else str(category)})
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ConfigError(f"evaluation set {name!r}: {path} holds no prompts")
    return rows


def evaluation_sets(config, root: Path | None = None) -> dict[str, list[dict]]:
    """The prompt files `evaluate.prompt_sets` lists, by name, each its rows (`prompt_rows`); relative paths from
    `root` (the config's folder), each set capped at `evaluate.num_prompts` unless it says otherwise."""
    from eyrie.errors import ConfigError

    out: dict[str, list[dict]] = {}
    for s in getattr(config.evaluate, "prompt_sets", None) or []:
        if s.name in (HELD_OUT, VALIDATION) or s.name in out:
            raise ConfigError(f"evaluate.prompt_sets: the name {s.name!r} is taken; give each set a name of its own")
        path = Path(s.path)
        if not path.is_absolute() and root is not None:
            path = root / path
        out[s.name] = prompt_rows(path, s.name, s.category_field, s.limit or config.evaluate.num_prompts)
    return out


def by_category(requests: list[dict], categories: list[str | None]) -> dict[str, dict]:
    """`request_statistics` for each prompt category (requests in prompt order, one category each); empty when no
    prompt has one."""
    if not any(c is not None for c in categories):
        return {}
    groups: dict[str, list[dict]] = {}
    for r, c in zip(requests, categories, strict=True):
        groups.setdefault(c if c is not None else "(none)", []).append(r)
    return {c: request_statistics(rs) for c, rs in sorted(groups.items())}


def validation_prompts(data_dir: Path, conversations: Path, val_fraction: float, limit: int) -> list[dict]:
    """The prompts of the conversations the trainer validates on (the last `val_fraction` of the rows of
    `data_dir/dataset`, split as speculators splits them: `int(len * (1 - val_fraction))`), each cut before its first
    assistant turn, at most `limit`, as the rows of a named evaluation set; `conversations`: the conversations
    row-aligned with that dataset (prepare's `conversations.jsonl`). Empty when there is no validation split or the
    conversations do not line up with the dataset's rows (regeneration lost some): the gap then falls back to the
    held-out prompts."""
    from eyrie.stages.evaluate.coverage import _seq_lens

    seq_lens = _seq_lens(Path(data_dir) / "dataset")
    if not seq_lens or val_fraction <= 0 or not Path(conversations).is_file():
        return []
    lines = [line for line in Path(conversations).read_text().splitlines() if line.strip()]
    if len(lines) != len(seq_lens):
        return []
    out = []
    for line in lines[int(len(seq_lens) * (1 - val_fraction)) :][:limit]:
        messages = json.loads(line)["messages"]
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first:
            out.append({"messages": messages[:first], "category": None})
    return out
