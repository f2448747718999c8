"""prepare: conversations -> token ids with the target's chat template, an assistant-only loss mask, a shard plan.

Output (speculators' preprocessed format, so its tools read it): `dataset/` saved with `datasets.save_to_disk`
(columns input_ids, loss_mask, seq_len; torch format) with `dataset/token_freq.pt` (loss-masked token counts), plus
Eyrie's `shards.json` (the extraction plan, a content fingerprint per shard), `conversations.jsonl` (the train
conversations, row-aligned with the dataset, for the regenerate stage), `eval_prompts.jsonl` (held-out
conversations for evaluation) and `stats.json` (rows used and dropped by reason). No model weights are loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyrie.config import DataConfig, TargetConfig
from eyrie.errors import DataError
from eyrie.run.faults import fault_point
from eyrie.run.folder import atomic_write_json, read_json, replace_dir, sha256_file, sha256_json
from eyrie.run.manifest import files_under, finished_manifest, list_files
from eyrie.target.hub import hub_commit
from eyrie.target.metadata import load_tokenizer

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class RowError(ValueError):
    """A row that cannot be used; `reason` is the counter key in stats.json."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------------------------------
# Reading rows


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
    if not files:
        raise DataError(f"data.source {path} holds no .jsonl, .json or .parquet files")
    return files


def _local_source(cfg: DataConfig) -> Path:
    path = Path(cfg.source)
    if not path.exists():
        raise DataError(
            f"data.source {path} does not exist: give a local .jsonl/.json/.parquet file or folder, "
            "or a Hugging Face dataset id"
        )
    return path


def _is_local(source: str) -> bool:
    return os.path.exists(source) or source.endswith(LOCAL_SUFFIXES) or source.startswith((".", "/"))


def iter_rows(cfg: DataConfig) -> Iterator[Any]:
    """Raw rows from local files or the hub. A jsonl line that is not JSON is yielded as a RowError (counted)."""
    if _is_local(cfg.source):
        path = _local_source(cfg)
        for f in _local_files(path):
            if f.suffix == ".jsonl":
                with open(f, encoding="utf-8", errors="replace") as fh:
                    for n, line in enumerate(fh, 1):
                        if line.strip():
                            try:
                                yield json.loads(line)
                            except ValueError as err:
                                yield RowError("malformed_json", f"{f.name}:{n}: {err}")
            elif f.suffix == ".json":
                try:
                    data = json.loads(f.read_text(encoding="utf-8"))
                except ValueError as err:
                    raise DataError(f"{f} is not valid JSON ({err}): fix the file or convert it to jsonl") from None
                if not isinstance(data, list):
                    raise DataError(f"{f} must hold a JSON list of conversations, got {type(data).__name__}")
                yield from data
            else:
                import pyarrow.parquet as pq

                yield from pq.read_table(f).to_pylist()
    else:
        import datasets
        from huggingface_hub import snapshot_download

        try:
            # The repo's files at exactly this revision (the run pins it to a commit), read by datasets with the
            # hub's own subset and split resolution: the rows match the key, online or from the cache.
            snapshot = snapshot_download(
                cfg.source,
                repo_type="dataset",
                revision=cfg.revision,
                local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1",
            )
            ds = datasets.load_dataset(snapshot, name=cfg.subset, split=cfg.split)
        except Exception as err:  # the hub client raises many types; all mean "cannot read this source"
            raise DataError(
                f"cannot load dataset {cfg.source!r} (split {cfg.split!r}, revision {cfg.revision or 'main'!r}): {err}"
            ) from None
        yield from ds


def is_hub_source(cfg: DataConfig) -> bool:
    return not _is_local(cfg.source)


def source_fingerprint(cfg: DataConfig) -> str:
    """Content hash of local files; a hub dataset's id, subset, split and the commit its revision resolves to."""
    if not is_hub_source(cfg):
        path = _local_source(cfg)
        return sha256_json(
            [(str(f.relative_to(path)) if f != path else f.name, sha256_file(f)) for f in _local_files(path)]
        )
    return sha256_json(["hub", cfg.source, cfg.subset, cfg.split, hub_commit(cfg.source, "dataset", cfg.revision)])


# ---------------------------------------------------------------------------------------------------------------
# One conversation


