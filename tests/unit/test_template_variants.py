"""Issue 25 item 4: evaluation prompts rendered with named chat-template variants from the config (a `thinking`
switch...), sent as production sends them (vLLM's `chat_template_kwargs` in each request), each variant measured
on every evaluation set and reported apart."""

from __future__ import annotations

import pytest
from conftest import config_dict
from test_acceptance_statistics import FakeClient

from eyrie.config import parse_config
from eyrie.errors import ConfigError
from eyrie.stages.evaluate import (
    HELD_OUT,
    TemplateVariant,
    evaluate_key,
    evaluation_markdown,
    measure,
    template_variants,
    variant_set_name,
)
from tasks.evaluate import measure_set

THINKING = {"name": "thinking", "chat_template_kwargs": {"enable_thinking": True}}


class _Session:
    """The HTTP session of a server's client: each chat body answered by the fake server behind it."""

    def __init__(self, server: FakeClient):
        self.server, self.bodies = server, []

    def post(self, url, json, timeout):
        self.bodies.append((url, json))
        answer = self.server.chat(json["messages"], json["max_tokens"])

        class _R:
            def raise_for_status(self):
                return None

            def json(self):
                return answer

        return _R()


class _Client:
    def __init__(self, server: FakeClient):
        self.base_url, self.session, self.server = "http://127.0.0.1:1", _Session(server), server

    def metrics(self):
        return self.server.metrics()


def test_a_variant_sends_its_switches_in_every_request_and_is_reported_apart():
    hists = {f"p{i}": [1, 1, 2, i % 3] for i in range(6)}
    client = _Client(FakeClient(hists, per_request=True))
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(6)]
    rendered = TemplateVariant(client, THINKING["chat_template_kwargs"])
    result = measure_set(rendered, [{"messages": p, "category": None} for p in prompts], 16)
    assert len(client.session.bodies) == 6
    for url, body in client.session.bodies:
        assert url.endswith("/v1/chat/completions")
        assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["temperature"] == 0.0
    assert result["statistics"]["requests_with_drafts"] == 6
    plain = measure(FakeClient(hists, per_request=True), prompts, 16)
    plain["label"] = "trained"
    plain["sets"] = {variant_set_name(HELD_OUT, "thinking"): result}
    text = "\n".join(evaluation_markdown({"trained": plain}))
    assert "Acceptance on `held-out`" in text and "Acceptance on `held-out, thinking`" in text


def test_variants_are_named_in_the_config_and_shape_the_key(tmp_path):
    config = parse_config(config_dict(tmp_path / "t", evaluate={"template_variants": [THINKING]}))
    assert template_variants(config) == {"thinking": {"enable_thinking": True}}
    prompts = [[{"role": "user", "content": "hi"}]]
    base = parse_config(config_dict(tmp_path / "t"))
    assert template_variants(base) == {}
    assert evaluate_key(config, "trained", "d", prompts, "s") != evaluate_key(base, "trained", "d", prompts, "s")
    twice = config_dict(tmp_path / "t", evaluate={"template_variants": [THINKING, THINKING]})
    with pytest.raises(ConfigError, match="two variants are named 'thinking'"):
        template_variants(parse_config(twice))
    with pytest.raises(ConfigError, match="chat_template_kwargs"):
        parse_config(
            config_dict(tmp_path / "t", evaluate={"template_variants": [{"name": "x", "chat_template_kwargs": {}}]})
        )


def test_a_switch_the_template_never_reads_is_named(tiny_llama):
    from eyrie.stages.evaluate import template_variant_warnings

    qwen_like = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{%- endif %}"
    assert template_variant_warnings(qwen_like, {"thinking": {"enable_thinking": True}}) == []
    [w] = template_variant_warnings(qwen_like, {"thinking": {"enable_thinkng": True}})
    assert "'thinking'" in w and "never reads enable_thinkng" in w
    # The tiny target's own template has no thinking switch.
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(str(tiny_llama)).chat_template
    assert template and template_variant_warnings(template, {"thinking": {"enable_thinking": True}})
