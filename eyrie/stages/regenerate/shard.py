"""One shard regenerated: its conversations sent, its rows and manifest written."""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eyrie.config import RegenerateConfig
from eyrie.errors import RegenerationError, RequestRejected, ServerUnavailable
from eyrie.run.faults import fault_point
from eyrie.run.files import atomic_write_bytes, atomic_write_json, read_json, sha256_json
from eyrie.stages.prepare.plan import Shard
from eyrie.stages.prepare.rows import RowError, RowStats
from eyrie.stages.regenerate.conversation import (
    DEFAULT_VARIANT,
    Generation,
    Regenerated,
    TurnPlan,
    conversation_fingerprint,
    conversation_temperature,
    conversation_variant,
    plan_turns,
    regenerate_conversation,
    request_seed,
)
from eyrie.stages.regenerate.window import shared_window

STAGE = "regenerate"
# Requests past which a shard with this share of its rows failed by server errors fails itself: a systemic problem
# (a wrong server, a broken engine) must not pass as a shard of mostly dropped rows.
MAX_SERVER_ERROR_SHARE = 0.5
# Reasons a row is lost to the server rather than to itself (its template, its length): such rows are retried by the
# next run, whose manifest then vouches for the shard whole.
SERVER_LOSSES = ("server_error",)


def shard_paths(stage_dir: Path, shard: Shard) -> tuple[Path, Path]:
    """The shard's rows (parquet) and its manifest, written last."""
    return stage_dir / "shards" / f"{shard.name}.parquet", stage_dir / "shards" / f"{shard.name}.json"


def shard_complete(stage_dir: Path, shard: Shard, key: str) -> bool:
    """The manifest records `key` and its rows file is there, of the recorded size (assembly checks its sha256 as it
    reads it)."""
    rows_path, manifest_path = shard_paths(stage_dir, shard)
    m = read_json(manifest_path)
    if not m or m.get("key") != key:
        return False
    try:
        return rows_path.stat().st_size == m["bytes"]
    except OSError:
        return False


def lost_rows(manifest: dict) -> list[int] | None:
    """The rows a shard's manifest records as lost to server errors, which the next run retries; None when it counts
    such losses but names no rows (a manifest written before they were named): the whole shard is redone then."""
    if "server_error_rows" in manifest:
        return list(manifest["server_error_rows"])
    lost = sum(manifest.get("stats", {}).get("failed", {}).get(r, 0) for r in SERVER_LOSSES)
    return None if lost else []


def has_losses(stage_dir: Path, shard: Shard) -> bool:
    """The shard's manifest records rows lost to server errors (`lost_rows`): it is pending for the next run."""
    m = read_json(shard_paths(stage_dir, shard)[1])
    if not m:
        return False
    return lost_rows(m) != []


def load_conversations(prepare_dir: Path, shard: Shard) -> list[list[dict]]:
    """The shard's conversations from prepare's `conversations.jsonl` (row-aligned with its dataset)."""
    path = prepare_dir / "conversations.jsonl"
    if shard.conversations_offset is None or not path.is_file():
        raise RegenerationError(
            f"{prepare_dir} holds no conversations.jsonl with per-shard offsets (prepared by an older Eyrie): "
            "delete its manifest.json and run again, so prepare writes them"
        )
    rows = []
    with open(path, "rb") as f:
        f.seek(shard.conversations_offset)
        for _ in range(shard.stop - shard.start):
            rows.append(json.loads(f.readline())["messages"])
    if conversations_digest(rows) != shard.conversations:
        raise RegenerationError(
            f"{path}: the rows of {shard.name} differ from what prepare recorded in shards.json: the file was "
            "changed; delete prepare/manifest.json and run again"
        )
    return rows


def conversations_digest(rows: list[list[dict]]) -> str:
    return sha256_json(rows)[:16]


@dataclass
class ShardStats(RowStats):
    rows_in: int = 0
    rows_out: int = 0
    turns: int = 0
    generated_tokens: int = 0
    length_capped: int = 0
    dropped_history_text: int = 0
    requests: int = 0
    failed: Counter = field(default_factory=Counter)
    temperatures: Counter = field(default_factory=Counter)
    template_variants: Counter = field(default_factory=Counter)

    @classmethod
    def resumed(cls, recorded: dict, retried: int) -> ShardStats:
        """A shard's recorded stats, less the `retried` rows lost to server errors that are about to be sent again
        (their outcome is counted as they come back); the rows kept stay counted."""
        stats = cls(**{k: v for k, v in recorded.items() if k not in _COUNTERS})
        stats.failed = Counter(recorded["failed"])
        stats.examples = dict(recorded["examples"])
        stats.temperatures = Counter({float(k): v for k, v in recorded["temperatures"].items()})
        stats.template_variants = Counter(recorded.get("template_variants", {}))
        for reason in SERVER_LOSSES:
            n = min(retried, stats.failed[reason])
            stats.failed[reason] -= n
            retried -= n
            if not stats.failed[reason]:
                del stats.failed[reason]
                stats.examples.pop(reason, None)
        return stats

    def fail(self, reason: str, row: int, detail: str) -> None:
        self.refuse(self.failed, reason, f"row {row}: {detail}"[:300])

    def as_dict(self) -> dict:
        return {
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "turns": self.turns,
            "generated_tokens": self.generated_tokens,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "length_capped": self.length_capped,
            "truncated": self.truncated,
            "dropped_history_text": self.dropped_history_text,
            "requests": self.requests,
            "failed": dict(sorted(self.failed.items())),
            "examples": dict(sorted(self.examples.items())),
            "temperatures": {str(k): v for k, v in sorted(self.temperatures.items())},
            "template_variants": dict(sorted(self.template_variants.items())),
        }


