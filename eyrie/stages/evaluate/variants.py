"""Chat-template variants: the prompts rendered with a variant's switches, and the warnings for switches never read."""

from __future__ import annotations

import re

# ---------------------------------------------------------------------------------------------------------------
# Chat-template variants (issue 25 item 4): the prompts rendered as production serves them, switches included.


class TemplateVariant:
    """A server's client whose chat requests carry `chat_template_kwargs` (a variant's switches, e.g.
    `{"enable_thinking": true}`): vLLM renders each prompt with the target's chat template and these, as it does
    for production's requests. `metrics` is the server's own."""

    def __init__(self, client, chat_template_kwargs: dict):
        self.client, self.chat_template_kwargs = client, dict(chat_template_kwargs)

    def chat(self, messages: list[dict], max_tokens: int, timeout_s: float = 600) -> dict:
        body = {
            "model": "target",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        r = self.client.session.post(self.client.base_url + "/v1/chat/completions", json=body, timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> str:
        return self.client.metrics()


def template_variants(config) -> dict[str, dict]:
    """`evaluate.template_variants` by name: each its `chat_template_kwargs`."""
    from eyrie.errors import ConfigError

    out: dict[str, dict] = {}
    for v in getattr(config.evaluate, "template_variants", None) or []:
        if v.name in out:
            raise ConfigError(f"evaluate.template_variants: two variants are named {v.name!r}; name each apart")
        out[v.name] = dict(v.chat_template_kwargs)
    return out


def variant_set_name(set_name: str, variant: str) -> str:
    return f"{set_name}, {variant}"


def template_variant_warnings(chat_template: str | None, variants: dict[str, dict]) -> list[str]:
    """A variant whose switches the target's chat template never reads renders exactly as the default: measuring
    it tells nothing (a misspelt `enable_thinking`, or a template without that switch). One warning per switch the
    template's text does not name (`chat_template`: the tokenizer's template; None or empty: vLLM's default)."""
    out = []
    for name, switches in variants.items():
        unread = [k for k in switches if not chat_template or not re.search(rf"\b{re.escape(k)}\b", chat_template)]
        if unread:
            out.append(
                f"evaluate.template_variants {name!r}: the target's chat template never reads "
                f"{', '.join(unread)}, so this variant renders as the default; check the switch's name against the "
                "template (tokenizer_config.json `chat_template` or chat_template.jinja)"
            )
    return out
