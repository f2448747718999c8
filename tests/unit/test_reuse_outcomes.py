"""Reuse judged by outcomes: on a copy of a finished run, every declared input of every stage (eyrie.run.identity
STAGES: config fields, the kinds of input files, the inherited environment, installed versions, the upstream values a
stage is made of) is changed alone, and the plan's decisions are taken as the flow takes them, with no server: which
stages are redone (a manifest that no longer holds, a shard `pending`, a running server not reused) and which are
reused. Each input must redo exactly the decisions whose declared stages it shapes, directly or through an upstream
key (`UPSTREAM`), and reuse every other.

The cases are generated from the declaration: a new config field, file kind, version or upstream name gets a case
automatically, and one with no mutation rule here fails `test_every_declared_input_has_a_mutation_rule`.

The finished run is built in-process: prepare for real on the tiny target, every extraction shard through the
extraction code with a stand-in client (tests/unit/test_extract_unit.py's), regeneration shard and assembly
manifests, and the later stages' manifests under the keys the flow computes. What a redone stage would write is not
modelled: a decision downstream of a redone stage follows its new key (vocab follows prepare's key), not its new
content (extraction follows the prepared shards' content, which only a real prepare changes). Regeneration's
decisions are taken as the flow takes them with `regenerate.enabled`."""

from __future__ import annotations

import inspect
import os
import shutil
from dataclasses import replace
from itertools import islice
from pathlib import Path

import pytest
from conftest import config_dict
from test_extract_resume import REPORT
from test_extract_unit import HIDDEN, LAYERS, FakeClient
from test_identity import SPECIAL, _section, changed_value, leaves

from eyrie.config import PipelineConfig, parse_config
from eyrie.run import identity
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.folder import RunFolder
from eyrie.run.identity import NOT_SHAPING, OUTPUT_PICKS, STAGES
from eyrie.run.manifest import finished_manifest
from eyrie.stages.evaluate import draft_tokens_key, evaluate_key, evaluation_sets
from eyrie.stages.export import export_key
from eyrie.stages.extract.plan import ExtractionPlan
from eyrie.stages.extract.shard import extract_shard
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.prepare import iter_eval_prompts, load_shards, prepare_key
from eyrie.stages.prepare.stage import prepare
from eyrie.stages.regenerate.plan import RegenerationPlan
from eyrie.stages.regenerate.shard import shard_paths
from eyrie.stages.train.trainer import train_key, untrained_key
from eyrie.stages.vocab import vocab_key
from eyrie.vllm.spec import ServerSpec