def normalize(row: Any) -> list[dict]:
    """OpenAI `messages` or ShareGPT `conversations` -> [{"role", "content"}] with standard roles."""
    if isinstance(row, RowError):
        raise row
    if not isinstance(row, dict):
        raise RowError("not_a_mapping", f"row is a {type(row).__name__}")
    turns = row.get("messages", row.get("conversations"))
    if turns is None:
        raise RowError("no_conversation_field", f"keys {sorted(row)[:8]}; expected `messages` or `conversations`")
    if not isinstance(turns, list) or not turns:
        raise RowError("malformed_turn", "the conversation is not a non-empty list")
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RowError("malformed_turn", f"turn is a {type(turn).__name__}")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise RowError("unknown_role", repr(role)[:40])
        if isinstance(content, list):  # OpenAI content parts: keep text, reject anything else
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise RowError("non_text_content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RowError("malformed_turn", f"content is {type(content).__name__}")
        out.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    if not any(t["role"] == "assistant" for t in out):
        raise RowError("no_assistant_turn")
    return out


def render_text(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # jinja raises TemplateError, ValueError, TypeError...: all "this row does not render"
        raise RowError("chat_template_error", str(err)[:200]) from None


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = render_text(tokenizer, messages, generation_prompt)
    # The template already holds every special token it wants (BOS included).
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int], bool]:
    """Token ids of the whole rendered conversation and a mask that is 1 exactly on assistant turns' tokens.

    Each assistant turn j is bounded by the renders of messages[:j] with the generation prompt (its start) and of
    messages[:j+1] (its end); the whole render must extend each of those, or the template rewrites history and no
    single-row mask is right (counted as `template_rewrites_history`).
    """
    full = _render(tokenizer, messages, generation_prompt=False)
    mask = [0] * len(full)
    for j, turn in enumerate(messages):
        # An opening assistant turn has no prompt to bound it: context only (as speculators does).
        if turn["role"] != "assistant" or j == 0:
            continue
        prompt = _render(tokenizer, messages[:j], generation_prompt=True)
        upto = _render(tokenizer, messages[: j + 1], generation_prompt=False)
        if full[: len(upto)] != upto:
            raise RowError("template_rewrites_history", f"assistant turn {j}")
        # Where the prompt's last token merges with the turn's first (BPE across the boundary), start at the merge.
        start = next((i for i, (a, b) in enumerate(zip(prompt, upto)) if a != b), min(len(prompt), len(upto)))
        for i in range(start, len(upto)):
            mask[i] = 1
    truncated = len(full) > max_length
    full, mask = full[:max_length], mask[:max_length]
    if not any(mask):
        raise RowError("no_assistant_tokens_within_max_length" if truncated else "empty_assistant_turns")
    return full, mask, truncated


# ---------------------------------------------------------------------------------------------------------------
# The stage


@dataclass
class Shard:
    index: int
    start: int
    stop: int
    fingerprint: str
    num_tokens: int
    # Where the shard's conversations start in `conversations.jsonl` (bytes) and their fingerprint: what the
    # regenerate stage reads and keys on. None in shard plans made from token ids alone (extraction's).
    conversations_offset: int | None = None
    conversations: str | None = None

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


@dataclass
class PrepareStats:
    rows_read: int = 0
    rows_used: int = 0
    rows_eval: int = 0
    truncated: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    dropped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def drop(self, err: RowError, row_no: int) -> None:
        self.dropped[err.reason] += 1
        self.examples.setdefault(err.reason, f"row {row_no}: {err}")

    def as_dict(self) -> dict:
        return {
            "rows_read": self.rows_read,
            "rows_used": self.rows_used,
            "rows_eval": self.rows_eval,
            "truncated": self.truncated,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "dropped": dict(sorted(self.dropped.items())),
            "examples": self.examples,
        }


def is_eval(messages: list[dict], fraction: float) -> bool:
    """Held out by a hash of the prompt evaluation would send (the conversation before its first answer), never of
    the whole conversation: a prompt answered twice in the data, edited in a later snapshot or regenerated by the
    target stays on its side of the split with every answer, so no held-out prompt is ever trained on."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:first]]
    h = int(hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def plan_shards(input_ids: list[list[int]], shard_size: int, conversations: list[bytes] | None = None) -> list[Shard]:
    """Shards of `shard_size` rows with a content fingerprint each; with `conversations` (the rows' lines of
    conversations.jsonl), also where each shard's conversations start in that file and their fingerprint."""
    shards = []
    offset = 0
    for i, start in enumerate(range(0, len(input_ids), shard_size)):
        rows = input_ids[start : start + shard_size]
        shard = Shard(i, start, start + len(rows), sha256_json(rows)[:16], sum(map(len, rows)))
        if conversations is not None:
            lines = conversations[start : start + shard_size]
            shard.conversations_offset = offset
            shard.conversations = sha256_json([json.loads(line)["messages"] for line in lines])[:16]
            offset += sum(map(len, lines))
        shards.append(shard)
    return shards


