"""regenerate: the target rewrites every assistant turn of the prepared conversations (on-policy data).

Turn by turn, the user (and system, tool) turns kept: each turn's prompt is built as token ids, the chat template's
render of the conversation so far in which every earlier assistant turn is the target's own answer, as the ids the
server produced. The prompt goes to vLLM's /v1/completions as ids; the ids it returns are appended verbatim, so
extraction and training see exactly the tokens the target generated, never a decode and re-tokenization of them.
The loss mask covers exactly those generated ids, the end-of-turn token included when the target emitted it; the
template's text around a turn (the newline after `<|im_end|>`, the next user turn, the next generation prompt) is
context.

The template's pieces come from renders of a skeleton conversation whose regenerated answers are sentinels: the
text between one answer and the next generation prompt is what follows that answer's sentinel. Where the template
writes a turn's header in history otherwise than in its generation prompt (a `<think></think>` placeholder), the
row keeps what was sent and generated (see `plan_turns`). A template that rewrites earlier turns once later ones
exist cannot give one row its ids (`template_rewrites_history`).

The stage runs on the extraction server (one target load for both stages, see README): its requests carry Eyrie's
per-request switch that keeps the hidden-states connector from writing a file for them, and a cache salt, so
extraction's prefix cache never serves blocks a regeneration request computed.

Output (prepare's format, so extraction, vocab and train read it through the same functions): `dataset/`
(input_ids, loss_mask, seq_len) with `dataset/token_freq.pt`, `shards.json` (one output shard per prepared shard,
its rows those that regenerated), `stats.json`, `manifest.json`; per shard `shards/shard-*.parquet` and its manifest
`shards/shard-*.json` written last. Held-out evaluation conversations are prepare's and never reach this stage.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyrie.config import PipelineConfig, RegenerateConfig
from eyrie.errors import RegenerationError, RequestRejected, ServerUnavailable
from eyrie.run.faults import fault_point
from eyrie.run.folder import RunFolder, atomic_write_bytes, atomic_write_json, read_json, sha256_json
from eyrie.run.manifest import files_under, finished_manifest, list_files
from eyrie.stages.prepare import RowError, Shard, load_shards, render_text, tokenizer_fingerprint

STAGE = "regenerate"
# Requests past which a shard with this share of its rows failed by server errors fails itself: a systemic problem
# (a wrong server, a broken engine) must not pass as a shard of mostly dropped rows.
MAX_SERVER_ERROR_SHARE = 0.5


# ---------------------------------------------------------------------------------------------------------------
# One conversation: the template's pieces, the sampling, the turn-by-turn loop


@dataclass
class TurnPlan:
    """`pieces[0]`: the ids up to the first regenerated answer (ending with its generation prompt); `pieces[k]`:
    the template's ids after answer k up to answer k+1's generation prompt (or the conversation's end, for the
    last). `turns`: the message index of each regenerated answer."""

    turns: list[int]
    pieces: list[list[int]]
    dropped_history_text: int = 0  # turns whose template text before the answer (e.g. `<think></think>`) is dropped


def _sentinels(messages: list[dict], n: int) -> list[str]:
    """Markers no message contains and no template alters (letters and digits only)."""
    text = "".join(m["content"] for m in messages)
    salt = 0
    while True:
        marks = [f"EyrieAnswer{salt}x{k}Q" for k in range(n)]
        if not any(m in text for m in marks):
            return marks
        salt += 1


def plan_turns(tokenizer, messages: list[dict]) -> TurnPlan:
    """The pieces of the chat template around each assistant turn to regenerate (every one but an opening one,
    which has no prompt: context, as prepare keeps it). Raises RowError when the template does not allow it.

    Turn k's prompt is the template's render up to it with the generation prompt. After answer k, the row goes on
    with what the next render puts after answer k's sentinel. That render must keep everything before answer k's own
    turn as it was (the history); how it writes the turn's header in history may differ from the generation prompt
    (a `<think></think>` placeholder, a thinking prompt left out): the row keeps what was sent and generated, and
    `dropped_history_text` counts such turns."""
    turns = [j for j, m in enumerate(messages) if m["role"] == "assistant" and j > 0]
    if not turns:
        raise RowError("empty_assistant_turns", "no assistant turn after a prompt")
    marks = _sentinels(messages, len(turns))
    skeleton = [dict(m) for m in messages]
    for j, mark in zip(turns, marks):
        skeleton[j]["content"] = mark
    prompts = [render_text(tokenizer, skeleton[:j], True) for j in turns]
    histories = [render_text(tokenizer, skeleton[:j], False) for j in turns]
    nexts = prompts[1:] + [render_text(tokenizer, skeleton, False)]  # what follows each answer, in a later render
    texts, dropped = [prompts[0]], 0
    for k, (prompt, history, later, mark) in enumerate(zip(prompts, histories, nexts, marks)):
        at = later.find(mark)
        if not later.startswith(history) or later.count(mark) != 1 or at < len(history):
            raise RowError("template_rewrites_history", f"assistant turn {turns[k]}")
        dropped += later[len(history) : at] != prompt[len(history) :]
        texts.append(later[at + len(mark) :])
    pieces = [tokenizer(t, add_special_tokens=False)["input_ids"] if t else [] for t in texts]
    return TurnPlan(turns, pieces, dropped)


def overlap(generated: list[int], piece: list[int]) -> int:
    """How many ids at the start of `piece` the generation already ends with (the end-of-turn token the target
    emitted, which the template would write again)."""
    for k in range(min(len(generated), len(piece)), 0, -1):
        if generated[-k:] == piece[:k]:
            return k
    return 0


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" (an end token) or "length" (the token budget)


@dataclass
class Regenerated:
    input_ids: list[int]
    loss_mask: list[int]
    turns: int  # answers regenerated
    generated_tokens: int
    length_capped: bool  # an answer hit regenerate.max_tokens: the row ends with it
    truncated: bool  # the row reached data.max_length
    dropped_history_text: int = 0  # see TurnPlan


def regenerate_conversation(
    plan: TurnPlan, generate: Callable[[list[int], int, int], Generation], max_length: int, max_tokens: int
) -> Regenerated:
    """Build the row turn by turn: `generate(prompt_ids, max_tokens, turn)` answers each prompt; its ids are
    appended verbatim and masked, then the template's piece up to the next prompt (less what the answer already
    ends with). An answer cut by `max_tokens` ends the row (`length_capped`); so does `max_length` (`truncated`)."""
    ids = list(plan.pieces[0])
    mask = [0] * len(ids)
    capped = truncated = False
    done = generated = 0
    for k in range(len(plan.turns)):
        room = max_length - len(ids)
        if room <= 0:
            truncated = True
            break
        budget = min(max_tokens, room)
        out = generate(ids, budget, k)
        ids += out.token_ids
        mask += [1] * len(out.token_ids)
        done += 1
        generated += len(out.token_ids)
        if out.finish_reason != "stop":
            capped = budget == max_tokens
            truncated = len(ids) >= max_length
            break
        piece = plan.pieces[k + 1][overlap(out.token_ids, plan.pieces[k + 1]) :]
        ids += piece
        mask += [0] * len(piece)
    if len(ids) > max_length:
        ids, mask, truncated = ids[:max_length], mask[:max_length], True
    if not any(mask):
        raise RowError("empty_assistant_turns", "no generated token within data.max_length")
    return Regenerated(ids, mask, done, generated, capped, truncated)


_TOKENIZERS: dict[str, Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def shared_tokenizer(target):
    """The target's tokenizer, loaded once per process (shard tasks run in threads; some tokenizers load slowly)."""
    from eyrie.target.metadata import load_tokenizer

    name = target.model_dump_json()
    with _TOKENIZERS_LOCK:
        if name not in _TOKENIZERS:
            _TOKENIZERS[name] = load_tokenizer(target)
        return _TOKENIZERS[name]