# The decisions a run takes, each with the declared stages whose keys it compares (its own) and the decisions whose
# keys its key is made of. `server.outputs@trained` / `@current`: what the server serving that drafter computes.
OWN: dict[str, set[str]] = {
    "prepare": {"prepare"},
    "regenerate": {"regenerate.shard"},
    "regenerate.assembly": {"regenerate"},
    "extract": {"extract"},  # shards that need the target
    "extract.layout": {"extract.layout"},  # shards whose manifest (or pack) is written again, from disk or not
    "vocab": {"vocab"},
    "train": {"train", "train.stop"},
    "untrained": {"untrained"},
    "export": {"export"},
    "evaluate.trained": {"evaluate"},
    "evaluate.current": {"evaluate"},
    "draft_tokens": {"draft_tokens"},
    "server.extraction": {"server.extraction"},
    "server.serving": {"server.serving"},
}
UPSTREAM: dict[str, set[str]] = {
    "regenerate.assembly": {"regenerate"},
    "extract.layout": {"extract"},
    "vocab": {"prepare"},
    "train": {"extract", "vocab"},
    "untrained": {"vocab"},
    "export": {"train", "server.outputs@trained"},
    "evaluate.trained": {"export", "server.outputs@evaluated"},
    "evaluate.current": {"server.outputs@current"},
    "draft_tokens": {"evaluate.trained"},
}
# The upstream values of the declaration: each computed by a decision of this test (its key or output), or changed by
# a rule (`UPSTREAM_RULES`), or what every run fixes (a drafter's label).
CHAINED = {
    "data": "prepare's key (vocab), extraction's content keys (train)",
    "vocab": "vocab's key",
    "aux": "preflight's aux layer ids: a rule",
    "lineage": "train's lineage key",
    "train": "train's key",
    "trained": "the trained drafter's evaluation key",
    "content": "extraction's content key",
    "shards": "regeneration's shard keys",
    "spec": "the server settings: config fields",
    "server": "server.outputs of the served drafter",
    "label": "the drafter's role in the evaluation: fixed",
    "drafter_id": "the drafter's export key (trained) or version name (current): follows export",
    "prompts": "prepare's held-out rows: evaluate.num_prompts and data fields",
    "tokenizer": "the tokenizer's files: the tokenizer file kind",
    "template": "the tokenizer's files: the tokenizer file kind",
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_llama):
    """A finished run (see the module's docstring): its folder, target, data file and current drafter."""
    root = tmp_path_factory.mktemp("finished")
    target = root / "target"
    shutil.copytree(tiny_llama, target)
    (target / "tokenization_tiny.py").write_text("VOCAB = {}\n")
    data = root / "chat.jsonl"
    from conftest import DEMO_DATA

    shutil.copy(DEMO_DATA, data)
    current = root / "promoted" / "v1"
    current.mkdir(parents=True)
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64, 64)}, str(current / "model.safetensors"))
    (current / "config.json").write_text('{"speculators_model_type": "eagle3"}')
    base = config_dict(
        target, source=data, max_samples=12, shard_size=6, promotion={"warm_start": True}, evaluate={"num_prompts": 2}
    )
    base["data"]["eval_fraction"] = 0.2
    config = parse_config(base)
    run = RunFolder(root / "run")
    run.ensure()
    prepare(config.target, config.data, run.prepare)
    plan = ExtractionPlan(config, run, REPORT, load_shards(run.prepare))
    client = FakeClient(run.extract / "staging")
    extra = {"sample_key": plan.sample_key} if "sample_key" in inspect.signature(extract_shard).parameters else {}
    for shard in plan.shards:
        extract_shard(
            client,
            run.prepare,
            shard,
            plan.keys[shard.name],
            run.hidden_states,
            plan.manifest_path(shard),
            LAYERS,
            HIDDEN,
            concurrency=2,
            log=lambda *_: None,
            **extra,
        )
    keys = decision_keys(config, run, REPORT, current)
    regen = RegenerationPlan(config, run, REPORT)
    for shard in regen.shards:  # a regenerated shard: its rows file and manifest
        rows, manifest = shard_paths(regen.dir, shard)
        rows.parent.mkdir(parents=True, exist_ok=True)
        rows.write_bytes(b"rows")
        atomic_write_json(manifest, {"key": regen.keys[shard.name], "bytes": 4, "server_error_rows": []})
    atomic_write_json(regen.dir / "manifest.json", {"key": keys["regenerate.assembly"], "files": {}})
    for stage in ("vocab", "train", "export"):
        atomic_write_json(run.manifest(stage), {"key": keys[stage], "files": {}})
    (run.train / f"untrained-{keys['untrained']}").mkdir(parents=True)
    (run.train / f"untrained-{keys['untrained']}" / "model.safetensors").write_bytes(b"w")
    run.evaluate.mkdir(parents=True, exist_ok=True)
    for label in ("trained", "current"):
        atomic_write_json(run.evaluate / f"{label}.json", {"key": keys[f"evaluate.{label}"], "files": {}})
    atomic_write_json(run.evaluate / "draft_tokens.json", {"key": keys["draft_tokens"], "files": {}})
    decided = decide(config, run, REPORT, current, keys)
    assert not any(decided.values()), f"the finished run is not finished: {decided}"
    pristine = root / "pristine"
    shutil.copytree(run.root, pristine, symlinks=True)
    return {
        "root": root,
        "run": run,
        "pristine": pristine,
        "target": target,
        "data": data,
        "current": current,
        "base": base,
        "keys": keys,
    }


