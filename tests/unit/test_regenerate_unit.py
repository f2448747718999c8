"""regenerate's logic without a server (the real one is in test_regenerate.py): the template's pieces around each
answer with a real tiny tokenizer, rows built from the generated ids verbatim with a mask on exactly those, the
length cap and max_length, failures counted by reason (and a dead server failing the shard instead), keys,
the temperature mix, assembly into prepare's format, and the client's request and error mapping."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import DEMO_DATA, build_tiny_target

from eyrie.config import PipelineConfig, RegenerateConfig
from eyrie.errors import RegenerationError, RequestRejected, ServerUnavailable
from eyrie.run.files import atomic_write_json
from eyrie.run.folder import RunFolder
from eyrie.stages.prepare import RowError, load_dataset_rows, load_seq_lens, load_shards, prepare
from eyrie.stages.regenerate.assemble import assemble
from eyrie.stages.regenerate.conversation import (
    Generation,
    conversation_temperature,
    overlap,
    plan_turns,
    regenerate_conversation,
)
from eyrie.stages.regenerate.plan import shard_key, stage_key
from eyrie.stages.regenerate.shard import regenerate_shard, shard_paths
from eyrie.stages.regenerate.source import extraction_source, record_extraction_source
from eyrie.target.metadata import load_tokenizer
from eyrie.vllm.client import ServerClient
from eyrie.vllm.plugin import SKIP_HIDDEN_STATES
from eyrie.vllm.spec import GENERATION_CACHE_SALT


def run_conversation(plan, generate, max_length, max_tokens):
    """The stage's conversation coroutine, answered by a blocking fake generator."""

    async def answer(*request):
        return generate(*request)

    return asyncio.run(regenerate_conversation(plan, answer, max_length, max_tokens))


TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "Spell cat."},
    {"role": "assistant", "content": "c-a-t."},
]


@pytest.fixture(scope="module")
def target_dir() -> Path:
    return build_tiny_target("tiny-llama-chat")


@pytest.fixture(scope="module")
def tok(target_dir):
    from eyrie.config import TargetConfig

    return load_tokenizer(TargetConfig(model=str(target_dir)))


def config_for(target_dir: Path, **regenerate) -> PipelineConfig:
    return PipelineConfig(
        target={"model": str(target_dir)},
        data={"source": str(DEMO_DATA), "max_length": 256, "shard_size": 4, "max_samples": 12, "eval_fraction": 0.1},
        regenerate={"enabled": True, **regenerate},
    )


class FakeGenerator:
    """Answers each prompt with "Answer <turn>." plus the end-of-turn token (or without it, cut at the budget)."""

    def __init__(self, tok, end: bool = True, words: int = 1):
        self.tok, self.end, self.words = tok, end, words
        self.calls: list[tuple[list[int], list[int]]] = []  # (prompt, returned ids)

    def __call__(self, prompt: list[int], max_tokens: int, turn: int) -> Generation:
        ids = self.tok(" ".join([f"Answer {turn}."] * self.words), add_special_tokens=False)["input_ids"]
        ids = ids + [self.tok.eos_token_id] if self.end else ids
        out = Generation(ids[:max_tokens], "stop" if len(ids) <= max_tokens and self.end else "length")
        self.calls.append((list(prompt), list(out.token_ids)))
        return out


# ---------------------------------------------------------------------------------------------------------------
# One conversation


def test_template_pieces_around_each_answer(tok):
    plan = plan_turns(tok, TWO_TURNS)
    assert plan.turns == [2, 4] and plan.dropped_history_text == 0
    text = [tok.decode(p) for p in plan.pieces]
    assert text == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_end|>\n<|im_start|>user\nSpell cat.<|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|>\n",
    ]
    # The first piece is the chat template's own prompt, tokenized as a chat server would.
    prompt = tok.apply_chat_template(TWO_TURNS[:2], tokenize=False, add_generation_prompt=True)
    assert plan.pieces[0] == tok(prompt, add_special_tokens=False)["input_ids"]


def test_an_opening_assistant_turn_stays_context(tok):
    messages = [{"role": "assistant", "content": "Hello there."}, *TWO_TURNS[1:3]]
    plan = plan_turns(tok, messages)
    assert plan.turns == [2]
    assert "Hello there." in tok.decode(plan.pieces[0])
    with pytest.raises(RowError) as info:
        plan_turns(tok, messages[:1])
    assert info.value.reason == "empty_assistant_turns"


