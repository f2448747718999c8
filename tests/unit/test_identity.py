"""Every key changes exactly when something its declaration (eyrie.run.identity.STAGES) names changes.

The test walks PipelineConfig recursively and changes each field alone (a new field with no declaration fails it),
then each kind of input file (the target's weights, config, tokenizer and generation config files, documentation,
a drafter's weights), and computes every stage's key through the stage's own key function."""

from __future__ import annotations

import json
import os
import shutil
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from eyrie.config import PipelineConfig, parse_config
from eyrie.run.identity import NOT_SHAPING, OUTPUT_PICKS, STAGES, output_server_args, output_server_env
from eyrie.stages.evaluate import draft_tokens_key, evaluate_key
from eyrie.stages.export import export_key
from eyrie.stages.extract.plan import content_key, shard_key
from eyrie.stages.prepare import Shard, prepare_key
from eyrie.stages.regenerate.plan import shard_key as regenerate_shard_key
from eyrie.stages.regenerate.plan import stage_key as regenerate_stage_key
from eyrie.stages.train.trainer import LINEAGE_CHARS, train_key, untrained_key
from eyrie.stages.vocab import vocab_key
from eyrie.target.metadata import stage_key
from eyrie.vllm.spec import ServerSpec

SHARD = Shard(0, 0, 8, "fp", 100)
SHARD.conversations = "conv"


def all_keys(config: PipelineConfig, drafter: Path) -> dict[str, str]:
    """Every declared stage's key, each through its own key function, with fixed upstream values."""
    serving = ServerSpec.for_serving(config, str(drafter))
    keys = {
        "prepare": prepare_key(config.target, config.data),
        "regenerate.shard": regenerate_shard_key("template", SHARD, config),
        "regenerate": regenerate_stage_key({"s0": "k0"}, config),
        "extract": content_key(config, [2, 4], SHARD),
        "extract.layout": shard_key("content", config),
        "vocab": vocab_key({"key": "data"}, config.vocab.draft_vocab_size, 1000, base=str(drafter)),
        "train": train_key(config, ["d0"], "vocab", [2], warm_start=str(drafter))[:LINEAGE_CHARS],
        "train.stop": stage_key("train.stop", config, lineage="lineage"),
        "untrained": untrained_key(config, "vocab", [2]),
        "export": export_key(config, "train", [2], "server"),
        "evaluate": evaluate_key(config, "trained", "drafter", [[{"role": "user", "content": "hi"}]], "server"),
        "draft_tokens": draft_tokens_key(config, "trained"),
        "server.outputs": serving.output_identity(),
        "server.serving": serving.fingerprint(),
        "server.extraction": ServerSpec.for_extraction(config, [2, 4], "/staging").fingerprint(),
    }
    assert set(keys) == set(STAGES), "a declared stage has no key function in this test"
    return keys


def leaves(model: type[BaseModel], prefix: str = "") -> dict[str, typing.Any]:
    """Every leaf field of the config model by dotted path, with its annotation."""
    out = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(leaves(ann, f"{prefix}{name}."))
        else:
            out[prefix + name] = ann
    return out


def declared(path: str) -> set[str]:
    return {s for s, d in STAGES.items() if path in d.config}


def test_every_field_is_declared():
    fields = set(leaves(PipelineConfig))
    shaping = {p for d in STAGES.values() for p in d.config}
    assert not shaping - fields, f"declared fields that do not exist: {sorted(shaping - fields)}"
    assert not shaping & set(NOT_SHAPING), f"declared both ways: {sorted(shaping & set(NOT_SHAPING))}"
    missing = fields - shaping - set(NOT_SHAPING)
    assert not missing, f"config fields with no declaration in eyrie.run.identity: {sorted(missing)}"
    assert set(NOT_SHAPING) <= fields


