"""Property test over data preparation's input: random and adversarial rows (wrong shapes, unknown roles, template
tokens inside content, unicode, empty and long turns) never crash prepare's row handling with anything but a
counted RowError, and a usable row's loss mask covers assistant text only."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eyrie.stages.prepare import RowError, normalize, tokenize_conversation

TEMPLATE_BITS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "assistant\n", "user", "\n", "{{", "}}", "{%"]
text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(TEMPLATE_BITS),
    st.lists(st.sampled_from(TEMPLATE_BITS + ["a", " ", "é", "🦅"]), max_size=8).map("".join),
)
role = st.sampled_from(["user", "assistant", "system", "human", "gpt", "tool", "USER", "narrator", "", None, 3])
turn = st.one_of(
    st.fixed_dictionaries({"role": role, "content": st.one_of(text, st.none(), st.integers())}),
    st.fixed_dictionaries({"from": role, "value": text}),
    st.fixed_dictionaries(
        {
            "role": role,
            "content": st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=2
            ),
        }
    ),
    text,
    st.none(),
    st.integers(),
)
row = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(turn, max_size=6)}),
    st.fixed_dictionaries({"conversations": st.lists(turn, max_size=6)}),
    st.fixed_dictionaries({"text": text}),
    st.lists(turn),
    text,
    st.none(),
)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


# derandomize: the same 300 examples on every run, so CI is never red by the luck of a draw (a new case found by
# exploring locally goes into the strategies or an explicit test).
@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(row=row, max_length=st.integers(min_value=8, max_value=96))
def test_rows_are_used_or_refused_with_a_reason(tok, row, max_length):
    try:
        messages = normalize(row)
        ids, mask, _ = tokenize_conversation(tok, messages, max_length)
    except RowError as err:
        assert err.reason  # counted under this key in stats.json
        return
    assert len(ids) == len(mask) <= max_length and any(mask)
    masked = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    others = "".join(m["content"] for m in messages if m["role"] != "assistant")
    assistant = "".join(m["content"] for m in messages if m["role"] == "assistant")
    # Everything masked is assistant content or the template's closing of an assistant turn.
    residue = masked
    for piece in [m["content"] for m in messages if m["role"] == "assistant"] + ["<|im_end|>", "\n"]:
        residue = residue.replace(piece, "") if piece else residue
    # A multi-byte character cut by truncation, or split across byte-level tokens at the mask's edge, decodes to
    # U+FFFD on its own.
    residue = residue.replace("\ufffd", "")
    assert residue.strip() == "" or residue in assistant, (masked, assistant, others)