def test_templates_that_rewrite_history(tok):
    # Text the template puts before an earlier answer (a reasoning placeholder) is dropped: the generated ids stand
    # for the whole turn.
    thinking = copy.deepcopy(tok)
    thinking.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}<think></think>"
        "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    plan = plan_turns(thinking, TWO_TURNS)
    assert plan.dropped_history_text == 2
    assert "<think>" not in thinking.decode(plan.pieces[1])
    # So is a generation prompt that history does not repeat (an empty thinking block, as Qwen3's template writes
    # with thinking off): each prompt is sent with it, and the row keeps what was sent.
    no_think = copy.deepcopy(tok)
    no_think.chat_template = tok.chat_template.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
    )
    plan = plan_turns(no_think, TWO_TURNS)
    assert plan.dropped_history_text == 2 and no_think.decode(plan.pieces[1]).endswith("</think>\n\n")
    row = run_conversation(plan, FakeGenerator(no_think), 256, 64)
    assert no_think.decode(row.input_ids).count("<think>") == 2
    # A template that renders earlier turns differently once later ones exist gives no single row its ids.
    last_only = copy.deepcopy(tok)
    last_only.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(RowError) as info:
        plan_turns(last_only, TWO_TURNS)
    assert info.value.reason == "template_rewrites_history"


def test_row_is_prompt_plus_generated_ids_verbatim(tok):
    plan = plan_turns(tok, TWO_TURNS)
    gen = FakeGenerator(tok)
    row = run_conversation(plan, gen, max_length=256, max_tokens=64)
    assert len(gen.calls) == 2 and row.turns == 2 and not row.length_capped and not row.truncated
    (p0, g0), (p1, g1) = gen.calls
    assert p0 == plan.pieces[0]
    # The second prompt extends the first with the first answer's ids as returned, then the template's piece less
    # the end-of-turn token the answer already ends with.
    assert p1 == p0 + g0 + plan.pieces[1][1:] and g0[-1] == tok.eos_token_id == plan.pieces[1][0]
    assert row.input_ids == p1 + g1 + plan.pieces[2][1:]
    # The mask covers exactly the generated ids (end-of-turn token included), nothing of the template.
    masked = [i for i, m in enumerate(row.loss_mask) if m]
    assert masked == list(range(len(p0), len(p0) + len(g0))) + list(range(len(p1), len(p1) + len(g1)))
    assert row.generated_tokens == len(g0) + len(g1) == sum(row.loss_mask)


def test_an_answer_without_the_end_token_keeps_the_template_whole(tok):
    assert overlap([5, 6, 2], [2, 7]) == 1 and overlap([5, 6], [2, 7]) == 0 and overlap([1, 2, 3], [2, 3, 4]) == 2
    plan = plan_turns(tok, TWO_TURNS[:3])

    def other_stop(prompt, max_tokens, turn):  # stopped on a token the template does not end turns with
        return Generation([40, 41, 0], "stop")

    row = run_conversation(plan, other_stop, 256, 64)
    assert row.input_ids == plan.pieces[0] + [40, 41, 0] + plan.pieces[1]


def test_length_cap_and_max_length(tok):
    plan = plan_turns(tok, TWO_TURNS)
    capped = run_conversation(plan, FakeGenerator(tok, words=8), max_length=256, max_tokens=5)
    # The first answer hit max_tokens: the row ends with it (no second turn, no closing template).
    assert capped.length_capped and not capped.truncated and capped.turns == 1
    assert capped.input_ids == plan.pieces[0] + capped.input_ids[len(plan.pieces[0]) :]
    assert sum(capped.loss_mask) == 5 and capped.loss_mask[-1] == 1
    # A budget cut by data.max_length is a truncation, not a length cap; nothing goes past max_length.
    room = len(plan.pieces[0]) + 3
    cut = run_conversation(plan, FakeGenerator(tok, words=8), max_length=room, max_tokens=64)
    assert cut.truncated and not cut.length_capped and len(cut.input_ids) == room
    with pytest.raises(RowError) as info:  # the prompt alone fills max_length
        run_conversation(plan, FakeGenerator(tok), max_length=len(plan.pieces[0]), max_tokens=64)
    assert info.value.reason == "empty_assistant_turns"