def decision_keys(
    config: PipelineConfig, run: RunFolder, report: PreflightReport, current: Path, plans: tuple | None = None
) -> dict:
    """Every decision's key, computed as flows/pipeline.py computes it (the current drafter also the warm start's
    base, `promotion.warm_start`). `plans`: regeneration's and extraction's, when already made."""
    pk = prepare_key(config.target, config.data, run.fingerprints)
    regen, plan = plans or (
        RegenerationPlan(config, run, report),
        ExtractionPlan(config, run, report, load_shards(run.prepare)),
    )
    warm = str(current) if config.promotion.warm_start else None
    aux = report.aux_layer_ids
    vk = vocab_key({"key": pk}, config.vocab.draft_vocab_size, report.vocab_size, warm)
    tk = train_key(config, [plan.data_keys[s.name] for s in plan.shards], vk, aux, warm)
    spec = ServerSpec.for_serving(config)
    ek = export_key(config, tk, aux, spec.output_identity())
    prompts = list(islice(iter_eval_prompts(run.prepare), config.evaluate.num_prompts))
    sets = evaluation_sets(config)
    exported = run.export / "drafter"  # where export writes it: the path the served spec names
    trained = evaluate_key(config, "trained", ek, prompts, replace(spec, drafter=str(exported)).output_identity(), sets)
    served_current = replace(spec, drafter=str(current))
    return {
        "prepare": pk,
        "regenerate": regen.keys,
        "regenerate.assembly": regen.key,
        "extract": plan.keys,
        "vocab": vk,
        "train": tk,
        "untrained": untrained_key(config, vk, aux),
        "export": ek,
        "evaluate.trained": trained,
        "evaluate.current": evaluate_key(
            config, "current", current.name, prompts, served_current.output_identity(), sets
        ),
        "draft_tokens": draft_tokens_key(config, trained),
        "server.extraction": plan.spec.fingerprint(),
        "server.serving": served_current.fingerprint(),
    }


def decide(config: PipelineConfig, run: RunFolder, report: PreflightReport, current: Path, recorded: dict) -> dict:
    """Each decision: what is redone (pending shards' names, True for a stage), as the flow decides it."""
    regen = RegenerationPlan(config, run, report)
    plan = ExtractionPlan(config, run, report, load_shards(run.prepare))
    keys = decision_keys(config, run, report, current, (regen, plan))
    regen_dir = run.stage("regenerate")
    return {
        "prepare": not finished_manifest(run.prepare / "manifest.json", keys["prepare"]),
        "regenerate": sorted(s.name for s in regen.pending()),
        "regenerate.assembly": not finished_manifest(regen_dir / "manifest.json", keys["regenerate.assembly"]),
        "extract.layout": sorted(
            s.name for s in plan.shards if (read_json(plan.manifest_path(s)) or {}).get("key") != plan.keys[s.name]
        ),
        "extract": sorted(s.name for s in plan.pending()),
        **{s: not finished_manifest(run.manifest(s), keys[s]) for s in ("vocab", "train", "export")},
        "untrained": not (run.train / f"untrained-{keys['untrained']}" / "model.safetensors").exists(),
        **{
            f"evaluate.{label}": not finished_manifest(run.evaluate / f"{label}.json", keys[f"evaluate.{label}"])
            for label in ("trained", "current")
        },
        "draft_tokens": not finished_manifest(run.evaluate / "draft_tokens.json", keys["draft_tokens"]),
        # A running server is reused only under the fingerprint it was started with (VllmServer.ensure).
        "server.extraction": keys["server.extraction"] != recorded["server.extraction"],
        "server.serving": keys["server.serving"] != recorded["server.serving"],
    }


def expected(shaped: set[str], drafter_only: bool = False, drafting: bool = False) -> set[str]:
    """The decisions an input shaping the declared stages `shaped` must redo. `drafter_only`: the input is the
    current drafter's files, so the trained drafter's server computes what it did. `drafting`: the input shapes
    only a server that drafts (`ServerSpec.output_identity` counts it with a drafter): export keys on the server
    serving the target alone (flows/pipeline.py), so it is not redone."""
    marks = set(shaped)
    if "server.outputs" in shaped:
        marks |= {"server.outputs@current"} | (set() if drafter_only else {"server.outputs@evaluated"})
        marks |= set() if drafter_only or drafting else {"server.outputs@trained"}
    out: set[str] = set()
    changed = True
    while changed:
        changed = False
        for d in OWN:
            if d not in out and (OWN[d] & marks or UPSTREAM.get(d, set()) & (out | marks)):
                out.add(d)
                changed = True
    return out


