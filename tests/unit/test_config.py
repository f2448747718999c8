"""Config errors name the offending key and say how to fix it; fingerprints are stable and section-specific."""

from __future__ import annotations

import pytest
from conftest import config_dict

from eyrie.config import load_config, parse_config
from eyrie.errors import ConfigError


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "cfg.yaml")
    return str(info.value)


def test_valid_config_round_trips(tmp_path):
    config = parse_config(config_dict(tmp_path / "target", layer_ids=[2, 4, 5]))
    assert config.data.shard_size == 8
    assert config.extraction.layer_ids == [2, 4, 5]
    # max_model_len defaults to data.max_length + 1: the longest sample plus the one token extraction generates
    assert config.max_model_len == config.data.max_length + 1 == 257
    assert parse_config(config_dict(tmp_path / "target", max_model_len=300)).max_model_len == 300


def test_unknown_key_is_named(tmp_path):
    data = config_dict(tmp_path / "t")
    data["data"]["shard_sise"] = 8
    msg = _error(data)
    assert "unknown key `data.shard_sise`" in msg
    assert "cfg.yaml" in msg

    data = config_dict(tmp_path / "t")
    data["extractoin"] = {}
    assert "unknown key `extractoin`" in _error(data)


def test_wrong_type_is_named(tmp_path):
    data = config_dict(tmp_path / "t")
    data["data"]["shard_size"] = "lots"
    msg = _error(data)
    assert "`data.shard_size`" in msg and "'lots'" in msg

    data = config_dict(tmp_path / "t")
    data["target"]["dtype"] = "float64"
    assert "`target.dtype`" in _error(data)

    data = config_dict(tmp_path / "t")
    data["data"]["eval_fraction"] = 1.5
    assert "`data.eval_fraction`" in _error(data)


def test_missing_required_key_is_named(tmp_path):
    data = config_dict(tmp_path / "t")
    del data["target"]
    assert "missing key `target`" in _error(data)
    data = config_dict(tmp_path / "t")
    del data["data"]["source"]
    assert "missing key `data.source`" in _error(data)


def test_duplicate_layer_ids_rejected(tmp_path):
    msg = _error(config_dict(tmp_path / "t", layer_ids=[2, 4, 4]))
    assert "extraction.layer_ids" in msg and "duplicates" in msg
    msg = _error(config_dict(tmp_path / "t", layer_ids=[-1, 2, 4]))
    assert "extraction.layer_ids" in msg and "negative" in msg
    assert "extraction.layer_ids" in _error(config_dict(tmp_path / "t", layer_ids=[]))


def test_non_loopback_host_needs_api_key_env(tmp_path):
    data = config_dict(tmp_path / "t", extraction={"host": "0.0.0.0"})
    msg = _error(data)
    assert "extraction.host" in msg and "extraction.api_key_env" in msg
    for host in ("127.0.0.1", "localhost", "::1"):
        assert parse_config(config_dict(tmp_path / "t", extraction={"host": host})).extraction.host == host
    ok = parse_config(config_dict(tmp_path / "t", extraction={"host": "0.0.0.0", "api_key_env": "EYRIE_KEY"}))
    assert ok.extraction.api_key_env == "EYRIE_KEY"


def test_server_env_and_vllm_version(tmp_path):
    """extraction.server_env holds text (YAML numbers become it); names, a key written into the config, a bool, and
    target.vllm_version's specifier are checked when the config loads."""
    data = config_dict(tmp_path / "t", extraction={"server_env": {"VLLM_X": 1800, "NCCL_Y": "1", "F": 0.5}})
    data["target"]["vllm_version"] = ">=0.18,<1"
    config = parse_config(data)
    assert config.extraction.server_env == {"VLLM_X": "1800", "NCCL_Y": "1", "F": "0.5"}
    assert config.target.vllm_version == ">=0.18,<1"
    refused = {
        "NOT-A-NAME": ("1", "not an environment variable name"),
        "VLLM_API_KEY": ("k", "extraction.api_key_env"),
        "VLLM_FLAG": (True, "quote it"),
        "VLLM_LIST": ([1], "quote it"),
    }
    for name, (value, why) in refused.items():
        msg = _error(config_dict(tmp_path / "t", extraction={"server_env": {name: value}}))
        assert "`extraction.server_env`" in msg and why in msg, msg
    data = config_dict(tmp_path / "t")
    data["target"]["vllm_version"] = "0.18+"
    msg = _error(data)
    assert "`target.vllm_version`" in msg and "not a version specifier" in msg


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(listy)


