"""What vLLM's extraction writes is what the target computes: for each tiny target of the compatibility matrix
(Llama, DeepseekV3, the Kimi-K2.5-style multimodal wrapper and the families of eyrie/target/tiny/families.py, native
and through Eyrie's compatibility layer) one sample is captured with Eyrie's connector, checked as Eyrie checks every
file, and every captured layer is compared with transformers' hidden states on the same token ids.

vLLM's id k is the input of layer k, which is transformers' hidden_states[k]. Id L (the last layer's output) is taken
before the final norm; transformers' hidden_states[-1] has the norm applied, so the reference for id L is the last
decoder layer's output, caught with a forward hook.

The Llama sample goes through Eyrie's own server and client (that server then serves the concurrency and packed
tests). The other targets' samples come from one process that builds each target's engine in turn from the same
server arguments (tests/engine_capture.py): a server per target cost two interpreters importing torch and vLLM each
(45-100 s in the suite), and the server's HTTP front end is the same whatever the target. A target whose engine
cannot be built in that process is served instead, and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from conftest import DEMO_DATA, REPO, VLLM_SERVER_ARGS, register_server_folder, stop_server
from engine_capture import read_results
from safetensors.torch import load_file

from eyrie.hidden_states.keyed import file_key
from eyrie.stages.extract import _wait_and_release, extract_shard, load_checked, sample_path
from eyrie.stages.preflight import captured_layer_ids, default_aux_layer_ids
from eyrie.target.metadata import text_config
from eyrie.vllm.client import ServerClient
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

KINDS = [
    "tiny-llama",
    "tiny-deepseek-v3",
    "tiny-kimi-k25",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-qwen3-moe",
    "tiny-mistral",
    "tiny-gemma2",
    "tiny-phi3",
    "tiny-gpt-neox",
    "tiny-falcon",
    "tiny-stablelm",
]
KEPT = "tiny-llama"  # captured through Eyrie's server, which also serves the concurrency and packed tests
ENGINE_TIMEOUT_S = 1100  # the engine process's wait for its first result: imports, then the targets before it
MAX_MODEL_LEN = 256
REL_TOL = 0.03  # vLLM computes in bf16; the reference runs in float32 on the same bf16 weights
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Count from 12 to 19."},
    {"role": "assistant", "content": "12, 13, 14, 15, 16, 17, 18, 19."},
    {"role": "user", "content": "Spell the word falcon."},
    {"role": "assistant", "content": "The word falcon is spelled f-a-l-c-o-n."},
]


@dataclass
class Running:
    kind: str
    model: Path
    folder: Path
    spec: ServerSpec
    num_layers: int
    hidden_size: int
    future: Future
    startup_s: float | None = None

    def client(self) -> ServerClient:
        """The server's client, once it answers."""
        return self.future.result(timeout=1100)


def _start(r: Running) -> ServerClient:
    t0 = time.monotonic()
    client = VllmServer(r.folder).ensure(r.spec, startup_timeout_s=1000, log=lambda *_: None)
    r.startup_s = time.monotonic() - t0
    return client


def _token_ids(model: Path) -> list[int]:
    from transformers import AutoTokenizer

    from eyrie.stages.prepare import tokenize_conversation

    ids, _, _ = tokenize_conversation(AutoTokenizer.from_pretrained(str(model)), MESSAGES, MAX_MODEL_LEN)
    assert 40 < len(ids) < MAX_MODEL_LEN
    return ids