# Values for fields whose generic change would be invalid or meaningless; the rest are changed by type.
SPECIAL: dict[str, list] = {
    "train.speed.one_kv_length": [True, False],
    "train.speed.one_pointwise_config": [True, False],
    "extraction.host": ["localhost"],
    "extraction.api_key_env": ["EYRIE_TEST_KEY"],
    "extraction.gpu_memory_utilization": [0.5],
    "extraction.layer_ids": [[1, 2, 3]],
    "target.revision": ["v2"],
    "target.tiny": ["tiny-llama"],
    "target.vllm_version": [">=0.1"],
    "target.max_model_len": [4096],
    "data.subset": ["other"],
    "data.revision": ["v1"],
    "data.max_samples": [7],
    "train.mask_token_id": [5],
    "train.loggers": [["tensorboard"]],
    "evaluate.sweep_draft_tokens": [4],
    "evaluate.throughput_concurrency": [[2]],
    "evaluate.prompt_sets": [[{"name": "mt", "path": "/prompts/mt.jsonl"}]],
    "evaluate.template_variants": [[{"name": "thinking", "chat_template_kwargs": {"enable_thinking": True}}]],
    "promotion.dir": ["/promoted"],
    "regenerate.temperature_mix": [[{"temperature": 0.5, "weight": 1.0}]],
    "regenerate.template_mix": [[{"variant": "default", "weight": 1.0}]],
    "regenerate.temperature": [0.5],
    # one scheduling-only change (shapes the servers' identity only), one that changes what the target computes
    "extraction.server_args": [["--max-num-seqs", "4"], ["--kv-cache-dtype", "fp8"]],
    "extraction.server_env": [{"VLLM_LOGGING_LEVEL": "DEBUG"}, {"VLLM_ATTENTION_BACKEND": "FLEX_ATTENTION"}],
}


def changed_value(path: str, ann, value):
    if path in SPECIAL:
        return SPECIAL[path]
    origin = typing.get_origin(ann)
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if origin is typing.Literal:
        return [next(a for a in typing.get_args(ann) if a != value)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        ann = args[0]
        if typing.get_origin(ann) is typing.Literal:
            return [next(a for a in typing.get_args(ann) if a != value)]
    if ann is bool:
        return [not value]
    if ann is int:
        return [value + 1]
    if ann is float:
        return [value / 2 if value else 0.5]
    if ann is str:
        return [f"{value}-changed"]
    raise AssertionError(f"no change known for {path} ({ann}): add it to SPECIAL")


@pytest.fixture
def world(tmp_path, tiny_llama):
    """A local target, data file and drafter the test may change."""
    target = tmp_path / "target"
    shutil.copytree(tiny_llama, target)
    data = tmp_path / "data" / "chat.jsonl"
    data.parent.mkdir()
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64, 64)}, str(drafter / "model.safetensors"))
    (drafter / "config.json").write_text('{"speculators_model_type": "eagle3"}')
    base = {
        "target": {"model": str(target)},
        "data": {"source": str(data), "max_length": 256},
        "vocab": {"draft_vocab_size": 256},
    }
    return tmp_path, target, data, drafter, base


def _section(dumped: dict, path: str) -> tuple[dict, str]:
    """The dumped config's mapping that holds the field at dotted `path`, and the field's name in it."""
    *sections, name = path.split(".")
    for section in sections:
        dumped = dumped[section]
    return dumped, name


def _with(base: dict, path: str, value) -> dict:
    full = parse_config(base).model_dump(mode="json")
    section, name = _section(full, path)
    section[name] = value
    return full


def test_each_config_field_changes_exactly_the_keys_it_is_declared_for(world):
    tmp_path, target, data, drafter, base = world
    config = parse_config(base)
    before = all_keys(config, drafter)
    assert before == all_keys(config, drafter)  # stable
    dumped = config.model_dump(mode="json")
    for path, ann in leaves(PipelineConfig).items():
        section, name = _section(dumped, path)
        current = section[name]
        if path == "target.model":  # the same target at another path
            other = tmp_path / "moved" / "target"
            shutil.copytree(target, other)
            values = [str(other)]
        elif path == "data.source":  # the same data at another path
            other = tmp_path / "moved-data" / data.name
            other.parent.mkdir()
            shutil.copy(data, other)
            values = [str(other)]
        else:
            values = changed_value(path, ann, current)
        for value in values:
            after = all_keys(parse_config(_with(base, path, value)), drafter)
            changed = {s for s in STAGES if after[s] != before[s]}
            want = declared(path)
            if path in OUTPUT_PICKS and OUTPUT_PICKS[path](value) == OUTPUT_PICKS[path](current):
                want = {s for s in want if not STAGES[s].outputs_only}  # scheduling only: no output changes
            assert changed == want, f"{path} = {value!r}: changed {sorted(changed)}, declared {sorted(want)}"