def test_demo_config_is_valid():
    from conftest import REPO

    from eyrie.target.tiny import TINY_TARGETS

    config = load_config(REPO / "configs" / "demo.yaml")
    assert config.target.tiny in TINY_TARGETS


def test_fingerprint_stable_and_section_specific(tmp_path):
    a = parse_config(config_dict(tmp_path / "t"))
    b = parse_config(config_dict(tmp_path / "t"))
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint("data") == b.fingerprint("data")
    c = parse_config(config_dict(tmp_path / "t", train={"epochs": 7}))
    assert c.fingerprint("data", "target") == a.fingerprint("data", "target")
    assert c.fingerprint("train") != a.fingerprint("train")
    assert c.fingerprint() != a.fingerprint()


def test_tiny_choices_are_the_tiny_targets():
    """The config's `tiny` choices (a Literal, so the Prefect form offers them) are exactly what eyrie.target.tiny
    builds."""
    from typing import get_args

    from eyrie.config import TargetConfig
    from eyrie.target.tiny import TINY_TARGETS

    choices = next(a for a in get_args(TargetConfig.model_fields["tiny"].annotation) if a is not type(None))
    assert set(get_args(choices)) == set(TINY_TARGETS)


def test_every_config_field_has_a_description():
    """The Prefect form shows each field's description: none may be bare."""
    from pydantic import BaseModel

    from eyrie.config import PipelineConfig

    def bare(model: type[BaseModel], prefix: str = "") -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                out += bare(field.annotation, f"{prefix}{name}.")
            elif not field.description:
                out.append(prefix + name)
        return out

    assert bare(PipelineConfig) == []


def test_cross_references_resolve_at_load(tmp_path):
    """A name one section gives for another's entry must resolve when the config loads, not in the stage that reads
    it (a `template_mix` naming an undeclared variant failed in regeneration, after the target loaded)."""
    variants = [{"name": "thinking", "chat_template_kwargs": {"enable_thinking": True}}]
    ok = config_dict(
        tmp_path,
        regenerate={
            "enabled": True,
            "template_mix": [{"variant": "default", "weight": 1}, {"variant": "thinking", "weight": 1}],
        },
        evaluate={"template_variants": variants},
    )
    assert [s.variant for s in parse_config(ok).regenerate.template_mix] == ["default", "thinking"]
    cases = {
        "'thinkin' is not a template variant; known: 'default', 'thinking'": (
            [{"variant": "thinkin", "weight": 1}],
            variants,
        ),
        "'thinking' twice": ([{"variant": "thinking", "weight": 1}, {"variant": "thinking", "weight": 2}], variants),
        "reserves": ([{"variant": "default", "weight": 1}], [{"name": "default", "chat_template_kwargs": {"x": 1}}]),
        "two variants are named 'thinking'": (None, variants * 2),
    }
    for message, (mix, declared) in cases.items():
        bad = config_dict(
            tmp_path, regenerate={"enabled": True, "template_mix": mix}, evaluate={"template_variants": declared}
        )
        with pytest.raises(ConfigError, match=message):
            parse_config(bad)
    sets = [{"name": "mt", "path": "a.jsonl"}, {"name": "mt", "path": "b.jsonl"}]
    with pytest.raises(ConfigError, match="evaluate.prompt_sets: two sets are named 'mt'"):
        parse_config(config_dict(tmp_path, evaluate={"prompt_sets": sets}))