_COUNTERS = ("failed", "examples", "temperatures", "template_variants")


def rejection_reason(err: RequestRejected) -> str:
    text = err.text.lower()
    if err.status == 400 and ("maximum context length" in text or "max_model_len" in text or "too long" in text):
        return "prompt_too_long"
    return "server_error" if err.status >= 500 else "request_rejected"


def regenerate_shard(
    client,
    tokenizer,
    prepare_dir: Path,
    stage_dir: Path,
    shard: Shard,
    key: str,
    cfg: RegenerateConfig,
    max_length: int,
    progress: Callable[[int, int], None] | None = None,
    variants: dict[str, dict] | None = None,
) -> dict:
    """Regenerate every conversation of `shard` and write its rows and manifest; returns the manifest. A row that
    cannot be regenerated is counted by reason; a server that stops answering fails the shard (nothing written).

    Rows lost to server errors are named in the manifest (`server_error_rows`): the shard is complete but pending
    (`has_losses`), and the next call with a client sends only those rows again, keeping the rows it has (their
    seeds are per conversation and turn, so the shard ends as it would have without the errors). With no client a
    complete shard's manifest is returned as it is.

    `variants`: `regenerate.template_mix`'s variants by name, each its `chat_template_kwargs` (`template_mix`):
    each conversation is rendered with the one `conversation_variant` draws, and its row records the name."""
    switches = _variant_switches(cfg, variants)
    rows_path, manifest_path = shard_paths(stage_dir, shard)
    prior: tuple[dict, bytes] | None = None
    if shard_complete(stage_dir, shard, key):
        recorded = read_json(manifest_path) or {}
        retry = lost_rows(recorded)
        if retry == [] or client is None:
            return recorded
        data = rows_path.read_bytes()
        if retry is not None and hashlib.sha256(data).hexdigest() == recorded["sha256"]:
            prior = (recorded, data)
    fault_point(f"regenerate.{shard.name}")
    if prior is None:
        manifest_path.unlink(missing_ok=True)  # a stale manifest must not vouch for the rows about to be replaced
    conversations = load_conversations(prepare_dir, shard)
    if prior is None:
        offsets = list(range(len(conversations)))
        stats = ShardStats(rows_in=len(conversations))
    else:
        offsets = [row - shard.start for row in lost_rows(prior[0]) or []]
        stats = ShardStats.resumed(prior[0]["stats"], len(offsets))
    t0 = time.perf_counter()
    done = [0]

    # The template's pieces first, in this thread: a fast tokenizer used from several threads at once can fail
    # ("Already borrowed"), and rendering costs little beside generation.
    plans: dict[int, TurnPlan | RowError] = {}
    chosen: dict[int, str] = {}
    for offset in offsets:
        chosen[offset] = conversation_variant(cfg, conversation_fingerprint(conversations[offset]))
        try:
            plans[offset] = plan_turns(tokenizer, conversations[offset], switches[chosen[offset]])
        except RowError as err:
            plans[offset] = err

    async def one(offset: int) -> tuple[int, Regenerated | RowError, float, str, int]:
        """A conversation's row, or the RowError that names why it has none; its temperature and template variant;
        requests sent."""
        fp = conversation_fingerprint(conversations[offset])
        temperature = conversation_temperature(cfg, fp)
        plan = plans[offset]
        sent = [0]

        async def generate(prompt: list[int], max_tokens: int, turn: int) -> Generation:
            seed = request_seed(cfg, fp, turn) if temperature > 0 else None
            if share.gone.is_set():  # the shard fails anyway: do not wait out every other conversation's retries
                raise ServerUnavailable(f"{shard.name}: abandoned, the server stopped answering")
            sent[0] += 1
            try:
                out = await share.generate(
                    prompt, max_tokens, temperature, cfg.top_p, seed, cfg.request_timeout_s, retries=cfg.retries
                )
            except ServerUnavailable:
                share.abandon()  # this shard's other conversations send nothing more
                raise
            return Generation(out["token_ids"], out["finish_reason"])

        result: Regenerated | RowError
        if isinstance(plan, RowError):
            result = plan
        else:
            try:
                result = await regenerate_conversation(plan, generate, max_length, cfg.max_tokens)
                result.dropped_history_text = plan.dropped_history_text
            except RowError as err:
                result = err
            except RequestRejected as err:
                result = RowError(rejection_reason(err), str(err))
        done[0] += 1  # on the window's loop: one conversation at a time gets here
        if progress:
            progress(done[0], len(offsets))
        return shard.start + offset, result, temperature, chosen[offset], sent[0]

    # The requests go through the slots this shard shares with the shards regenerating from the same server at the
    # same time (`window`): its own `concurrency` while it runs, its rows' writing included, and any the others leave
    # idle, so a shard's last conversations and its writing overlap the next shard's requests.
    with shared_window(client, cfg.concurrency) as share:
        results = share.run([(offset, functools.partial(one, offset)) for offset in offsets])
        kept = _read_rows(prior[1]) if prior else []
        server_error_rows = []
        for row, result, temperature, variant, sent in results:
            stats.requests += sent
            if isinstance(result, RowError):
                stats.fail(result.reason, row, str(result))
                if result.reason in SERVER_LOSSES:
                    server_error_rows.append(row)
                continue
            kept.append((row, result, temperature, variant))
            stats.rows_out += 1
            stats.turns += result.turns
            stats.generated_tokens += result.generated_tokens
            stats.keep(result.input_ids, result.loss_mask, result.truncated)
            stats.length_capped += result.length_capped
            stats.dropped_history_text += result.dropped_history_text
            stats.temperatures[temperature] += 1
            stats.template_variants[variant] += 1
        if stats.failed["server_error"] > MAX_SERVER_ERROR_SHARE * max(1, len(conversations)):
            raise RegenerationError(
                f"{shard.name}: {stats.failed['server_error']} of {len(conversations)} conversations failed with "
                f"server errors ({stats.examples.get('server_error')}): see the server log; the shard is not marked "
                "done"
            )
        kept.sort(key=lambda k: k[0])
        data = _rows_parquet(kept)
        rows_path.parent.mkdir(parents=True, exist_ok=True)
        manifest_path.unlink(missing_ok=True)  # the rows it vouched for are about to be replaced (a retry's)
        atomic_write_bytes(rows_path, data)
        # Rows on disk, manifest not yet: a kill here leaves a whole rows file that nothing vouches for (the drill
        # that proves a rerun redoes the shard rather than trusting it).
        fault_point(f"regenerate.{shard.name}.rows-written")
        seconds = time.perf_counter() - t0
        manifest = {
            "stage": STAGE,
            "shard": shard.name,
            "key": key,
            "rows": [shard.start, shard.stop],
            "file": rows_path.name,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "stats": stats.as_dict(),
            "server_error_rows": sorted(server_error_rows),
            "seconds": round(seconds, 3),
            "generated_tokens_per_s": round(stats.generated_tokens / seconds, 1) if seconds > 0 else None,
        }
        atomic_write_json(manifest_path, manifest)
        return manifest