def _rewrite(path: Path, data: bytes) -> None:
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_each_input_file_changes_exactly_the_keys_that_read_it(world):
    tmp_path, target, data, drafter, base = world
    config = parse_config(base)

    def flip(path: Path) -> bytes:
        raw = path.read_bytes()
        mid = len(raw) - 1000  # inside the tensor data: the header and the size stay
        return raw[:mid] + bytes([raw[mid] ^ 0xFF]) + raw[mid + 1 :]

    # The target's own code: a tokenizer module (named by tokenizer_config.json's auto_map, and by its file name), a
    # helper only it imports, and the model's code. Written before the keys are taken.
    (target / "tokenization_tiny.py").write_text("from .tiny_vocab import VOCAB\n")
    (target / "tiny_vocab.py").write_text("VOCAB = {}\n")
    (target / "modeling_tiny.py").write_text("class TinyModel: ...\n")
    (target / "chat_template.json").write_text('{"chat_template": "{{ messages }}"}')
    tok_config = target / "tokenizer_config.json"
    raw = json.loads(tok_config.read_text())
    tok_config.write_text(json.dumps({**raw, "auto_map": {"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]}}))
    before = all_keys(config, drafter)
    cases = {
        "target": [
            (target / "model.safetensors", flip),
            (target / "config.json", None),
            (target / "modeling_tiny.py", None),
        ],
        "tokenizer": [
            (target / "tokenizer.json", None),
            (target / "chat_template.jinja", None),
            (target / "chat_template.json", None),
            (target / "tokenizer_config.json", None),  # the chat template it holds
            (target / "tokenization_tiny.py", None),
            (target / "tiny_vocab.py", None),
        ],
        "generation_config": [(target / "generation_config.json", None)],
        "drafter": [(drafter / "model.safetensors", flip)],
    }
    # What a server computes is its whole identity: a running server, and the measurements and proofs made on one,
    # are not reused after its tokenizer (code and chat template included) or generation config changed.
    servers = {"server.outputs", "server.serving", "server.extraction"}
    for kind in ("tokenizer", "generation_config"):
        assert servers <= {s for s, d in STAGES.items() if kind in d.files}, kind
    for kind, files in cases.items():
        want = {s for s, d in STAGES.items() if kind in d.files}
        assert want, kind
        for path, change in files:
            original = path.read_bytes()
            new = change(path) if change else original.rstrip() + b"\n\n"
            assert new != original
            _rewrite(path, new)
            after = all_keys(config, drafter)
            _rewrite(path, original)
            changed = {s for s in STAGES if after[s] != before[s]}
            assert changed == want, f"{path.name} ({kind}): changed {sorted(changed)}, declared {sorted(want)}"
    assert all_keys(config, drafter) == before  # restored
    (target / "README.md").write_text("a model card edit")  # documentation shapes nothing
    assert all_keys(config, drafter) == before
    # nor does bytecode Python compiles from the folder's own code (the code itself is the target's identity)
    (target / "__pycache__").mkdir()
    (target / "__pycache__" / "modeling_tiny.cpython-311.pyc").write_bytes(b"\x00compiled")
    (target / "configuration_tiny.pyc").write_bytes(b"\x00compiled")
    assert all_keys(config, drafter) == before


def test_scheduling_flags_are_not_outputs():
    assert output_server_args(["--max-num-seqs", "4", "--kv-cache-dtype", "fp8", "--enable-prefix-caching"]) == [
        "--kv-cache-dtype",
        "fp8",
    ]
    assert output_server_args(["--max-num-batched-tokens=512", "--quantization", "fp8"]) == ["--quantization", "fp8"]
    assert output_server_env({"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_ATTENTION_BACKEND": "X"}) == {
        "VLLM_ATTENTION_BACKEND": "X"
    }


@pytest.fixture
def hub_model(monkeypatch):
    """A model repo in the hub cache's own layout with two commits; `main` at the first."""
    import json
    import uuid

    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = f"eyrie-test/model-{uuid.uuid4().hex[:8]}"
    root = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    weight_map = {"model.embed_tokens.weight": "w-1.safetensors", "model.layers.0.w": "w-2.safetensors"}
    for commit in ("a" * 40, "b" * 40):
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({"commit": commit}))
        (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        for name in set(weight_map.values()):
            (snap / name).write_bytes(commit.encode())
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("a" * 40)
    yield repo, root
    shutil.rmtree(root, ignore_errors=True)


def test_a_pinned_hub_target_asks_the_hub_once_per_process(hub_model, monkeypatch):
    from eyrie.config import TargetConfig
    from eyrie.target import metadata

    calls = []
    real = metadata.hub_commit
    monkeypatch.setattr(metadata, "hub_commit", lambda *a: calls.append(a) or real(*a))
    pinned = TargetConfig(model=hub_model[0], revision="a" * 40)
    keys = {content_key(parse_config({"target": pinned.model_dump(), "data": {"source": "/d"}}), [1], SHARD)}
    keys |= {metadata.target_identity(pinned) for _ in range(5)}
    assert len(calls) == 1
    metadata.target_identity(TargetConfig(model=hub_model[0]))  # a branch: asked each time (it may move)
    metadata.target_identity(TargetConfig(model=hub_model[0]))
    assert len(calls) == 3


def test_a_hub_targets_identity_and_verifier_are_its_pinned_commit(hub_model):
    from eyrie.config import TargetConfig
    from eyrie.stages.train.trainer import verifier_source
    from eyrie.target.metadata import target_identity

    repo, root = hub_model
    pinned = TargetConfig(model=repo, revision="a" * 40)  # what the run pinned `main` to at its start
    moving = TargetConfig(model=repo)
    before = target_identity(moving)
    assert target_identity(pinned) == before
    (root / "refs" / "main").write_text("b" * 40)  # a push to the hub
    assert target_identity(moving) != before and target_identity(pinned) == before
    # The trainer reads the verifier's borrowed tensors at the pinned commit, not the default branch.
    path = Path(verifier_source(pinned, {"embed_tokens.weight": "model.embed_tokens.weight"}))
    assert path.name == "a" * 40 and (path / "w-1.safetensors").read_bytes() == b"a" * 40


def test_a_changed_plateau_rule_keeps_the_checkpoints_and_decides_again(tmp_path):
    import json

    from eyrie.stages.train.trainer import adopt_lineage
    from eyrie.stages.train.validation import PLATEAU, VALIDATION

    def config(**train):
        return parse_config({"target": {"model": "/t"}, "data": {"source": "/d"}, "train": train})

    old = config(stop_on_plateau=True, plateau_patience=1, plateau_min_delta=0.01)
    new = config(stop_on_plateau=True, plateau_patience=2, plateau_min_delta=0.01)
    old_key, new_key = train_key(old, ["d"], "v", [2]), train_key(new, ["d"], "v", [2])
    assert old_key != new_key and old_key[:LINEAGE_CHARS] == new_key[:LINEAGE_CHARS]
    assert train_key(config(devices=4, log_every_steps=1), ["d"], "v", [2])[:LINEAGE_CHARS] == old_key[:16]
    save = tmp_path / old_key / "checkpoints"
    for epoch, acc in enumerate([0.5, 0.6, 0.6]):  # no gain at epoch 2: patience 1 stops there, patience 2 not
        (save / str(epoch)).mkdir(parents=True)
        (save / str(epoch) / VALIDATION).write_text(json.dumps({"full_acc_0_epoch": acc}))
    (save / PLATEAU).write_text(json.dumps({"epoch": 2, "best_epoch": 1}))
    adopt_lineage(tmp_path, new_key, new.train)
    moved = tmp_path / new_key / "checkpoints"
    assert (moved / "2" / VALIDATION).exists() and not (tmp_path / old_key).exists()  # nothing is trained again
    assert not (moved / PLATEAU).exists()  # patience 2: no plateau yet, training goes on from epoch 2
    adopt_lineage(tmp_path, old_key, old.train)  # and back: the plateau at epoch 2 again
    assert json.loads((tmp_path / old_key / "checkpoints" / PLATEAU).read_text())["epoch"] == 2


def test_status_of_an_older_format_run_folder_says_what_to_do(tmp_path):
    import json

    from eyrie import FORMAT_VERSION
    from eyrie.ops.status import format_status, run_status
    from eyrie.run.files import atomic_write_json
    from eyrie.run.folder import STAMP, RunFolder

    run = RunFolder(tmp_path / "run")
    run.ensure()
    atomic_write_json(run.manifest("vocab"), {"stage": "vocab", "key": "k", "files": {}})
    assert run_status(run)["stages"]["vocab"] == "done" and "format" not in run_status(run)
    (run.root / STAMP).write_text(json.dumps({"format_version": FORMAT_VERSION - 1, "eyrie_version": "0.0.9"}))
    status = run_status(run)
    assert status["stages"]["vocab"] == f"format {FORMAT_VERSION - 1}: not reused by this Eyrie"
    assert "use a new --run-dir" in format_status(status)


def test_each_inherited_output_variable_changes_exactly_the_keys_of_what_servers_compute(world, monkeypatch):
    """A variable exported in the shell that starts the flow reaches every server (the child allow-list): one that
    changes what vLLM computes (an attention backend) changes the keys declaring the environment, and so the
    current drafter's measurement is taken again; a scheduling-only one (named in SCHEDULING_ENV) or one of the
    process (the job scheduler's) changes none."""
    from eyrie.run.identity import SCHEDULING_ENV

    tmp_path, target, data, drafter, base = world
    config = parse_config(base)
    want = {s for s, d in STAGES.items() if d.environment}
    assert {"server.outputs", "server.serving", "server.extraction", "extract", "regenerate.shard"} <= want
    for name in ("VLLM_ATTENTION_BACKEND", "VLLM_LOGGING_LEVEL", "SLURM_JOB_ID", "TORCHINDUCTOR_COMPILE_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = all_keys(config, drafter)
    current = ServerSpec.for_serving(config, str(drafter)).output_identity()
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLEX_ATTENTION")
    after = all_keys(config, drafter)
    assert {s for s in STAGES if after[s] != before[s]} == want
    # The current drafter's measurement keys on its server's outputs: measured again before a promotion compares.
    assert ServerSpec.for_serving(config, str(drafter)).output_identity() != current
    assert evaluate_key(config, "current", "d", [], current) != evaluate_key(
        config, "current", "d", [], ServerSpec.for_serving(config, str(drafter)).output_identity()
    )
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND")
    # vLLM's own import sets TORCHINDUCTOR_COMPILE_THREADS in the process that imports it: scheduling, no key moves
    assert "TORCHINDUCTOR_COMPILE_THREADS" in SCHEDULING_ENV
    for name, value in (("VLLM_LOGGING_LEVEL", "DEBUG"), ("SLURM_JOB_ID", "7"), ("TORCHINDUCTOR_COMPILE_THREADS", "1")):
        monkeypatch.setenv(name, value)
    assert all_keys(config, drafter) == before


def test_every_inherited_prefix_is_declared_as_shaping_outputs_or_not():
    from eyrie.run.environment import PREFIXES
    from eyrie.run.identity import OUTPUT_ENV_PREFIXES, PROCESS_ENV_PREFIXES

    assert not set(OUTPUT_ENV_PREFIXES) & set(PROCESS_ENV_PREFIXES)
    missing = set(PREFIXES) - set(OUTPUT_ENV_PREFIXES) - set(PROCESS_ENV_PREFIXES)
    assert not missing, f"allow-listed prefixes with no declaration in eyrie.run.identity: {sorted(missing)}"


def _weights(path: Path, mib: int) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"embed": torch.arange(mib * (1 << 18), dtype=torch.float32)}, str(path))


def test_a_few_changed_embedding_rows_change_the_targets_identity(tmp_path, tiny_llama):
    """An edit of a few rows, anywhere in a weight file (here between where a sampled identity would read), with
    its size and header unchanged, gives the target a new identity and every key reading it a new key."""
    from eyrie.config import TargetConfig
    from eyrie.target.metadata import target_identity

    target = tmp_path / "target"
    shutil.copytree(tiny_llama, target)
    weights = target / "model-00002.safetensors"
    _weights(weights, 8)
    before = target_identity(TargetConfig(model=str(target)))
    raw = bytearray(weights.read_bytes())
    at = len(raw) // 30  # between the first and second of 16 evenly spaced samples
    raw[at : at + 64] = bytes(64)
    _rewrite(weights, bytes(raw))
    assert target_identity(TargetConfig(model=str(target))) != before


def test_a_weight_file_version_is_read_once_across_processes(tmp_path, monkeypatch):
    """The whole-content digest of a large file is kept in the digest store by its (device, inode, size, mtime,
    ctime): a new process (the in-process memo cleared) takes it from there without reading the file; a rewrite
    (even one that restores the mtime) is read again."""
    from eyrie.run import identity

    monkeypatch.setenv(identity.DIGEST_STORE_ENV, str(tmp_path / "digests"))
    monkeypatch.setattr(identity, "STORE_MIN_BYTES", 1 << 20)
    weights = tmp_path / "model.safetensors"
    _weights(weights, 2)
    reads = []
    real = identity._hash_whole
    monkeypatch.setattr(identity, "_hash_whole", lambda p, a: reads.append(p) or real(p, a))
    first = identity.file_digest(weights)
    assert len(reads) == 1 and list((tmp_path / "digests").rglob("*.json"))
    identity._CACHE.clear()  # a new process
    assert identity.file_digest(weights) == first and len(reads) == 1
    st = weights.stat()
    raw = bytearray(weights.read_bytes())
    raw[-10] ^= 0xFF
    weights.write_bytes(bytes(raw))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime back: the ctime still moved
    identity._CACHE.clear()
    assert identity.file_digest(weights) != first and len(reads) == 2
    small = tmp_path / "config.json"  # below STORE_MIN_BYTES: hashed by each process, not kept
    small.write_text("{}")
    kept = set((tmp_path / "digests").rglob("*.json"))
    identity.file_digest(small)
    assert set((tmp_path / "digests").rglob("*.json")) == kept