def conversation_fingerprint(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def conversation_temperature(cfg: RegenerateConfig, fingerprint: str) -> float:
    """The conversation's temperature: `temperature`, or one of `temperature_mix` drawn by weight from a hash of
    the seed and the conversation (the same conversation gets the same one on every run)."""
    if not cfg.temperature_mix:
        return cfg.temperature
    u = int(hashlib.sha256(f"{cfg.seed}:{fingerprint}".encode()).hexdigest()[:13], 16) / 16**13
    total = sum(t.weight for t in cfg.temperature_mix)
    acc = 0.0
    for t in cfg.temperature_mix:
        acc += t.weight / total
        if u < acc:
            return t.temperature
    return cfg.temperature_mix[-1].temperature


def request_seed(cfg: RegenerateConfig, fingerprint: str, turn: int) -> int:
    """vLLM's per-request sampling seed: sampling at a temperature above 0 repeats on a re-run."""
    return int(hashlib.sha256(f"{cfg.seed}:{fingerprint}:{turn}".encode()).hexdigest()[:15], 16)


# ---------------------------------------------------------------------------------------------------------------
# Keys


def shard_key(template: str, shard: Shard, config: PipelineConfig) -> str:
    """A regenerated shard's identity (`eyrie.run.identity.STAGES["regenerate.shard"]`): the prepared shard's
    content (ids and conversations), the target (weights, tokenizer and generation config files, dtype,
    output-shaping server arguments), its template, the sampling and the length cap of a row."""
    from eyrie.target.metadata import stage_key as keyed

    return keyed(
        "regenerate.shard",
        config,
        shard={
            "ids": shard.fingerprint,
            "conversations": shard.conversations,
            "rows": [shard.start, shard.stop],
        },
        template=template,
    )


def stage_key(shard_keys: dict[str, str], config: PipelineConfig) -> str:
    """The assembled output's identity: its shards' keys and what assembly keeps."""
    from eyrie.target.metadata import stage_key as keyed

    return keyed("regenerate", config, shards=shard_keys)


# ---------------------------------------------------------------------------------------------------------------
# One shard


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
class ShardStats:
    rows_in: int = 0
    rows_out: int = 0
    turns: int = 0
    generated_tokens: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    length_capped: int = 0
    truncated: int = 0
    dropped_history_text: int = 0
    requests: int = 0
    failed: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    temperatures: Counter = field(default_factory=Counter)

    def fail(self, reason: str, row: int, detail: str) -> None:
        self.failed[reason] += 1
        self.examples.setdefault(reason, f"row {row}: {detail}"[:300])

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
        }


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
) -> dict:
    """Regenerate every conversation of `shard` and write its rows and manifest; returns the manifest. A row that
    cannot be regenerated is counted by reason; a server that stops answering fails the shard (nothing written)."""
    rows_path, manifest_path = shard_paths(stage_dir, shard)
    if shard_complete(stage_dir, shard, key):
        return read_json(manifest_path) or {}
    fault_point(f"regenerate.{shard.name}")
    manifest_path.unlink(missing_ok=True)  # a stale manifest must not vouch for the rows about to be replaced
    conversations = load_conversations(prepare_dir, shard)
    stats = ShardStats(rows_in=len(conversations))
    t0 = time.perf_counter()
    done = [0]
    lock = threading.Lock()
    gone = threading.Event()

    # The template's pieces first, in this thread: a fast tokenizer used from several threads at once can fail
    # ("Already borrowed"), and rendering costs little beside generation.
    plans: list[TurnPlan | RowError] = []
    for messages in conversations:
        try:
            plans.append(plan_turns(tokenizer, messages))
        except RowError as err:
            plans.append(err)

    def one(offset: int) -> tuple[int, Regenerated | RowError, float, int]:
        """A conversation's row, or the RowError that names why it has none; its temperature; requests sent."""
        fp = conversation_fingerprint(conversations[offset])
        temperature = conversation_temperature(cfg, fp)
        plan = plans[offset]
        sent = [0]

        def generate(prompt: list[int], max_tokens: int, turn: int) -> Generation:
            if gone.is_set():  # the shard fails anyway: do not wait out every other conversation's retries
                raise ServerUnavailable(f"{shard.name}: abandoned, the server stopped answering")
            seed = request_seed(cfg, fp, turn) if temperature > 0 else None
            sent[0] += 1
            try:
                out = client.generate(
                    prompt, max_tokens, temperature, cfg.top_p, seed, cfg.request_timeout_s, retries=cfg.retries
                )
            except ServerUnavailable:
                gone.set()
                raise
            return Generation(out["token_ids"], out["finish_reason"])

        result: Regenerated | RowError
        if isinstance(plan, RowError):
            result = plan
        else:
            try:
                result = regenerate_conversation(plan, generate, max_length, cfg.max_tokens)
                result.dropped_history_text = plan.dropped_history_text
            except RowError as err:
                result = err
            except RequestRejected as err:
                result = RowError(rejection_reason(err), str(err))
        with lock:
            done[0] += 1
            if progress:
                progress(done[0], len(conversations))
        return shard.start + offset, result, temperature, sent[0]

    with ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix=f"eyrie-regen-{shard.name}") as pool:
        results = list(pool.map(one, range(len(conversations))))
    kept = []
    for row, result, temperature, sent in results:
        stats.requests += sent
        if isinstance(result, RowError):
            stats.fail(result.reason, row, str(result))
            continue
        kept.append((row, result, temperature))
        stats.rows_out += 1
        stats.turns += result.turns
        stats.generated_tokens += result.generated_tokens
        stats.tokens += len(result.input_ids)
        stats.loss_tokens += sum(result.loss_mask)
        stats.length_capped += result.length_capped
        stats.truncated += result.truncated
        stats.dropped_history_text += result.dropped_history_text
        stats.temperatures[temperature] += 1
    if stats.failed["server_error"] > MAX_SERVER_ERROR_SHARE * max(1, len(conversations)):
        raise RegenerationError(
            f"{shard.name}: {stats.failed['server_error']} of {len(conversations)} conversations failed with server "
            f"errors ({stats.examples.get('server_error')}): see the server log; the shard is not marked done"
        )
    data = _rows_parquet(kept)
    rows_path.parent.mkdir(parents=True, exist_ok=True)
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
        "seconds": round(seconds, 3),
        "generated_tokens_per_s": round(stats.generated_tokens / seconds, 1) if seconds > 0 else None,
    }
    atomic_write_json(manifest_path, manifest)
    return manifest


