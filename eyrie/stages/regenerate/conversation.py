"""One conversation regenerated: the chat template's pieces around each answer, the sampling, the turn-by-turn
loop.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from eyrie.config import EvaluateConfig, RegenerateConfig
from eyrie.stages.prepare import RowError, render_text


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


def _render(tokenizer, messages: list[dict], generation_prompt: bool, chat_template_kwargs: dict | None) -> str:
    """prepare's rendering, with a template variant's switches passed to the template as vLLM's chat endpoint
    passes a request's `chat_template_kwargs` (extra arguments of `apply_chat_template`)."""
    if not chat_template_kwargs:
        return render_text(tokenizer, messages, generation_prompt)
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **chat_template_kwargs
        )
    except Exception as err:  # as render_text: every template failure is "this row does not render"
        raise RowError("chat_template_error", str(err)[:200]) from None


def plan_turns(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> TurnPlan:
    """The pieces of the chat template around each assistant turn to regenerate (every one but an opening one,
    which has no prompt: context, as prepare keeps it). Raises RowError when the template does not allow it.

    Turn k's prompt is the template's render up to it with the generation prompt. After answer k, the row goes on
    with what the next render puts after answer k's sentinel. That render must keep everything before answer k's own
    turn as it was (the history); how it writes the turn's header in history may differ from the generation prompt
    (a `<think></think>` placeholder, a thinking prompt left out): the row keeps what was sent and generated, and
    `dropped_history_text` counts such turns. `chat_template_kwargs`: a template variant's switches (None: the
    template's default rendering)."""
    turns = [j for j, m in enumerate(messages) if m["role"] == "assistant" and j > 0]
    if not turns:
        raise RowError("empty_assistant_turns", "no assistant turn after a prompt")
    marks = _sentinels(messages, len(turns))
    skeleton = [dict(m) for m in messages]
    for j, mark in zip(turns, marks):
        skeleton[j]["content"] = mark
    kw = chat_template_kwargs
    prompts = [_render(tokenizer, skeleton[:j], True, kw) for j in turns]
    histories = [_render(tokenizer, skeleton[:j], False, kw) for j in turns]
    nexts = prompts[1:] + [_render(tokenizer, skeleton, False, kw)]  # what follows each answer, in a later render
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


async def regenerate_conversation(
    plan: TurnPlan, generate: Callable[[list[int], int, int], Awaitable[Generation]], max_length: int, max_tokens: int
) -> Regenerated:
    """Build the row turn by turn: the coroutine `generate(prompt_ids, max_tokens, turn)` answers each prompt; its
    ids are appended verbatim and masked, then the template's piece up to the next prompt (less what the answer
    already ends with). An answer cut by `max_tokens` ends the row (`length_capped`); so does `max_length`
    (`truncated`)."""
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
        out = await generate(ids, budget, k)
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


def _draw(salt: str, weights: list[float]) -> int:
    """The index drawn by weight from a hash of `salt` (the same salt draws the same index on every run)."""
    u = int(hashlib.sha256(salt.encode()).hexdigest()[:13], 16) / 16**13
    total = sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w / total
        if u < acc:
            return i
    return len(weights) - 1


def conversation_temperature(cfg: RegenerateConfig, fingerprint: str) -> float:
    """The conversation's temperature: `temperature`, or one of `temperature_mix` drawn by weight from a hash of
    the seed and the conversation (the same conversation gets the same one on every run)."""
    if not cfg.temperature_mix:
        return cfg.temperature
    i = _draw(f"{cfg.seed}:{fingerprint}", [t.weight for t in cfg.temperature_mix])
    return cfg.temperature_mix[i].temperature


DEFAULT_VARIANT = "default"  # the template's own rendering, no switches


def conversation_variant(cfg: RegenerateConfig, fingerprint: str) -> str:
    """The conversation's chat-template variant: `default`, or one of `template_mix` drawn by weight from a hash of
    the seed and the conversation, apart from the temperature's draw (so the two mixes are independent)."""
    if not cfg.template_mix:
        return DEFAULT_VARIANT
    i = _draw(f"{cfg.seed}:template:{fingerprint}", [t.weight for t in cfg.template_mix])
    return cfg.template_mix[i].variant


def template_mix(regenerate: RegenerateConfig, evaluate: EvaluateConfig) -> dict[str, dict]:
    """`regenerate.template_mix`'s variants by name, each its `chat_template_kwargs` as evaluation sends them
    (`evaluate.template_variants`; `default`: none). Empty when there is no mix. A name no variant declares, a
    variant named twice in the mix, or a declared variant named `default`, is a ConfigError."""
    from eyrie.errors import ConfigError

    mix = regenerate.template_mix or []
    if not mix:
        return {}
    declared: dict[str, dict] = {}
    for v in evaluate.template_variants:
        if v.name in declared:
            raise ConfigError(f"evaluate.template_variants: two variants are named {v.name!r}; name each apart")
        declared[v.name] = dict(v.chat_template_kwargs)
    if DEFAULT_VARIANT in declared:
        raise ConfigError(
            f"evaluate.template_variants: a variant is named {DEFAULT_VARIANT!r}, which regenerate.template_mix "
            "reserves for the template's own rendering: rename it"
        )
    out: dict[str, dict] = {}
    for share in mix:
        if share.variant in out:
            raise ConfigError(
                f"regenerate.template_mix names {share.variant!r} twice: give each variant one entry and weight"
            )
        if share.variant != DEFAULT_VARIANT and share.variant not in declared:
            known = ", ".join(repr(n) for n in [DEFAULT_VARIANT, *declared])
            raise ConfigError(
                f"regenerate.template_mix: {share.variant!r} is not a template variant; known: {known} "
                "(declare it in evaluate.template_variants with its chat_template_kwargs)"
            )
        out[share.variant] = declared.get(share.variant, {})
    return out


def request_seed(cfg: RegenerateConfig, fingerprint: str, turn: int) -> int:
    """vLLM's per-request sampling seed: sampling at a temperature above 0 repeats on a re-run."""
    return int(hashlib.sha256(f"{cfg.seed}:{fingerprint}:{turn}".encode()).hexdigest()[:15], 16)
