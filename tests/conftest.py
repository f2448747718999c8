"""Session set-up shared by every test: cache locations, the tiny targets, config files and server clean-up.

The environment is set at import time, before anything imports Prefect or vLLM (both read their settings once, at
import). Subprocesses (flows run through `python -m flows.cli`, vLLM servers) inherit it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The target facts preflight hands the train command (the tensors the drafter borrows, the mask token), for tests
# that build the command without a preflight.
TARGET_FACTS = {
    "verifier_weights": {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "lm_head.weight": "lm_head.weight",
        "model.norm.weight": "model.norm.weight",
    },
    "mask_token_id": 7,
}
CACHE = REPO / ".cache"  # ignored by git
DEMO_DATA = REPO / "eyrie" / "data" / "demo_chat.jsonl"

# Task results (and so Prefect's cache records) live for one test session only: a cache hit in these tests must
# come from an earlier run in the same session, never from yesterday's.
_RESULTS_DIR = tempfile.mkdtemp(prefix="eyrie-test-results-")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1"... under pytest-xdist; "" in one process

TEST_ENV = {
    "HF_HOME": str(CACHE / "hf"),
    "VLLM_CACHE_ROOT": str(CACHE / "vllm"),
    "TORCHINDUCTOR_CACHE_DIR": str(CACHE / "inductor"),
    # Its own Prefect database, so tests never contend with a demo run's SQLite file, nor (under pytest-xdist, which
    # names each worker in PYTEST_XDIST_WORKER before this file is imported) with the other worker's.
    "PREFECT_HOME": str(CACHE / f"prefect-tests{'-' + _WORKER if _WORKER else ''}"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_RESULTS_LOCAL_STORAGE_PATH": _RESULTS_DIR,
    "HF_HUB_OFFLINE": "1",
    # Whole-file digests of target weights (eyrie/run/identity.py) stay in the repo's ignored cache, not ~/.cache.
    "EYRIE_DIGEST_STORE": os.environ.get("EYRIE_DIGEST_STORE", str(CACHE / "digests")),
    # vLLM's offline engine in its caller's process (tests/engine_capture.py sets it too). `vllm serve` in vLLM 0.32
    # starts its engine core in a process of its own whatever this says (AsyncLLM always takes the multiprocess
    # client); VLLM_SERVER_ARGS' `uni` backend keeps the worker in that process: two processes per server start
    # instead of three (the engine core forked, below). The demo and production keep vLLM's defaults.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # One thread per process, placed by the kernel. vLLM's CPU build binds each server's OpenMP threads to core 0
    # (`auto` keeps the last core for its front end), so every server of both xdist workers (three at once in the
    # production test) queued on one core while the other idled; two-thread trainers and tokenizers spun beside
    # them. Two server-kill tests at once: 135 and 143 s with vLLM's binding, 98 and 103 s so (benchmarks/RESULTS.md).
    "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    # With those two settings a server's engine core is forked from its API server (eyrie/vllm/plugin/fork.py), as
    # vLLM does on GPU nodes, instead of a second interpreter importing torch and vLLM again: a tiny target's server
    # ready in 44 s against 81 s, 47 s of CPU against 85 s (benchmarks/RESULTS.md, Server start-up).
    "EYRIE_CPU_ENGINE_FORK": "1",
    # Re-runs go through the flow, whose log the tests read (Prefect's Cached states, the servers reused); the
    # "nothing to do" fast path of `eyrie run` (flows/finished.py) is tested where it is named.
    "EYRIE_ALWAYS_FLOW": "1",
}
VLLM_SERVER_ARGS = ["--distributed-executor-backend", "uni"]
os.environ.update(TEST_ENV)
# Eyrie's own defaults for these two (eyrie/vllm/spec.py, flows/cli.py) apply only where Eyrie starts the server or
# the command; tests that build vLLM's engine in process or run a flow directly need them too. A caller's value wins.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
for _var in ("HF_HOME", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "PREFECT_HOME"):
    Path(os.environ[_var]).mkdir(parents=True, exist_ok=True)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if "prefect" in sys.modules:
    import warnings

    warnings.warn(
        "prefect was imported before tests/conftest.py set its environment; its settings may differ", stacklevel=1
    )

import pytest  # noqa: E402
import yaml  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# Tiny targets: built once into .cache/test-targets/<hash of the builders' source>/<kind> and kept across sessions
# (deterministic builds; a change to the builders gives a new folder, never a stale target).


def _builder_hash() -> str:
    h = hashlib.sha256()
    for p in sorted((REPO / "eyrie" / "target" / "tiny").glob("*.py")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:12]


TARGETS_DIR = CACHE / "test-targets" / _builder_hash()
for _old in (CACHE / "test-targets").glob("*"):  # targets of earlier builder versions are never used again
    if _old != TARGETS_DIR:
        shutil.rmtree(_old, ignore_errors=True)


def build_tiny_target(kind: str) -> Path:
    """The tiny target `kind`, built on first use; the build goes to a temporary folder renamed into place."""
    from filelock import FileLock

    from eyrie.target.tiny import build_target

    final = TARGETS_DIR / kind
    if (final / ".complete").exists():
        return final
    TARGETS_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(TARGETS_DIR / f".{kind}.lock"):  # pytest-xdist's workers (or two sessions) build it once
        if (final / ".complete").exists():
            return final
        shutil.rmtree(final, ignore_errors=True)  # a half-built folder from an interrupted session
        tmp = TARGETS_DIR / f".{kind}.build-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build_target(kind, tmp)
        os.replace(tmp, final)
    assert (final / ".complete").exists()
    return final


@pytest.fixture(scope="session")
def tiny_target():
    """Factory: tiny_target("tiny-llama") -> the folder of that tiny target (built once per builder version)."""
    return build_tiny_target


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return build_tiny_target("tiny-llama")


@pytest.fixture(scope="session")
def tiny_deepseek() -> Path:
    return build_tiny_target("tiny-deepseek-v3")


@pytest.fixture(scope="session")
def tiny_kimi() -> Path:
    return build_tiny_target("tiny-kimi-k25")


# ---------------------------------------------------------------------------------------------------------------
# Configs


def config_dict(
    target: Path,
    tiny: str | None = None,
    source: str | Path = DEMO_DATA,
    *,
    max_samples: int = 48,
    shard_size: int = 8,
    max_length: int = 256,
    max_model_len: int | None = None,
    layer_ids=None,
    concurrency: int = 4,
    name: str = "test",
    **sections,
) -> dict:
    """A demo-like config for `target` with small data; `sections` are merged into the top-level sections."""
    data = {
        "name": name,
        "target": {"model": str(target)},
        "data": {
            "source": str(source),
            "max_length": max_length,
            "shard_size": shard_size,
            "max_samples": max_samples,
            "eval_fraction": 0.05,
        },
        "extraction": {
            "concurrency": concurrency,
            "startup_timeout_s": 900,
            "request_timeout_s": 120,
            "server_args": list(VLLM_SERVER_ARGS),
        },
        "vocab": {"draft_vocab_size": 256},
    }
    if tiny:
        data["target"]["tiny"] = tiny
    if max_model_len is not None:
        data["target"]["max_model_len"] = max_model_len
    if layer_ids is not None:
        data["extraction"]["layer_ids"] = list(layer_ids)
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return data


def eyrie_run(config, run, until: str = "evaluate") -> list[str]:
    """`eyrie run` as a user types it, through this interpreter (`python -m flows.cli`)."""
    return [sys.executable, "-m", "flows.cli", "run", "--config", str(config), "--run-dir", str(run), "--until", until]


def write_config(path: Path, target: Path, tiny: str | None = None, **kw):
    """Write a YAML config for `target` + small data to `path`; returns (path, the validated PipelineConfig)."""
    from eyrie.config import parse_config

    data = config_dict(target, tiny, **kw)
    config = parse_config(data, str(path))  # the same validation `eyrie run --config` applies
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, config


class HubDatasetRepo:
    """A dataset repo in the hub cache's own layout (`datasets--org--name/{refs,snapshots}`), one snapshot per
    commit, as `huggingface_hub` leaves it after downloads of several revisions; `point_main_at` moves `main`, as a
    push to the hub would. Offline (HF_HUB_OFFLINE=1), Eyrie resolves and reads it as it would the hub."""

    def __init__(self, snapshots: dict[str, dict[str, str]]):
        import uuid

        from huggingface_hub import constants

        self.repo = f"eyrie-test/chat-{uuid.uuid4().hex[:8]}"
        self.root = Path(constants.HF_HUB_CACHE) / f"datasets--{self.repo.replace('/', '--')}"
        for commit, files in snapshots.items():
            snap = self.root / "snapshots" / commit
            snap.mkdir(parents=True)
            for name, text in files.items():
                (snap / name).write_text(text)
        (self.root / "refs").mkdir()
        self.point_main_at(next(iter(snapshots)))

    def point_main_at(self, commit: str) -> None:
        (self.root / "refs" / "main").write_text(commit)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def synthetic_training_inputs(config, root: Path):
    """The train stage's inputs without a vLLM server: prepared data, Eyrie-format hidden-state files with random
    states, and the draft vocabulary maps. Returns (preflight report, the train stage's TrainingData, seq_lens).
    That real hidden states match transformers is test_extraction_correctness.py's subject."""
    import torch
    from safetensors.torch import save_file

    from eyrie.stages.preflight import run_preflight
    from eyrie.stages.prepare import load_dataset_rows, load_seq_lens, prepare
    from eyrie.stages.train.data import TrainingData
    from eyrie.stages.vocab import build_vocab, mapping_paths

    report = run_preflight(config, root / "run", serve=False)
    prepared = root / "prepare"
    prepare(config.target, config.data, prepared)
    hidden = root / "hidden_states"
    hidden.mkdir(parents=True)
    seq_lens = load_seq_lens(prepared)
    g = torch.Generator().manual_seed(0)
    for i, ids in enumerate(load_dataset_rows(prepared, 0, len(seq_lens))):
        states = torch.randn(len(ids), len(report.captured_layer_ids), report.hidden_size, generator=g)
        save_file(
            {"hidden_states": states.bfloat16(), "token_ids": torch.tensor(ids)}, str(hidden / f"hs_{i}.safetensors")
        )
    size = config.vocab.draft_vocab_size
    build_vocab(prepared / "dataset" / "token_freq.pt", size, report.vocab_size, root / "vocab", "v")
    d2t, t2d = mapping_paths(root / "vocab", size)
    data = TrainingData(prepared / "dataset", hidden, d2t, t2d, report.aux_layer_ids, report.target_facts)
    return report, data, seq_lens


# ---------------------------------------------------------------------------------------------------------------
# vLLM servers: every folder a test starts a server in is registered here and stopped at the end of the session
# at the latest, whatever happened (fixtures stop their own servers earlier).

_SERVER_FOLDERS: list[Path] = []


def register_server_folder(folder: Path) -> Path:
    _SERVER_FOLDERS.append(Path(folder))
    return Path(folder)


def server_recorded_as_this_process(folder: Path, **fields):
    """A VllmServer whose server.json describes this test process as the server (alive, on this host, owned by its
    pid's start time), with `fields` on top: for status and phase tests that need no real server."""
    import socket

    from eyrie.run.files import atomic_write_json
    from eyrie.vllm.process import VllmServer, boot_id, process_start_ticks

    Path(folder).mkdir(parents=True, exist_ok=True)
    state = {
        "pid": os.getpid(),
        "start_ticks": process_start_ticks(os.getpid()),
        "boot_id": boot_id(),
        "host": "127.0.0.1",
        "port": 9,
        "hostname": socket.gethostname(),
        **fields,
    }
    atomic_write_json(Path(folder) / "server.json", state)
    return VllmServer(Path(folder))


def stop_server(folder: Path) -> None:
    from eyrie.vllm.process import VllmServer

    VllmServer(Path(folder)).stop(log=lambda *_: None)


@pytest.fixture(scope="session", autouse=True)
def _stop_all_servers_at_exit():
    yield
    for folder in _SERVER_FOLDERS:
        try:
            stop_server(folder)
        except Exception as err:  # keep stopping the others
            print(f"could not stop the server in {folder}: {err}", file=sys.stderr)


TIERS = ("unit", "integration", "e2e")  # tests/<tier>/: by cost, cheapest first


def _tier(item) -> int:
    parts = Path(str(item.path)).parts
    return next((TIERS.index(p) for p in reversed(parts) if p in TIERS), len(TIERS))


def pytest_collection_modifyitems(session, config, items):
    """In one process: fast tests first (so `-x` fails in seconds, not after vLLM starts), then the slow ones tier
    by tier (unit, integration, e2e), each in file order (a module's tests stay together, so its module-scoped
    server starts once).

    Under pytest-xdist (`make test` runs two workers, `--dist loadfile`: a file's tests stay on one worker, in the
    order given here): the costliest first, e2e then integration then unit, so that the longest files start at
    once and the unit files fill the gaps at the end instead of a long file running alone last."""
    if _WORKER:  # collection runs in the workers; the controller schedules in the order they collected
        items.sort(key=lambda item: (item.get_closest_marker("slow") is None, -_tier(item)))  # stable
    else:
        items.sort(key=lambda item: (item.get_closest_marker("slow") is not None, _tier(item)))  # stable


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_RESULTS_DIR, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# PostgreSQL for the tests that run a Prefect server as production does (tests/prefect_server.py): started on first
# use, once per session, and stopped at its end; each such test module starts its own Prefect server on a fresh
# database of it.


@pytest.fixture(scope="session")
def postgres():
    from prefect_server import Postgres

    pg = Postgres()
    try:
        yield pg.start()
    finally:
        pg.stop()


# ---------------------------------------------------------------------------------------------------------------
# One Prefect server for every flow the slow tests run as a user does (`python -m flows.cli run`, a subprocess):
# without it each run starts Prefect's temporary server (10-15 s on 2 cores; about 25 runs per session).


@pytest.fixture(scope="session")
def flow_api():
    from prefect_server import PrefectServer

    home = Path(os.environ["PREFECT_HOME"]) / "flow-api"  # inside PREFECT_HOME, so secret scans of it see its data
    shutil.rmtree(home, ignore_errors=True)
    server = PrefectServer(home, f"sqlite+aiosqlite:///{home / 'prefect.db'}", services=False).start()
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
    os.environ.update(PREFECT_API_URL=server.url, PREFECT_API_AUTH_STRING=server.auth)
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