def _variant_switches(cfg: RegenerateConfig, variants: dict[str, dict] | None) -> dict[str, dict | None]:
    """Each variant `template_mix` may draw, with the switches it renders with (`default`: none)."""
    out: dict[str, dict | None] = {DEFAULT_VARIANT: None}
    for share in cfg.template_mix or []:
        if share.variant == DEFAULT_VARIANT:
            continue
        if not variants or share.variant not in variants:
            raise RegenerationError(
                f"regenerate.template_mix draws {share.variant!r} but the shard was given no chat_template_kwargs "
                f"for it (given: {sorted(variants or {})}): pass `template_mix(regenerate, evaluate)` as `variants`"
            )
        out[share.variant] = dict(variants[share.variant])
    return out


ROW_COLUMNS = ("row", "input_ids", "loss_mask", "length_capped", "truncated", "temperature", "template_variant")


def _read_rows(data: bytes) -> list[tuple[int, Regenerated, float, str]]:
    """A shard's rows file as `_rows_parquet` wrote it (what a retry keeps; turn and token counts stay in the
    recorded stats)."""
    import io

    import pyarrow.parquet as pq

    t = pq.read_table(io.BytesIO(data)).to_pydict()
    t.setdefault("template_variant", [DEFAULT_VARIANT] * len(t["row"]))  # written before template mixes
    return [
        (row, Regenerated(ids, mask, 0, 0, capped, truncated), temperature, variant)
        for row, ids, mask, capped, truncated, temperature, variant in zip(*(t[c] for c in ROW_COLUMNS))
    ]


def _rows_parquet(kept: list[tuple[int, Regenerated, float, str]]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "row": pa.array([k[0] for k in kept], pa.int64()),
            "input_ids": pa.array([k[1].input_ids for k in kept], pa.list_(pa.int64())),
            "loss_mask": pa.array([k[1].loss_mask for k in kept], pa.list_(pa.int64())),
            "length_capped": pa.array([k[1].length_capped for k in kept], pa.bool_()),
            "truncated": pa.array([k[1].truncated for k in kept], pa.bool_()),
            "temperature": pa.array([k[2] for k in kept], pa.float64()),
            "template_variant": pa.array([k[3] for k in kept], pa.string()),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()