def tokenizer_fingerprint(tokenizer) -> str:
    """What the loaded tokenizer does: its chat template, size, special tokens and, with a fast backend, its whole
    serialization; without one (a slow tokenizer such as Kimi's), its vocabulary. Its files enter the keys too
    (`eyrie.run.identity.FILE_KINDS["tokenizer"]`): a slow tokenizer's merges live only there."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return sha256_json(
        [
            tokenizer.chat_template,
            len(tokenizer),
            tokenizer.eos_token,
            getattr(tokenizer, "special_tokens_map", None),
            hashlib.sha256(backend.to_str().encode()).hexdigest()
            if backend is not None
            else sha256_json(sorted(tokenizer.get_vocab().items())),
        ]
    )


def prepare_key(target: TargetConfig, data: DataConfig, memo: Path | None = None) -> str:
    """The identity of prepare's output (`eyrie.run.identity.STAGES["prepare"]`): what is read, how it is
    tokenized, how it is cut.

    With `memo` (a JSON file in the run folder), the two fingerprints that cost seconds are remembered there under
    what determines them, and reused while that is unchanged: the source's (local files: each one's path, size,
    mtime, ctime and inode; a hub dataset is not remembered, its fingerprint is a commit lookup) and the tokenizer's
    (loading it imports transformers: the target's tokenizer and target files by content, the revision,
    `trust_remote_code`, the installed tokenizer libraries and the code of `tokenizer_fingerprint`). The key is the
    same with or without it."""
    from eyrie.config import PipelineConfig
    from eyrie.target.metadata import stage_key as keyed

    config = PipelineConfig.model_construct(target=target, data=data)
    remembered = _read_memo(memo)
    source_id = _source_memo_id(data)
    source = remembered.get("source", {}).get(source_id) if source_id else None
    if source is None:
        source = source_fingerprint(data)
    tokenizer_id = _tokenizer_memo_id(target)
    tokenizer = remembered.get("tokenizer", {}).get(tokenizer_id)
    if tokenizer is None:
        tokenizer = tokenizer_fingerprint(load_tokenizer(target))
    if memo is not None:
        fresh = {"tokenizer": {tokenizer_id: tokenizer}, **({"source": {source_id: source}} if source_id else {})}
        if fresh != {k: remembered.get(k) for k in fresh}:
            try:
                atomic_write_json(memo, fresh)
            except OSError:
                pass  # a read-only run folder: the fingerprints are computed again next time, nothing else changes
    return keyed("prepare", config, source=source, tokenizer=tokenizer)


def _read_memo(memo: Path | None) -> dict:
    if memo is None:
        return {}
    try:
        value = read_json(memo)
    except (OSError, ValueError):
        return {}  # missing or damaged: computed again (and rewritten)
    return value if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()) else {}


def _source_memo_id(data: DataConfig) -> str | None:
    """What a local source's fingerprint is remembered under: each file's resolved path and stat (size, mtime,
    ctime, inode: a rewrite in place changes mtime and ctime, a replacement the inode)."""
    if is_hub_source(data):
        return None
    path = _local_source(data)
    stats = []
    for f in _local_files(path):
        st = f.stat()
        stats.append((str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return sha256_json(["source", str(path.resolve()), stats])


def _tokenizer_memo_id(target: TargetConfig) -> str:
    """What the tokenizer's fingerprint is remembered under: everything `load_tokenizer` and
    `tokenizer_fingerprint` depend on."""
    import inspect

    from eyrie.run.identity import installed_version
    from eyrie.target import metadata

    libraries = ("transformers", "tokenizers", "sentencepiece", "tiktoken", "protobuf")
    return sha256_json(
        [
            "tokenizer",
            target.model,
            target.revision,
            target.trust_remote_code,
            metadata.file_identity("tokenizer", target),
            metadata.file_identity("target", target),  # config.json names the tokenizer class; remote code lives here
            [installed_version(d) for d in libraries],
            inspect.getsource(tokenizer_fingerprint),
            inspect.getsource(metadata.load_tokenizer),
        ]
    )


def prepare(target: TargetConfig, data: DataConfig, out_dir: Path, key: str | None = None) -> dict:
    """Run the stage into `out_dir` (replaced atomically); returns its manifest. Reuses a finished one with `key`."""
    key = key or prepare_key(target, data)
    if manifest := finished_manifest(out_dir / "manifest.json", key):
        return manifest

    tokenizer = load_tokenizer(target)
    stats = PrepareStats()
    ids, masks, eval_rows, lines = [], [], [], []
    freq: Counter = Counter()
    for n, row in enumerate(iter_rows(data)):
        if data.max_samples is not None and stats.rows_used >= data.max_samples:
            break
        stats.rows_read += 1
        try:
            messages = normalize(row)
            if is_eval(messages, data.eval_fraction):
                eval_rows.append(messages)
                stats.rows_eval += 1
                continue
            row_ids, row_mask, truncated = tokenize_conversation(tokenizer, messages, data.max_length)
        except RowError as err:
            stats.drop(err, n)
            continue
        ids.append(row_ids)
        masks.append(row_mask)
        lines.append((json.dumps({"messages": messages}, ensure_ascii=False) + "\n").encode())
        stats.rows_used += 1
        stats.truncated += truncated
        stats.tokens += len(row_ids)
        stats.loss_tokens += sum(row_mask)
        freq.update(t for t, m in zip(row_ids, row_mask) if m)
    if not ids:
        reasons = ", ".join(f"{k}: {v}" for k, v in stats.dropped.most_common()) or "the source is empty"
        examples = "; ".join(stats.examples.values())
        raise DataError(
            f"no usable conversations in {data.source} ({stats.rows_read} rows read; {reasons}). "
            f"Examples: {examples}. Rows need `messages` (role/content) or `conversations` "
            "(from/value) with at least one assistant turn."
        )

    for stale in out_dir.parent.glob(out_dir.name + ".staging-*"):  # left by a run killed mid-stage
        shutil.rmtree(stale, ignore_errors=True)
    staging = out_dir.with_name(out_dir.name + f".staging-{os.getpid()}")
    _save_dataset(staging / "dataset", ids, masks)
    import torch

    torch.save(dict(freq), staging / "dataset" / "token_freq.pt")
    shards = plan_shards(ids, data.shard_size, lines)
    atomic_write_json(staging / "shards.json", [s.__dict__ for s in shards])
    # The train conversations as read, row-aligned with the dataset: what the regenerate stage answers again.
    (staging / "conversations.jsonl").write_bytes(b"".join(lines))
    (staging / "eval_prompts.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in eval_rows))
    atomic_write_json(staging / "stats.json", stats.as_dict())
    manifest = {
        "stage": "prepare",
        "key": key,
        "num_samples": len(ids),
        "num_shards": len(shards),
        "vocab_size": len(tokenizer),
        "stats": stats.as_dict(),
        "files": list_files(staging, files_under(staging)),
    }
    atomic_write_json(staging / "manifest.json", manifest)
    fault_point("prepare.before-publish")
    replace_dir(staging, out_dir)
    return manifest


def _save_dataset(path: Path, ids: list[list[int]], masks: list[list[int]]) -> None:
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": [len(r) for r in ids]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(path))


def load_shards(prepare_dir: Path) -> list[Shard]:
    return [Shard(**s) for s in read_json(prepare_dir / "shards.json") or []]


def load_dataset_rows(prepare_dir: Path, start: int, stop: int) -> list[list[int]]:
    from datasets import load_from_disk

    ds = load_from_disk(str(prepare_dir / "dataset")).with_format(None)
    return ds.select(range(start, stop))["input_ids"]


def load_seq_lens(prepare_dir: Path) -> list[int]:
    from datasets import load_from_disk

    return list(load_from_disk(str(prepare_dir / "dataset")).with_format(None)["seq_len"])


def iter_eval_prompts(prepare_dir: Path) -> Iterable[list[dict]]:
    """Held-out conversations cut before their first assistant turn: the prompts evaluation sends."""
    for line in (prepare_dir / "eval_prompts.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        yield messages[:first]