def test_temperature_mix_is_per_conversation_and_repeatable():
    cfg = RegenerateConfig(temperature_mix=[{"temperature": 0.0, "weight": 1}, {"temperature": 1.0, "weight": 3}])
    picks = [conversation_temperature(cfg, f"{i:016x}") for i in range(2000)]
    assert picks == [conversation_temperature(cfg, f"{i:016x}") for i in range(2000)]
    assert set(picks) == {0.0, 1.0} and 0.7 < picks.count(1.0) / len(picks) < 0.8
    reseeded = RegenerateConfig(seed=1, temperature_mix=cfg.temperature_mix)
    assert picks != [conversation_temperature(reseeded, f"{i:016x}") for i in range(2000)]
    assert conversation_temperature(RegenerateConfig(temperature=0.3), "ab") == 0.3


# ---------------------------------------------------------------------------------------------------------------
# Shards, keys, assembly


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, target_dir) -> tuple[Path, PipelineConfig]:
    config = config_for(target_dir)
    out = tmp_path_factory.mktemp("regen") / "prepare"
    prepare(config.target, config.data, out)
    return out, config


class FakeClient:
    """ServerClient.generate's contract: the reply depends on the prompt only; some rows fail on purpose."""

    def __init__(self, tok, reject: dict[int, RequestRejected] | None = None, dead: bool = False):
        self.tok, self.reject, self.dead = tok, reject or {}, dead
        self.calls = 0
        self.lock = threading.Lock()

    def generate(self, token_ids, max_tokens, temperature, top_p, seed, timeout_s, retries=2):
        with self.lock:
            self.calls += 1
        if self.dead:
            raise ServerUnavailable("no answer from vLLM")
        prompt = self.tok.decode(token_ids)
        for marker, err in self.reject.items():
            if not marker or f"#{marker}#" in prompt:
                raise err
        ids = self.tok(f"Reply {len(token_ids)}.", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return {"token_ids": ids[:max_tokens], "finish_reason": "stop" if len(ids) <= max_tokens else "length"}


def test_shard_rows_and_stats(tmp_path, prepared, tok):
    prepare_dir, config = prepared
    shard = load_shards(prepare_dir)[0]
    client = FakeClient(tok)
    m = regenerate_shard(client, tok, prepare_dir, tmp_path, shard, "k1", config.regenerate, 256)
    assert m["key"] == "k1" and m["stats"]["rows_in"] == m["stats"]["rows_out"] == shard.stop - shard.start
    assert m["stats"]["requests"] == client.calls == m["stats"]["turns"] and not m["stats"]["failed"]
    # A finished shard with its key is not regenerated.
    again = FakeClient(tok)
    assert regenerate_shard(again, tok, prepare_dir, tmp_path, shard, "k1", config.regenerate, 256) == m
    assert again.calls == 0
    # Another key, or rows file of another size, means the shard is redone.
    rows_path, _ = shard_paths(tmp_path, shard)
    rows_path.write_bytes(rows_path.read_bytes() + b"x")
    regenerate_shard(again, tok, prepare_dir, tmp_path, shard, "k1", config.regenerate, 256)
    assert again.calls == m["stats"]["requests"]


def test_failed_rows_are_counted_by_reason(tmp_path, prepared, tok, monkeypatch):
    import eyrie.stages.regenerate.shard as regen

    prepare_dir, config = prepared
    shard = load_shards(prepare_dir)[0]
    # Mark two conversations so the fake server rejects them: one prompt too long, one server error.
    conversations = regen.load_conversations(prepare_dir, shard)
    for row, marker in ((0, " #long#"), (1, " #boom#")):
        next(m for m in conversations[row] if m["role"] == "user")["content"] += marker
    monkeypatch.setattr(regen, "load_conversations", lambda *a: conversations)
    client = FakeClient(
        tok,
        reject={
            "long": RequestRejected(400, "This model's maximum context length is 512 tokens"),
            "boom": RequestRejected(500, "Internal Server Error"),
        },
    )
    m = regenerate_shard(client, tok, prepare_dir, tmp_path, shard, "k", config.regenerate, 256)
    s = m["stats"]
    assert s["failed"] == {"prompt_too_long": 1, "server_error": 1} and s["rows_out"] == s["rows_in"] - 2
    assert set(s["examples"]) == {"prompt_too_long", "server_error"}


def test_a_dead_server_fails_the_shard_and_writes_nothing(tmp_path, prepared, tok):
    prepare_dir, config = prepared
    shard = load_shards(prepare_dir)[0]
    dead = FakeClient(tok, dead=True)
    one_at_a_time = config.regenerate.model_copy(update={"concurrency": 1})
    with pytest.raises(ServerUnavailable):
        regenerate_shard(dead, tok, prepare_dir, tmp_path, shard, "k", one_at_a_time, 256)
    assert not any(p.exists() for p in shard_paths(tmp_path, shard))
    # The other conversations do not ask again once one found the server gone (each would wait out its retries).
    assert dead.calls == 1 < shard.stop - shard.start
    # Server errors on most rows are systemic: the shard fails rather than pass with its rows dropped.
    boom = FakeClient(tok, reject={"": RequestRejected(503, "engine dead")})
    with pytest.raises(RegenerationError, match="server errors"):
        regenerate_shard(boom, tok, prepare_dir, tmp_path, shard, "k", config.regenerate, 256)
    assert not shard_paths(tmp_path, shard)[1].exists()


def test_keys(prepared, target_dir):
    prepare_dir, config = prepared
    shards = load_shards(prepare_dir)
    template = "tpl"

    def key(cfg=config, shard=shards[0], template=template) -> str:
        return shard_key(template, shard, cfg)

    base = key()
    assert base == key() and base != key(shard=shards[1])
    changed = [
        key(cfg=config_for(target_dir, temperature=0.7)),
        key(cfg=config_for(target_dir, temperature_mix=[{"temperature": 0.5, "weight": 1}])),
        key(cfg=config_for(target_dir, seed=3)),
        key(cfg=config_for(target_dir, max_tokens=64)),
        key(cfg=config_for(target_dir, top_p=0.9)),
        key(template="other"),
        key(shard=dataclasses.replace(shards[0], conversations="other")),
        key(shard=dataclasses.replace(shards[0], fingerprint="other")),
    ]
    assert base not in changed and len(set(changed)) == len(changed)
    # How the work is done is not what it produces.
    assert key(cfg=config_for(target_dir, concurrency=3, request_timeout_s=5, retries=0)) == base
    assert key(cfg=config_for(target_dir, length_capped="drop")) == base
    keys = {s.name: key(shard=s) for s in shards}
    assert stage_key(keys, config) != stage_key(keys, config_for(target_dir, length_capped="drop"))


def test_assembly_is_prepares_format(tmp_path, prepared, tok):
    prepare_dir, config = prepared
    shards = load_shards(prepare_dir)
    assert len(shards) == 3
    keys = {s.name: f"k{s.index}" for s in shards}
    client = FakeClient(tok)
    for s in shards:
        regenerate_shard(client, tok, prepare_dir, tmp_path, s, keys[s.name], config.regenerate, 256)
    m = assemble(tmp_path, prepare_dir, shards, keys, "stage", config.regenerate)
    n = m["num_samples"]
    assert n == sum(s.stop - s.start for s in shards) == m["stats"]["rows_used"]
    # Read through prepare's own readers, as extraction, vocab and training read it.
    rows = load_dataset_rows(tmp_path, 0, n)
    assert load_seq_lens(tmp_path) == [len(r) for r in rows]
    out_shards = load_shards(tmp_path)
    assert [(s.name, s.start, s.stop) for s in out_shards] == [(s.name, s.start, s.stop) for s in shards]
    from datasets import load_from_disk

    ds = load_from_disk(str(tmp_path / "dataset"))
    want = load_from_disk(str(prepare_dir / "dataset"))
    assert ds.features == want.features and ds.format["type"] == want.format["type"] == "torch"
    freq = torch.load(tmp_path / "dataset" / "token_freq.pt", weights_only=True)
    counted: dict[int, int] = {}
    for r in ds.with_format(None):
        for t, mk in zip(r["input_ids"], r["loss_mask"]):
            counted[t] = counted.get(t, 0) + mk
    assert freq == {t: c for t, c in counted.items() if c}
    assert m["prepare_key"] == json.loads((prepare_dir / "manifest.json").read_text())["key"]
    assert set(m["files"]) >= {"shards.json", "dataset/token_freq.pt"}
    # A finished assembly with its key is reused; a shard file changed since is caught and its manifest dropped.
    assert assemble(tmp_path, prepare_dir, shards, keys, "stage", config.regenerate) == m
    rows_path, manifest_path = shard_paths(tmp_path, shards[1])
    rows_path.write_bytes(rows_path.read_bytes()[:-1] + b"\0")
    with pytest.raises(RegenerationError, match="changed since its shard finished"):
        assemble(tmp_path, prepare_dir, shards, keys, "stage-2", config.regenerate)
    assert not manifest_path.exists()


def test_length_capped_rows_kept_or_dropped(tmp_path, prepared, tok):
    prepare_dir, _ = prepared
    shards = load_shards(prepare_dir)[:1]
    keys = {shards[0].name: "k"}
    for policy in ("keep", "drop"):
        cfg = RegenerateConfig(enabled=True, max_tokens=2, length_capped=policy)
        out = tmp_path / policy
        regenerate_shard(FakeClient(tok), tok, prepare_dir, out, shards[0], "k", cfg, 256)
        if policy == "keep":
            m = assemble(out, prepare_dir, shards, keys, "s", cfg)
            assert m["stats"]["length_capped"] == m["num_samples"] == shards[0].stop - shards[0].start
        else:
            with pytest.raises(RegenerationError, match="no conversation was regenerated"):
                assemble(out, prepare_dir, shards, keys, "s", cfg)


def test_extraction_reads_the_regenerated_data_when_enabled(tmp_path, target_dir):
    run = RunFolder(tmp_path / "run")
    on, off = config_for(target_dir), config_for(target_dir, enabled=False)
    assert extraction_source(run, off.regenerate) == run.prepare
    with pytest.raises(RegenerationError, match="--until regenerate"):
        extraction_source(run, on.regenerate)  # enabled, but nothing regenerated from the current prepare
    atomic_write_json(run.manifest("prepare"), {"key": "p1"})
    atomic_write_json(run.manifest("regenerate"), {"key": "r", "prepare_key": "p0"})
    with pytest.raises(RegenerationError):
        extraction_source(run, on.regenerate)  # regenerated from an earlier prepare
    atomic_write_json(run.manifest("regenerate"), {"key": "r", "prepare_key": "p1"})
    assert extraction_source(run, on.regenerate) == run.stage("regenerate")
    # Readers without a config (status, verify) follow what extraction recorded.
    assert extraction_source(run) == run.prepare
    record_extraction_source(run, run.stage("regenerate"))
    assert extraction_source(run) == run.stage("regenerate")
    record_extraction_source(run, run.prepare)
    assert extraction_source(run) == run.prepare


# ---------------------------------------------------------------------------------------------------------------
# The client


class _Canned(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server
    replies: list[tuple[int, dict]] = []
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        status, reply = type(self).replies.pop(0)
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def canned():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Canned.replies, _Canned.bodies = [], []
    yield _Canned, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _blocking(client: ServerClient, *args, **kw) -> dict:
    return client.generate(*args, **kw)


def _coroutine(client: ServerClient, *args, **kw) -> dict:
    async def go() -> dict:
        async with client.async_generator() as generate:
            return await generate(*args, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize("generate", [_blocking, _coroutine], ids=["blocking", "coroutine"])
def test_client_request_and_error_mapping(canned, monkeypatch, generate):
    """`ServerClient.generate` and its coroutine form (regeneration's window): the same body, answers and errors."""

    monkeypatch.setattr("eyrie.vllm.client._backoff_s", lambda attempt: 0.0)
    handler, url = canned
    ok = {"choices": [{"token_ids": [7, 8, 2], "finish_reason": "stop", "prompt_token_ids": [1, 2]}]}
    handler.replies = [(500, {"error": "busy"}), (200, ok)]
    client = ServerClient(url)
    assert generate(client, [1, 2], 16, 0.7, 0.9, 123, 5) == {"token_ids": [7, 8, 2], "finish_reason": "stop"}
    body = handler.bodies[-1]
    assert body["prompt"] == [1, 2] and body["return_token_ids"] and body["seed"] == 123 and body["top_p"] == 0.9
    # No hidden-states file for it on the extraction server, and prefix-cache blocks of its own.
    assert body["kv_transfer_params"] == {SKIP_HIDDEN_STATES: True} and body["cache_salt"] == GENERATION_CACHE_SALT
    handler.replies = [(400, {"error": "maximum context length"})]
    with pytest.raises(RequestRejected) as info:
        generate(client, [1, 2], 16, 0.0, 1.0, None, 5)
    assert info.value.status == 400 and len(handler.bodies) == 3 and "seed" not in handler.bodies[-1]
    assert "maximum context length" in info.value.text
    handler.replies = [(500, {"error": "x"})] * 3
    with pytest.raises(RequestRejected) as info:
        generate(client, [1, 2], 16, 0.0, 1.0, None, 5, retries=2)
    assert info.value.status == 500 and len(handler.bodies) == 6
    aborted = {"choices": [{"token_ids": [7], "finish_reason": "abort"}]}
    handler.replies = [(200, aborted)]
    with pytest.raises(ServerUnavailable, match="abort"):
        generate(client, [1, 2], 16, 0.0, 1.0, None, 5)
    with pytest.raises(ServerUnavailable, match="no answer"):
        generate(ServerClient("http://127.0.0.1:9"), [1], 4, 0.0, 1.0, None, 2, retries=1)


def test_status_follows_the_stage(tmp_path, prepared, tok):
    import shutil

    from eyrie.ops.status import run_status

    prepare_dir, config = prepared
    run = RunFolder(tmp_path / "run")
    shutil.copytree(prepare_dir, run.prepare)
    shards = load_shards(run.prepare)
    keys = {s.name: f"k{s.index}" for s in shards}
    stage = run.stage("regenerate")
    assert run_status(run)["stages"]["regenerate"] == "not started"
    regenerate_shard(FakeClient(tok), tok, run.prepare, stage, shards[0], keys[shards[0].name], config.regenerate, 256)
    assert run_status(run)["stages"]["regenerate"] == f"1/{len(shards)} shards"
    for s in shards[1:]:
        regenerate_shard(FakeClient(tok), tok, run.prepare, stage, s, keys[s.name], config.regenerate, 256)
    assemble(stage, run.prepare, shards, keys, "stage", config.regenerate)
    assert run_status(run)["stages"]["regenerate"] == "done"
    # Its manifest lists its files (for `eyrie verify` too): one gone shows.
    (stage / "dataset" / "token_freq.pt").unlink()
    assert run_status(run)["stages"]["regenerate"].startswith("damaged")


@pytest.mark.parametrize(("enabled", "concurrency", "warned"), [(True, 16, True), (True, 8, False), (False, 16, False)])
def test_preflight_warns_when_regeneration_outruns_the_servers_max_num_seqs(tmp_path, enabled, concurrency, warned):
    """Regeneration generates on the extraction server: more conversations in flight than its --max-num-seqs only
    queue in vLLM, their wait counted against the request timeout. Preflight says so, as for extraction."""
    from conftest import VLLM_SERVER_ARGS, write_config

    from eyrie.stages.preflight import check_server_arguments

    _, config = write_config(
        tmp_path / "config.yaml",
        build_tiny_target("tiny-llama-chat"),
        "tiny-llama-chat",
        concurrency=8,
        extraction={"server_args": [*VLLM_SERVER_ARGS, "--max-num-seqs=8"]},
        regenerate={"enabled": enabled, "concurrency": concurrency},
    )
    failures, warnings = check_server_arguments(config, [2, 4, 5, 8], serve=False)
    assert failures == []
    ours = [w for w in warnings if w.startswith("regenerate.concurrency")]
    if warned:
        assert ours == [
            "regenerate.concurrency 16 is above the extraction server's --max-num-seqs 8, which regeneration "
            "generates on: the requests beyond it wait in vLLM's queue, their wait counted against "
            "regenerate.request_timeout_s; set regenerate.concurrency to 8"
        ]
    else:
        assert ours == []
    assert not any(w.startswith("extraction.concurrency") for w in warnings)  # 8 of 8: within it