ROW_COLUMNS = ("row", "input_ids", "loss_mask", "length_capped", "truncated", "temperature")


def _rows_parquet(kept: list[tuple[int, Regenerated, float]]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "row": pa.array([row for row, _, _ in kept], pa.int64()),
            "input_ids": pa.array([r.input_ids for _, r, _ in kept], pa.list_(pa.int64())),
            "loss_mask": pa.array([r.loss_mask for _, r, _ in kept], pa.list_(pa.int64())),
            "length_capped": pa.array([r.length_capped for _, r, _ in kept], pa.bool_()),
            "truncated": pa.array([r.truncated for _, r, _ in kept], pa.bool_()),
            "temperature": pa.array([t for _, _, t in kept], pa.float64()),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# The stage: plan, assembly, and which folder extraction reads


class RegenerationPlan:
    """The shards to regenerate (prepare's), their keys, and the server: the extraction server itself, with the
    very spec extraction starts (so the target loads once for both stages)."""

    def __init__(self, config: PipelineConfig, run: RunFolder, report, node: str | None = None):
        from eyrie.stages.extract import ExtractionPlan
        from eyrie.target.metadata import load_tokenizer

        self.config = config
        self.run = run
        self.dir = run.stage(STAGE)
        self.shards = load_shards(run.prepare)
        if not self.shards:
            raise RegenerationError(f"{run.prepare / 'shards.json'} lists no shards: run the prepare stage first")
        server = ExtractionPlan(config, run, report, [], node=node)
        self.spec, self.server_dir, self.staging = server.spec, server.server_dir, server.staging
        template = tokenizer_fingerprint(load_tokenizer(config.target))
        self.keys = {s.name: shard_key(template, s, config) for s in self.shards}
        self.key = stage_key(self.keys, config)

    def is_complete(self, shard: Shard) -> bool:
        return shard_complete(self.dir, shard, self.keys[shard.name])

    def pending(self) -> list[Shard]:
        return [s for s in self.shards if not self.is_complete(s)]


def assemble(stage_dir: Path, prepare_dir: Path, shards: list[Shard], keys: dict[str, str], key: str, cfg) -> dict:
    """The regenerated shards as one dataset in prepare's format, with its token counts, shard plan and stats.
    Reuses a finished assembly with `key`. Each shard's rows file is checked against its manifest's sha256 here,
    where it is read anyway; a changed one loses its manifest, so the next run regenerates that shard."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch

    if manifest := finished_manifest(stage_dir / "manifest.json", key):
        return manifest
    tables, out_shards, start = [], [], 0
    totals: Counter = Counter()
    failed: Counter = Counter()
    temperatures: Counter = Counter()
    examples: dict = {}
    dropped_capped = 0
    for shard in shards:
        rows_path, manifest_path = shard_paths(stage_dir, shard)
        m = read_json(manifest_path)
        if not m or m.get("key") != keys[shard.name]:
            raise RegenerationError(f"{shard.name} has no finished manifest with its key: regenerate it first")
        data = rows_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != m["sha256"]:
            manifest_path.unlink(missing_ok=True)
            raise RegenerationError(
                f"{rows_path} changed since its shard finished (sha256 differs): its manifest is removed, run "
                "again to regenerate that shard"
            )
        import io

        table = pq.read_table(io.BytesIO(data))
        if cfg.length_capped == "drop":
            capped = table.column("length_capped")
            dropped_capped += pc.sum(capped).as_py() or 0
            table = table.filter(pc.invert(capped))
        n = table.num_rows
        for k, v in m["stats"].items():
            if isinstance(v, int) and not isinstance(v, bool):
                totals[k] += v
        failed.update(m["stats"]["failed"])
        temperatures.update(m["stats"].get("temperatures", {}))
        for reason, ex in m["stats"]["examples"].items():
            examples.setdefault(reason, f"{shard.name} {ex}")
        if n:
            ids = table.column("input_ids").to_pylist()
            # Named as the prepared shard it came from: a prepared shard unchanged keeps its extraction shard.
            out_shards.append(Shard(shard.index, start, start + n, sha256_json(ids)[:16], sum(map(len, ids))).__dict__)
            start += n
            tables.append(table.select(["input_ids", "loss_mask"]))
    if not tables:
        raise RegenerationError(
            f"no conversation was regenerated ({dict(failed) or 'every answer was length-capped and dropped'}); "
            f"examples: {examples}. See {stage_dir}/shards/*.json and the server log"
        )
    table = pa.concat_tables(tables)
    table = table.append_column("seq_len", pc.list_value_length(table.column("input_ids")).cast(pa.int64()))

    for stale in stage_dir.glob("dataset.staging-*"):  # left by a run killed mid-assembly
        shutil.rmtree(stale, ignore_errors=True)
    staging = stage_dir / f"dataset.staging-{os.getpid()}"
    _save_table(staging, table, prepare_dir)
    ids = pc.list_flatten(table.column("input_ids")).to_numpy()
    mask = pc.list_flatten(table.column("loss_mask")).to_numpy()
    counts = np.bincount(ids[mask == 1])
    torch.save({int(t): int(c) for t, c in enumerate(counts) if c}, staging / "token_freq.pt")
    if (stage_dir / "dataset").exists():
        shutil.rmtree(stage_dir / "dataset")
    os.replace(staging, stage_dir / "dataset")
    stats = {
        **{k: totals[k] for k in ("rows_in", "rows_out", "turns", "generated_tokens", "tokens", "loss_tokens")},
        **{k: totals[k] for k in ("length_capped", "truncated", "dropped_history_text", "requests")},
        "rows_used": table.num_rows,
        "dropped_length_capped": dropped_capped,
        "failed": dict(sorted(failed.items())),
        "examples": examples,
        "temperatures": dict(sorted(temperatures.items())),
    }
    stats["tokens"] = int(pc.sum(table.column("seq_len")).as_py())
    stats["loss_tokens"] = int(mask.sum())
    atomic_write_json(stage_dir / "shards.json", out_shards)
    atomic_write_json(stage_dir / "stats.json", stats)
    files = list_files(stage_dir, [*files_under(stage_dir / "dataset"), stage_dir / "shards.json"])
    prepare_manifest = read_json(prepare_dir / "manifest.json") or {}
    manifest = {
        "stage": STAGE,
        "key": key,
        "prepare_key": prepare_manifest.get("key"),
        "num_samples": table.num_rows,
        "num_shards": len(out_shards),
        "stats": stats,
        "files": files,
    }
    fault_point("regenerate.before-manifest")
    atomic_write_json(stage_dir / "manifest.json", manifest)
    return manifest


def _save_table(path: Path, table, prepare_dir: Path) -> None:
    """Save with `datasets` exactly as prepare saved its dataset: its column types, torch format."""
    from datasets import Dataset, load_from_disk

    ds = Dataset(table).cast(load_from_disk(str(prepare_dir / "dataset")).features)
    ds.set_format(type="torch")
    ds.save_to_disk(str(path))


SOURCE_MARKER = "source.json"  # in the extraction stage's folder: which stage's data it extracted


def extraction_source(run: RunFolder, config: PipelineConfig | None = None) -> Path:
    """The folder whose dataset and shards.json extraction, vocab and training read: `regenerate/` when the config
    enables regeneration, else `prepare/`. Without a config (status, verify), the one extraction last recorded."""
    if config is None:
        recorded = (read_json(run.extract / SOURCE_MARKER) or {}).get("stage")
        return run.stage(recorded) if recorded in (STAGE, "prepare") else run.prepare
    if not config.regenerate.enabled:
        return run.prepare
    stage_dir = run.stage(STAGE)
    m = read_json(stage_dir / "manifest.json")
    prepared = read_json(run.manifest("prepare")) or {}
    if not m or m.get("prepare_key") != prepared.get("key"):
        raise RegenerationError(
            f"regenerate.enabled is set but {stage_dir} holds no regeneration of the current prepared data: run "
            f"`eyrie run --until regenerate` on {run.root} first (or set regenerate.enabled: false)"
        )
    return stage_dir


def record_extraction_source(run: RunFolder, source: Path) -> None:
    """Written by the extraction flow before it extracts, for the readers that have no config."""
    want = {"stage": Path(source).name}
    if read_json(run.extract / SOURCE_MARKER) != want:
        atomic_write_json(run.extract / SOURCE_MARKER, want)


def stage_status(run: RunFolder) -> str:
    """`eyrie status`'s line for the stage: done, or how many shards are."""
    stage_dir = run.stage(STAGE)
    if read_json(stage_dir / "manifest.json"):
        return "done"
    shards = load_shards(run.prepare)
    done = sum(1 for s in shards if read_json(shard_paths(stage_dir, s)[1]))
    return f"{done}/{len(shards)} shards" if done else "not started"