def _rewrite(path: Path, data: bytes) -> None:
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _restore(finished) -> None:
    """The finished run as it was: a plan that finds a shard pending may clear what it cannot vouch for."""
    root = finished["run"].root
    shutil.rmtree(root)
    shutil.copytree(finished["pristine"], root, symlinks=True)


def _check(finished, config, label: str, want: set[str], report: PreflightReport = REPORT) -> None:
    try:
        decided = decide(config, finished["run"], report, finished["current"], finished["keys"])
    finally:
        _restore(finished)
    redone = {d for d, v in decided.items() if v}
    assert redone == want, f"{label}: redone {sorted(redone)}, shaped {sorted(want)}"


# Config fields a server counts only while it drafts (`ServerSpec.output_identity`).
DRAFTING = {"evaluate.num_speculative_tokens"}


# Mutation rules: for each kind of input file, files of the finished run's target (or drafter) and how to change them.
def _edit(path: Path) -> bytes:
    raw = path.read_bytes()
    if path.suffix == ".safetensors":
        mid = len(raw) // 2  # inside the tensor data: the header and the size stay
        return raw[:mid] + bytes([raw[mid] ^ 0xFF]) + raw[mid + 1 :]
    if b"{%" in raw:
        return raw.replace(b"{%", b"{%-", 1)  # a chat template
    return raw.rstrip() + b"\n\n"


FILE_RULES: dict[str, list[str]] = {
    "target": ["model.safetensors", "config.json"],
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "tokenization_tiny.py"],
    "generation_config": ["generation_config.json"],
    "drafter": ["<current>/model.safetensors"],
}
VERSION_RULE = "monkeypatch eyrie.run.identity.installed_version"
ENVIRONMENT_RULE = {"VLLM_ATTENTION_BACKEND": "FLEX_ATTENTION"}
# Upstream values changed by a rule of their own: preflight's resolved layers and sizes, the data's content, a
# prepared shard's rows.
UPSTREAM_RULES = ("aux", "captured", "target_vocab_size", "source", "shard")
# Config fields that enter the keys through something else, each case named: the rule that covers it.
ENTERS_THROUGH = {
    "extraction.layer_ids": "captured (preflight resolves the layer ids)",
    "target.tiny": "the target file kind (what was built)",
    "target.vllm_version": "the vllm version rule",
    "promotion.dir": "the drafter file kind (the current drafter by content)",
    "promotion.warm_start": "the drafter file kind (the base by content)",
    "evaluate.prompt_sets": "prompts (evaluation_sets reads the files)",
    "regenerate.enabled": "which data extraction reads: the shard rule",
}


def test_every_declared_input_has_a_mutation_rule():
    kinds = {k for d in STAGES.values() for k in d.files}
    assert kinds <= set(FILE_RULES), f"file kinds with no mutation rule: {sorted(kinds - set(FILE_RULES))}"
    upstream = {u for d in STAGES.values() for u in d.upstream}
    missing = upstream - set(CHAINED) - set(UPSTREAM_RULES)
    assert not missing, f"upstream inputs with no mutation rule and no decision computing them: {sorted(missing)}"
    covered = {s for ss in OWN.values() for s in ss} | {"server.outputs"}
    assert set(STAGES) <= covered, f"stages no decision covers: {sorted(set(STAGES) - covered)}"
    assert set(ENTERS_THROUGH) <= set(NOT_SHAPING)


def test_each_config_field_redoes_exactly_the_work_it_shapes(finished):
    base = finished["base"]
    config = parse_config(base)
    dumped = config.model_dump(mode="json")
    for path, ann in leaves(PipelineConfig).items():
        if path in ENTERS_THROUGH:
            continue
        section, name = _section(dumped, path)
        current = section[name]
        if path == "data.source":  # the same data at another path: nothing to redo
            other = finished["root"] / "moved" / finished["data"].name
            other.parent.mkdir(exist_ok=True)
            shutil.copy(finished["data"], other)
            values = [str(other)]
        elif path == "target.model":  # the same target at another path
            other = finished["root"] / "moved-target"
            if not other.exists():
                shutil.copytree(finished["target"], other)
            values = [str(other)]
        elif path == "train.hidden_states":
            continue  # online: no extraction decision at all (the trainer asks the server), see test_online
        else:
            values = changed_value(path, ann, current) if path in SPECIAL or ann is not None else []
        for value in values:
            full = parse_config(base).model_dump(mode="json")
            field_section, _ = _section(full, path)
            field_section[name] = value
            shaped = {s for s, d in STAGES.items() if path in d.config}
            if path in OUTPUT_PICKS and OUTPUT_PICKS[path](value) == OUTPUT_PICKS[path](current):
                shaped = {s for s in shaped if not STAGES[s].outputs_only}
            drafting = path in DRAFTING
            _check(finished, parse_config(full), f"{path} = {value!r}", expected(shaped, drafting=drafting))