@dataclass
class Captures:
    """KEPT's server and the engine processes capturing every other target's sample: one process for all, and a
    fresh one for the targets after any whose build failed (`tests/engine_capture.py`)."""

    running: dict[str, Running]
    token_ids: dict[str, list[int]]  # each target's sample, the same conversation through its own tokenizer
    root: Path
    jobs: list[dict]
    env: dict
    thread: threading.Thread | None = None
    engine: subprocess.Popen | None = None
    stopping: bool = False

    @property
    def results(self) -> Path:
        return self.root / "out.jsonl"

    def _found(self) -> dict[str, dict]:
        return read_results(self.results)

    def _run(self) -> None:
        for attempt in range(len(self.jobs)):
            left = [j for j in self.jobs if j["name"] not in self._found()]
            if not left or self.stopping:
                return
            jobs = self.root / f"jobs-{attempt}.json"
            jobs.write_text(json.dumps(left))
            with open(self.root / f"engine-{attempt}.log", "wb") as log:
                self.engine = subprocess.Popen(
                    [sys.executable, str(REPO / "tests" / "engine_capture.py"), str(jobs), str(self.results)],
                    cwd=REPO,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            self.engine.wait()

    def start(self) -> Captures:
        self.thread = threading.Thread(target=self._run, name="engine-capture", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping = True
        if self.engine is not None:
            self.engine.kill()
        if self.thread is not None:
            self.thread.join(timeout=60)

    def engine_result(self, kind: str) -> dict:
        """The engine processes' line for `kind`: {"path"} or {"error"}, once written."""
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while (found := self._found().get(kind)) is None:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.root.glob("engine-*.log")))
                raise AssertionError(f"no result for {kind} from the engine processes:\n{logs}")
            time.sleep(0.5)
        return found


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_target) -> dict[str, Running]:
    """Every target's extraction server spec; KEPT's server started (in the background) for the whole module."""
    root = tmp_path_factory.mktemp("servers")
    running = {}
    for kind in KINDS:
        model = tiny_target(kind).resolve()
        text = text_config(json.loads((model / "config.json").read_text()))
        n = text["num_hidden_layers"]
        folder = register_server_folder(root / kind)
        spec = ServerSpec(
            model=str(model),
            layer_ids=captured_layer_ids(default_aux_layer_ids(n), n),
            storage_path=str(folder / "staging"),
            max_model_len=MAX_MODEL_LEN,
            server_args=list(VLLM_SERVER_ARGS),
        )
        running[kind] = Running(kind, model, folder, spec, n, text["hidden_size"], Future())
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="start-vllm")
    try:
        running[KEPT].future = pool.submit(_start, running[KEPT])
        yield running
    finally:
        for r in running.values():
            stop_server(r.folder)  # a start still waiting sees its server exit and gives up
        pool.shutdown(wait=True, cancel_futures=True)
        for r in running.values():
            stop_server(r.folder)  # in case a start recorded its server after the first pass
            state = VllmServer(r.folder).state
            assert state is None, f"{r.kind}: server still recorded after teardown: {state}"


@pytest.fixture(scope="module")
def captures(servers, tmp_path_factory) -> Captures:
    """The engine processes capturing every target but KEPT, started at once beside KEPT's server."""
    from eyrie.run.environment import child_environment

    token_ids = {kind: _token_ids(r.model) for kind, r in servers.items()}
    jobs = []
    for kind, r in servers.items():
        if kind != KEPT:
            Path(r.spec.storage_path).mkdir(parents=True, exist_ok=True)
            jobs.append({"name": kind, "arguments": r.spec.arguments(0), "token_ids": token_ids[kind]})
    env = child_environment(servers[KEPT].spec.server_env)  # what a server of these specs would get
    captures = Captures(servers, token_ids, tmp_path_factory.mktemp("engines"), jobs, env).start()
    try:
        yield captures
    finally:
        captures.stop()


