"""regenerate.template_mix without a server: each conversation rendered with one chat-template variant's switches
(evaluate.template_variants' `chat_template_kwargs`), drawn per conversation by weight and repeatably; the prompt
ids sent are the template's rendering with those switches; each row records its variant; the shard key follows
the mix and the variants' switches; a name no variant declares is refused."""

from __future__ import annotations

import copy
import io
import json
from collections import Counter

import pyarrow.parquet as pq
import pytest
from conftest import DEMO_DATA, build_tiny_target

from eyrie.config import PipelineConfig, RegenerateConfig, TargetConfig
from eyrie.errors import ConfigError, RegenerationError
from eyrie.stages.prepare import load_shards, prepare
from eyrie.stages.regenerate.assemble import assemble
from eyrie.stages.regenerate.conversation import (
    DEFAULT_VARIANT,
    conversation_temperature,
    conversation_variant,
    plan_turns,
    template_mix,
)
from eyrie.stages.regenerate.plan import shard_key
from eyrie.stages.regenerate.shard import load_conversations, regenerate_shard, shard_paths
from eyrie.target.metadata import load_tokenizer

THINK = {"enable_thinking": True}
# A template with a thinking switch, as Qwen3's reads it: the generation prompt opens a think block when it is on.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>{% endif %}{% endif %}"
)
VARIANTS = [{"name": "thinking", "chat_template_kwargs": THINK}, {"name": "plain", "chat_template_kwargs": {"x": 1}}]


def _mix(config: PipelineConfig) -> dict[str, dict]:
    return template_mix(config.regenerate, config.evaluate)


@pytest.fixture(scope="module")
def target_dir():
    return build_tiny_target("tiny-llama-chat")


@pytest.fixture(scope="module")
def tok(target_dir):
    t = copy.deepcopy(load_tokenizer(TargetConfig(model=str(target_dir))))
    t.chat_template = TEMPLATE
    return t


def config_for(target_dir, mix=None, variants=VARIANTS, **regenerate) -> PipelineConfig:
    return PipelineConfig(
        target={"model": str(target_dir)},
        data={"source": str(DEMO_DATA), "max_length": 256, "shard_size": 4, "max_samples": 12, "eval_fraction": 0.1},
        regenerate={"enabled": True, "template_mix": mix, **regenerate},
        evaluate={"template_variants": variants},
    )


MIX = [{"variant": "default", "weight": 1}, {"variant": "thinking", "weight": 3}]


def test_the_variant_is_per_conversation_repeatable_and_follows_the_weights():
    cfg = RegenerateConfig(template_mix=MIX)
    fps = [f"{i:016x}" for i in range(4000)]
    picks = [conversation_variant(cfg, fp) for fp in fps]
    assert picks == [conversation_variant(cfg, fp) for fp in fps]  # the same conversation, the same variant
    share = Counter(picks)["thinking"] / len(picks)
    assert 0.72 < share < 0.78  # weight 3 of 4
    assert picks != [conversation_variant(RegenerateConfig(seed=1, template_mix=MIX), fp) for fp in fps]
    assert {conversation_variant(RegenerateConfig(), fp) for fp in fps[:50]} == {DEFAULT_VARIANT}
    # Drawn apart from the temperature: with both mixed, every pairing occurs.
    both = RegenerateConfig(
        template_mix=MIX, temperature_mix=[{"temperature": 0, "weight": 1}, {"temperature": 1, "weight": 1}]
    )
    pairs = Counter((conversation_variant(both, fp), conversation_temperature(both, fp)) for fp in fps)
    assert len(pairs) == 4 and min(pairs.values()) > 0.1 * len(fps)  # each 1/8 or 3/8: independent draws


def test_a_variant_renders_with_its_switches(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    plain, thinking = plan_turns(tok, messages), plan_turns(tok, messages, THINK)
    assert tok.decode(plain.pieces[0]).endswith("<|assistant|>")
    assert tok.decode(thinking.pieces[0]).endswith("<|assistant|><think>")
    # What vLLM's chat endpoint renders for a request carrying these chat_template_kwargs.
    want = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, **THINK)
    assert thinking.pieces[0] == tok(want, add_special_tokens=False)["input_ids"]