def test_each_input_file_redoes_exactly_the_work_that_reads_it(finished):
    config = parse_config(finished["base"])
    for kind, names in FILE_RULES.items():
        shaped = {s for s, d in STAGES.items() if kind in d.files}
        for name in names:
            path = (
                finished["current"] / name.split("/", 1)[1]
                if name.startswith("<current>")
                else finished["target"] / name
            )
            original = path.read_bytes()
            new = _edit(path)
            assert new != original, name
            _rewrite(path, new)
            try:
                _check(finished, config, f"{name} ({kind})", expected(shaped, drafter_only=kind == "drafter"))
            finally:
                _rewrite(path, original)
    _check(finished, config, "restored", set())


def test_each_output_shaping_variable_and_version_redoes_exactly_the_work_it_shapes(finished, monkeypatch):
    config = parse_config(finished["base"])
    for name, value in ENVIRONMENT_RULE.items():
        monkeypatch.setenv(name, value)
        _check(finished, config, name, expected({s for s, d in STAGES.items() if d.environment}))
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # scheduling only
    _check(finished, config, "VLLM_LOGGING_LEVEL", set())
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    real = identity.installed_version
    for dist in sorted({v for d in STAGES.values() for v in d.versions}):
        monkeypatch.setattr(identity, "installed_version", lambda d, dist=dist: "9.9.9" if d == dist else real(d))
        _check(finished, config, f"{dist} upgraded", expected({s for s, d in STAGES.items() if dist in d.versions}))
    monkeypatch.setattr(identity, "installed_version", real)


def test_each_upstream_value_redoes_exactly_the_work_made_of_it(finished):
    config = parse_config(finished["base"])
    run = finished["run"]

    def shaped_by(name: str) -> set[str]:
        return {s for s, d in STAGES.items() if name in d.upstream}

    # Preflight's resolved values: the aux layers (training, the drafter's shape, its export), the captured layers
    # (extraction and its server), the target's vocabulary size (vocab).
    _check(finished, config, "aux", expected(shaped_by("aux")), replace(REPORT, aux_layer_ids=[1, 2, 4]))
    captured = replace(REPORT, captured_layer_ids=[1, 3, 4, 5][:LAYERS])
    _check(finished, config, "captured", expected(shaped_by("captured") | {"server.extraction"}), captured)
    _check(
        finished, config, "target_vocab_size", expected(shaped_by("target_vocab_size")), replace(REPORT, vocab_size=600)
    )
    # The data's content: one more conversation in the source file.
    data = finished["data"]
    original = data.read_bytes()
    _rewrite(data, original + original.splitlines(keepends=True)[0])
    try:
        _check(finished, config, "source", expected(shaped_by("source")))
    finally:
        _rewrite(data, original)
    # A prepared shard's fingerprint (what prepare would write anew): that shard alone is regenerated, and its
    # hidden states are vouched for under the new key from the files on disk (made for the same token ids, which
    # the files are checked against), with no target; training keys on the new content key.
    shards_json = run.prepare / "shards.json"
    raw = shards_json.read_bytes()
    listed = read_json(shards_json)
    first = listed[0] if isinstance(listed, list) else listed["shards"][0]
    first["fingerprint"] = "0" * len(first["fingerprint"])
    _rewrite(shards_json, __import__("json").dumps(listed).encode())
    try:
        decided = decide(config, run, REPORT, finished["current"], finished["keys"])
        _restore(finished)
        name = load_shards(run.prepare)[0].name
        assert decided["regenerate"] == [name] and decided["extract.layout"] == [name], decided
        assert decided["extract"] == [], decided
        assert decided["train"] and not decided["vocab"], decided  # (prepare's own files changed: it is redone)
    finally:
        _rewrite(shards_json, raw)
    _check(finished, config, "restored", set())