def _hf_reference(folder: Path, token_ids: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """transformers' hidden_states (float32 compute on the bf16 checkpoint) and the last layer's pre-norm output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    caught = {}

    def hook(_module, _inputs, output):
        caught["last"] = output[0] if isinstance(output, tuple) else output

    layers = next(m for m in model.get_decoder().children() if isinstance(m, torch.nn.ModuleList))
    handle = layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    return tuple(h[0] for h in out.hidden_states), caught["last"][0]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_match_transformers(captures, kind, record_property):
    r, ids = captures.running[kind], captures.token_ids[kind]
    if kind == KEPT:  # through Eyrie's server and client
        path = r.client().extract(ids, 120)
        record_property("server_startup_s", round(r.startup_s, 1))
    else:
        found = captures.engine_result(kind)
        if "error" in found:  # this vLLM cannot build the target's engine in a process that built others
            print(f"{kind}: the engine process could not build it, served instead:\n{found['error']}")
            try:
                path = _start(r).extract(ids, 120)
                record_property("server_startup_s", round(r.startup_s, 1))
                # Checked while the server runs: its connector writes the file after it answers, and a server
                # stopped before that leaves a released lock and no file.
                _check_one_sample(r, path, ids, kind, record_property)
            finally:
                stop_server(r.folder)
            return
        path = found["path"]
    _check_one_sample(r, path, ids, kind, record_property)


def _check_one_sample(r: Running, path: str, ids: list[int], kind: str, record_property) -> None:
    from transformers import AutoTokenizer

    _wait_and_release(path)
    assert Path(path).parent == Path(r.spec.storage_path)  # the connector writes where Eyrie told it
    assert not Path(path + ".lock").exists()
    n_captured = len(r.spec.layer_ids)
    load_checked(Path(path), ids, n_captured, r.hidden_size)  # whole, finite, right shape and token ids
    data = load_file(path)
    os.unlink(path)
    hs = data["hidden_states"]
    assert hs.dtype == torch.bfloat16 and tuple(hs.shape) == (len(ids), n_captured, r.hidden_size)

    # Kimi: the reference is the plain DeepseekV3 copy of the wrapper's language model; check that it is one.
    ref_folder = r.model / "text_model" if kind == "tiny-kimi-k25" else r.model
    if kind == "tiny-kimi-k25":
        tok = AutoTokenizer.from_pretrained(str(r.model))
        wrapper = load_file(str(r.model / "model.safetensors"))
        text = load_file(str(ref_folder / "model.safetensors"))
        assert text and all(torch.equal(wrapper["language_model." + k], v) for k, v in text.items())
        assert (
            AutoTokenizer.from_pretrained(str(ref_folder))(tok.decode(ids), add_special_tokens=False)["input_ids"]
            == ids
        )

    hf_states, last_pre_norm = _hf_reference(ref_folder, ids)
    L = r.num_layers
    assert len(hf_states) == L + 1
    errors = {}
    for j, k in enumerate(r.spec.layer_ids):
        ref = last_pre_norm if k == L else hf_states[k]
        errors[k] = _rel_err(hs[:, j], ref)
    record_property("rel_err", {k: round(v, 4) for k, v in errors.items()})
    print(f"{kind}: relative L2 error per captured id {errors}")
    assert all(e < REL_TOL for e in errors.values()), errors
    # Id L is the pre-norm output: far from transformers' (normed) last hidden state.
    assert _rel_err(hs[:, -1], hf_states[-1]) > 0.2
    # The captured layers are distinct (not one layer written several times).
    for j in range(1, n_captured):
        assert _rel_err(hs[:, j], hs[:, j - 1]) > 0.05
    # The capture proof (eyrie/hidden_states/proof.py) accepts this real capture: its recomputation of the first
    # layers from the checkpoint puts every aux layer nearest its own layer, within the proof's bound.
    _proof_accepts(r, hs, ids, kind, record_property)


def _proof_accepts(r: Running, hs: torch.Tensor, ids: list[int], kind: str, record_property) -> None:
    from eyrie.config import TargetConfig
    from eyrie.hidden_states.proof import aux_problems, recomputer
    from eyrie.target.metadata import checkpoint_tensor_names, resolve_borrowed_weights

    target = TargetConfig(model=str(r.model))
    full = json.loads((r.model / "config.json").read_text())
    ctx = {
        "model": str(r.model),
        "num_layers": r.num_layers,
        "layer_ids": list(r.spec.layer_ids),
        "verifier_weights": resolve_borrowed_weights(target, full, checkpoint_tensor_names(target)).speculators_names(),
        "text_config": text_config(full),
        "quantized": False,
    }
    problems, figures = aux_problems([(hs.float(), ids)], ctx["layer_ids"], r.num_layers, recomputer(ctx))
    record_property("proof_aux", figures)
    print(f"{kind}: the capture proof's aux layers (relative L2 to own, before, after) {figures}")
    assert not problems, problems


def test_concurrent_requests_each_get_their_own_sample(servers, tmp_path, tiny_llama):
    """extract_shard against the real server, 8 requests in flight: every file holds its own prompt's states."""
    from eyrie.config import DataConfig, TargetConfig
    from eyrie.stages.prepare import load_dataset_rows, load_shards, prepare

    r = servers["tiny-llama"]
    client = r.client()
    prepared = tmp_path / "prepare"
    prepare(
        TargetConfig(model=str(r.model)),
        DataConfig(source=str(DEMO_DATA), max_samples=16, shard_size=16, eval_fraction=0.0, max_length=MAX_MODEL_LEN),
        prepared,
    )
    shard = load_shards(prepared)[0]
    hidden = r.folder / f"hidden-{tmp_path.name}"  # beside the staging, as in a run folder
    # The run folder and the server's staging folder must share a filesystem (files are renamed into place).
    assert os.stat(tmp_path).st_dev == os.stat(r.spec.storage_path).st_dev
    manifest = extract_shard(
        client,
        prepared,
        shard,
        "key",
        hidden,
        tmp_path / "shard.json",
        len(r.spec.layer_ids),
        r.hidden_size,
        concurrency=8,
        timeout_s=120,
        log=lambda *_: None,
    )
    assert manifest["extracted_samples"] == 16 and len(manifest["files"]) == 16
    rows = load_dataset_rows(prepared, 0, 16)
    for i, ids in enumerate(rows):
        load_checked(sample_path(hidden, i), ids, len(r.spec.layer_ids), r.hidden_size)
    # Batched with 7 others or alone, a prompt's states agree (to bf16 precision).
    assert {file_key(sample_path(hidden, i)) for i in range(16)} == {"key"}  # what each file was made under
    solo = client.extract(rows[3], 120, "solo-key")
    _wait_and_release(solo)
    assert file_key(Path(solo)) == "solo-key"  # as the connector wrote it: the client only asked
    alone = load_file(solo)["hidden_states"]
    os.unlink(solo)
    batched = load_file(str(sample_path(hidden, 3)))["hidden_states"]
    assert _rel_err(batched, alone) < REL_TOL
    assert not [p for p in Path(r.spec.storage_path).iterdir()]  # nothing left in the server's staging folder


def test_packed_extraction_trains(servers, tmp_path):
    """`extraction.storage: packed` against the same server: each shard lands as one pack (no per-sample file
    left), holding the states the server computed, and speculators' trainer (on the CPU, through Eyrie's entry and
    its packed reader) trains on the packs alone."""
    from conftest import config_dict, synthetic_training_inputs

    from eyrie.config import parse_config
    from eyrie.hidden_states.packs import PackReader, pack_ranges
    from eyrie.stages.prepare import load_dataset_rows, load_shards
    from eyrie.stages.train.trainer import run_training

    r = servers[KEPT]
    client = r.client()
    config = parse_config(
        config_dict(
            r.model,
            max_samples=8,
            shard_size=4,
            max_length=128,
            layer_ids=default_aux_layer_ids(r.num_layers),
            extraction={"storage": "packed"},
            train={"epochs": 1, "max_seq_len": 128},
            vocab={"draft_vocab_size": 128},
        )
    )
    report, inputs, seq_lens = synthetic_training_inputs(config, tmp_path)  # prepared data and vocab
    assert report.captured_layer_ids == r.spec.layer_ids
    prepared, hidden = inputs.data_dir.parent, r.folder / f"packed-{tmp_path.name}"  # beside the staging
    shards = load_shards(prepared)
    for shard in shards:
        m = extract_shard(
            client,
            prepared,
            shard,
            "key",
            hidden,
            tmp_path / "shards" / f"{shard.name}.json",
            len(r.spec.layer_ids),
            r.hidden_size,
            concurrency=8,
            timeout_s=120,
            log=lambda *_: None,
            storage=config.extraction.storage,
        )
        assert m["storage"] == "packed" and len(m["files"]) == 1
    assert len(pack_ranges(hidden)) == len(shards) > 1 and not list(hidden.glob("hs_*"))
    reader = PackReader(hidden)
    for i, ids in enumerate(load_dataset_rows(prepared, 0, len(seq_lens))):
        sample = reader.read(i)
        assert sample["token_ids"].tolist() == ids
        assert tuple(sample["hidden_states"].shape) == (len(ids), len(r.spec.layer_ids), r.hidden_size)
    trained = run_training(config, tmp_path / "train", "k", replace(inputs, hidden_dir=hidden), seq_lens, log=print)
    assert trained["global_step"] and trained["global_step"] > 0