def test_a_name_no_variant_declares_is_refused(target_dir):
    assert _mix(config_for(target_dir, MIX)) == {"default": {}, "thinking": THINK}
    assert _mix(config_for(target_dir)) == {}
    # Refused when the config loads (eyrie/config.py), with the stage's own words.
    with pytest.raises(ValueError, match=r"'thinkin' is not a template variant; known: 'default', 'thinking', 'plain'"):
        config_for(target_dir, [{"variant": "thinkin", "weight": 1}])
    with pytest.raises(ValueError, match="twice"):
        config_for(target_dir, [{"variant": "plain", "weight": 1}, {"variant": "plain", "weight": 2}])
    with pytest.raises(ValueError, match="reserves"):
        config_for(target_dir, MIX, variants=[{"name": "default", "chat_template_kwargs": THINK}])
    # A config changed after loading (its sections validate only themselves): refused by the stage too.
    changed = config_for(target_dir, MIX)
    changed.regenerate.template_mix = [{"variant": "thinkin", "weight": 1}]
    with pytest.raises(ConfigError, match=r"'thinkin' is not a template variant; known: 'default', 'thinking'"):
        _mix(changed)
    # The shard key is where the plan meets the config: refused there too, before any request.
    changed.regenerate.template_mix = [{"variant": "nope", "weight": 1}]
    with pytest.raises(ConfigError, match="not a template variant"):
        shard_key("tpl", None, changed)


def test_the_key_follows_the_mix_and_its_switches(tmp_path, target_dir):
    out = tmp_path / "prepare"
    base = config_for(target_dir)
    prepare(base.target, base.data, out)
    shard = load_shards(out)[0]

    def key(config):
        return shard_key("tpl", shard, config)

    keys = [
        key(base),
        key(config_for(target_dir, MIX)),
        key(config_for(target_dir, [{"variant": "default", "weight": 1}, {"variant": "thinking", "weight": 1}])),
        key(config_for(target_dir, [{"variant": "plain", "weight": 1}, {"variant": "thinking", "weight": 3}])),
        # The same mix, the thinking variant's switches changed: other rows.
        key(config_for(target_dir, MIX, variants=[{"name": "thinking", "chat_template_kwargs": {"think": True}}])),
    ]
    assert len(set(keys)) == len(keys)
    # With no mix, the evaluation variants do not touch regeneration.
    assert key(config_for(target_dir, variants=[])) == keys[0]


class RecordingClient:
    """ServerClient.generate's contract; records each prompt sent."""

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    def generate(self, token_ids, max_tokens, temperature, top_p, seed, timeout_s, retries=2):
        self.prompts.append(self.tok.decode(token_ids))
        ids = self.tok("Ok.", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return {"token_ids": ids, "finish_reason": "stop"}


def test_each_row_is_rendered_with_and_records_its_variant(tmp_path, target_dir, tok):
    config = config_for(target_dir, MIX)
    prepare_dir = tmp_path / "prepare"
    prepare(config.target, config.data, prepare_dir)
    shards = load_shards(prepare_dir)
    variants = _mix(config)
    stage = tmp_path / "regen"
    keys = {s.name: f"k{s.index}" for s in shards}
    client = RecordingClient(tok)
    rows: dict[str, str] = {}
    for s in shards:
        m = regenerate_shard(
            client, tok, prepare_dir, stage, s, keys[s.name], config.regenerate, 256, variants=variants
        )
        t = pq.read_table(io.BytesIO(shard_paths(stage, s)[0].read_bytes())).to_pydict()
        assert Counter(t["template_variant"]) == Counter(m["stats"]["template_variants"])
        conversations = load_conversations(prepare_dir, s)
        for row, ids, variant in zip(t["row"], t["input_ids"], t["template_variant"]):
            from eyrie.stages.regenerate.conversation import conversation_fingerprint

            assert variant == conversation_variant(
                config.regenerate, conversation_fingerprint(conversations[row - s.start])
            )
            rows[tok.decode(ids)] = variant
    assert set(rows.values()) == {"default", "thinking"}
    for text, variant in rows.items():  # each row's prompts opened the think block exactly when its variant does
        assert ("<|assistant|><think>" in text) == (variant == "thinking"), text
    assert all(p.endswith("<think>") for p in client.prompts if "<think>" in p)
    m = assemble(stage, prepare_dir, shards, keys, "stage", config.regenerate)
    assert m["stats"]["template_variants"] == dict(sorted(Counter(rows.values()).items()))
    assert len(json.loads((stage / "template_variants.json").read_text())) == m["num_samples"]
    # A shard told to draw a variant it was given no switches for refuses rather than render the default.
    with pytest.raises(RegenerationError, match="no chat_template_kwargs"):
        regenerate_shard(client, tok, prepare_dir, tmp_path / "other", shards[0], "k", config.regenerate, 256)
