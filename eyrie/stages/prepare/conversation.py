"""One conversation: normalized to standard roles, rendered with the chat template, its assistant-only loss
mask."""

from __future__ import annotations

from typing import Any

from eyrie.stages.prepare.rows import RowError

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
