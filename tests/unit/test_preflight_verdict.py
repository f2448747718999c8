"""Preflight's verdict on the target, vLLM and the config is a keyed result (eyrie/stages/preflight/verdict.py,
`eyrie.run.identity.VERDICTS`): a stamped run folder holding a passing verdict under the same key reuses it without
importing vLLM; every field of the sections it reads, the target's files and tokenizer files change its key; the
node's checks still run every time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import config_dict
from test_identity import _rewrite, _section, _with, changed_value, leaves

from eyrie.config import PipelineConfig, parse_config
from eyrie.run.folder import RunFolder
from eyrie.run.identity import VERDICTS
from eyrie.stages.preflight.check import run_preflight
from eyrie.stages.preflight.verdict import VERDICT, verdict_key

ROOT = Path(__file__).resolve().parents[2]
# Values for fields test_identity's generic change does not cover (yet).
SPECIAL = {
    "target.model": lambda tmp: [str(tmp / "elsewhere")],
    "evaluate.prompt_sets": lambda tmp: [[{"name": "mt", "path": "prompts.jsonl"}]],
    "evaluate.template_variants": lambda tmp: [[{"name": "thinking", "chat_template_kwargs": {"thinking": True}}]],
}


def test_a_passing_verdict_is_reused_by_a_later_run_without_importing_vllm(tiny_llama, tmp_path):
    data = config_dict(tiny_llama)
    run = RunFolder(tmp_path / "run")
    run.ensure()
    first = run_preflight(parse_config(data), run.root, serve=False)
    assert not first.verdict_reused and (run.root / VERDICT).is_file()

    # A later run is a new process: it must reach the same report with no vLLM import.
    (tmp_path / "config.json").write_text(json.dumps(data))
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from eyrie.config import parse_config\n"
        "from eyrie.stages.preflight.check import run_preflight\n"
        f"config = parse_config(json.loads(Path({str(tmp_path / 'config.json')!r}).read_text()))\n"
        f"r = run_preflight(config, Path({str(run.root)!r}), tokens=1000, serve=False)\n"
        "print(json.dumps({'reused': r.verdict_reused, 'vllm': 'vllm' in sys.modules, 'report': r.as_dict()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True, env=os.environ.copy()
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["reused"] and not got["vllm"], got
    assert got["report"]["captured_layer_ids"] == first.captured_layer_ids
    assert got["report"]["target_facts"] == first.target_facts
    assert got["report"]["estimated_bytes"]  # the disk check still ran, on this call's token count

    # A failing verdict is never kept: the next call checks again.
    bad = parse_config({**data, "vocab": {"draft_vocab_size": 10**7}})
    assert run_preflight(bad, run.root, raise_on_failure=False, serve=False).failures
    assert not run_preflight(bad, run.root, raise_on_failure=False, serve=False).verdict_reused


def test_a_verdict_that_checked_serving_holds_for_a_run_that_does_not_serve_and_not_the_other_way(tiny_llama, tmp_path):
    config = parse_config(config_dict(tiny_llama))
    run = RunFolder(tmp_path / "run")
    run.ensure()
    assert not run_preflight(config, run.root, serve=False).verdict_reused
    # Serving was not checked: a run that serves checks again (and keeps that verdict)...
    serving = run_preflight(config, run.root, serve=True)
    assert not serving.verdict_reused and serving.verdict_key == verdict_key(config, serve=True)
    # ...which a run through extraction alone (`eyrie preflight --until extract`, a shard's node) then reuses.
    assert run_preflight(config, run.root, serve=False).verdict_reused


def test_eyrie_preflight_checks_serving_as_the_run_it_names_would(monkeypatch, tiny_llama, tmp_path):
    from flows import cli

    seen = []
    monkeypatch.setattr(
        "eyrie.stages.preflight.run_preflight", lambda config, run_dir, **kw: seen.append(kw["serve"]) or _Passed()
    )
    monkeypatch.setattr("eyrie.stages.preflight.report.report_text", lambda report: "preflight passed")
    (tmp_path / "c.json").write_text(json.dumps(config_dict(tiny_llama)))
    for until in ([], ["--until", "extract"], ["--until", "evaluate"]):
        assert cli.main(["preflight", "--config", str(tmp_path / "c.json"), "--run-dir", str(tmp_path), *until]) == 0
    assert seen == [True, False, True]


class _Passed:
    failures: list[str] = []

    def as_dict(self) -> dict:
        return {}


def test_the_node_checks_run_on_a_reused_verdict(tiny_llama, tmp_path, monkeypatch):
    import eyrie.stages.preflight.node as node

    run = RunFolder(tmp_path / "run")
    run.ensure()
    config = parse_config(config_dict(tiny_llama, train={"device": "cuda", "devices": 2}))
    monkeypatch.setattr(node, "gpu_count", lambda: 2)
    assert not run_preflight(config, run.root, serve=False).failures
    monkeypatch.setattr(node, "gpu_count", lambda: 1)  # a GPU lost since
    report = run_preflight(config, run.root, raise_on_failure=False, serve=False)
    assert report.verdict_reused and any("1 are visible here" in f for f in report.failures)


def test_the_verdict_key_holds_every_field_of_its_sections_and_the_targets_files(tiny_llama, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny_llama, target)
    base = {"target": {"model": str(target)}, "data": {"source": "d.jsonl"}, "vocab": {"draft_vocab_size": 256}}
    before = verdict_key(parse_config(base), serve=True)
    assert verdict_key(parse_config(base), serve=False) != before
    sections = VERDICTS["preflight"].sections
    dumped = parse_config(base).model_dump(mode="json")
    for path, ann in leaves(PipelineConfig).items():
        holder, name = _section(dumped, path)  # nested sections too (train.speed.*)
        current = holder[name]
        section = path.split(".")[0] if "." in path else ""
        for value in SPECIAL[path](tmp_path) if path in SPECIAL else changed_value(path, ann, current):
            changed = verdict_key(parse_config(_with(base, path, value)), serve=True) != before
            assert changed == (section in sections), f"{path} = {value!r}: the verdict key changed: {changed}"
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        original = (target / name).read_bytes()
        _rewrite(target / name, original[:-1] + bytes([original[-1] ^ 1]))
        assert verdict_key(parse_config(base), serve=True) != before, name
        _rewrite(target / name, original)
    (target / "README.md").write_text("a model card edit")
    assert verdict_key(parse_config(base), serve=True) == before


@pytest.mark.parametrize("variable", ["EYRIE_EAGLE3_COMPAT", "EYRIE_TEST_HIDE_EAGLE3"])
def test_the_variables_the_checks_read_are_in_the_key(tiny_llama, variable, monkeypatch):
    config = parse_config(config_dict(tiny_llama))
    monkeypatch.delenv(variable, raising=False)
    before = verdict_key(config, serve=True)
    monkeypatch.setenv(variable, "0")
    assert verdict_key(config, serve=True) != before
