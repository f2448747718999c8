"""Online hidden states (`train.hidden_states: online`, eyrie/stages/train/online.py): the trainer asks the extraction
server for
each sample through speculators' on-missing `generate` path, through transient files on tmpfs.

The unit tests cover the option, the key, the trainer's command (resolved by speculators itself), the entry point's
switch, the tmpfs staging folder and its clean-up, and the dataset's concurrent batch fetch. The slow test trains
online against a real extraction server (tiny-llama, vLLM's CPU build), kills the trainer at a checkpoint, resumes
to completion, and finds no hidden-state byte left anywhere."""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from conftest import TARGET_FACTS as FACTS
from conftest import build_tiny_target, config_dict, register_server_folder, stop_server

from eyrie.config import TrainConfig, parse_config
from eyrie.errors import ConfigError, EyrieError
from eyrie.hidden_states.staging import clean, filesystem_type, leftover_bytes, on_tmpfs, staging_dir
from eyrie.stages.train.command import training_command
from eyrie.stages.train.data import TrainingData
from eyrie.stages.train.online import API_KEY_ENV_FLAG, CONCURRENCY_FLAG, ONLINE_FLAG, endpoint
from eyrie.stages.train.trainer import run_training, train_key


def _config(tmp_path: Path, **train):
    return parse_config(config_dict(tmp_path / "target", train=train))


def _command(tmp_path: Path, config, server_url: str | None, device: str = "cpu") -> list[str]:
    data = TrainingData(
        tmp_path / "data", tmp_path / "staging", tmp_path / "d2t.npy", tmp_path / "t2d.npy", [2, 4, 5], FACTS
    )
    return training_command(
        config,
        data,
        tmp_path / "train" / "k" / "checkpoints",
        1.0,
        device,
        warm_start=tmp_path / "drafter",  # no draft layer config to build, so no target folder is needed
        server_url=server_url,
    )


def _value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, f"{flag} appears {cmd.count(flag)} times"
    return cmd[cmd.index(flag) + 1]


# ---------------------------------------------------------------------------------------------------------------
# The option and the key


def test_the_option_defaults_to_offline_takes_online_and_refuses_anything_else(tmp_path):
    assert _config(tmp_path).train.hidden_states == "offline"
    assert _config(tmp_path, hidden_states="online").train.hidden_states == "online"
    with pytest.raises(ConfigError, match="hidden_states"):
        _config(tmp_path, hidden_states="streaming")
    assert "tmpfs" in (TrainConfig.model_fields["hidden_states"].description or "")


def test_online_and_offline_training_on_the_same_hidden_states_share_their_key(tmp_path):
    offline = _config(tmp_path)
    online = _config(tmp_path, hidden_states="online")
    data, vocab, aux = ["shard-key-0", "shard-key-1"], "v", [2, 4, 5]
    # The same hidden states, read from files or asked of the server: the same weights, so a switch resumes.
    assert train_key(online, data, vocab, aux) == train_key(offline, data, vocab, aux)
    # The data keys are extraction's content keys (target identity, captured layers, shard fingerprint): a
    # change to any of them is a new key.
    assert train_key(online, ["other-shard-key", "shard-key-1"], vocab, aux) != train_key(online, data, vocab, aux)
    assert train_key(online, data, vocab, [2, 4, 6]) != train_key(online, data, vocab, aux)


# ---------------------------------------------------------------------------------------------------------------
# The trainer's command


def _resolved(cmd: list[str]) -> tuple[dict, tuple[str | None, int] | None]:
    """speculators' own resolution of the arguments `eyrie.stages.train.entry` hands it, after the entry point took its
    own, and what the entry's loaders are told of the online server (its API key's variable, requests in flight)."""
    from speculators.train.config import TrainConfig as SpeculatorsConfig

    from eyrie.stages.train import entry as train_entry

    argv = cmd[cmd.index("eyrie.stages.train.entry") + 1 :]
    train_entry._pop_option(argv, "--eyrie-verifier-weights")
    train_entry._pop_option(argv, "--eyrie-metrics")
    train_entry._pop_option(argv, "--eyrie-options")
    online = train_entry._online_hidden_states(argv)
    return SpeculatorsConfig.resolve(argv).flatten(), online


def test_online_command_asks_the_server_through_speculators_generate_path(tmp_path, monkeypatch):
    config = _config(tmp_path, hidden_states="online")
    cmd = _command(tmp_path, config, "http://127.0.0.1:8123")
    assert _value(cmd, "--on-missing") == "generate"
    assert _value(cmd, "--vllm-endpoint") == "http://127.0.0.1:8123/v1"
    assert _value(cmd, "--hidden-states-path") == str(tmp_path / "staging")
    assert _value(cmd, CONCURRENCY_FLAG) == str(config.extraction.concurrency)
    assert ONLINE_FLAG in cmd and API_KEY_ENV_FLAG not in cmd
    resolved, online = _resolved(cmd)
    assert resolved["on_missing"] == "generate"
    assert resolved["vllm_endpoint"] == "http://127.0.0.1:8123/v1"
    assert resolved["hidden_states_path"] == str(tmp_path / "staging")
    assert resolved["request_timeout"] == config.extraction.request_timeout_s
    assert resolved["max_consecutive_generation_failures"] == 1  # no sample dropped silently
    assert online == (None, config.extraction.concurrency)


def test_online_command_names_the_api_key_variable_never_the_key(tmp_path, monkeypatch):
    data = config_dict(tmp_path / "target", train={"hidden_states": "online"}, extraction={"api_key_env": "MY_KEY"})
    config = parse_config(data)
    monkeypatch.setenv("MY_KEY", "s3cret")
    cmd = _command(tmp_path, config, "http://10.0.0.5:8000/")
    assert _value(cmd, API_KEY_ENV_FLAG) == "MY_KEY"
    assert "s3cret" not in " ".join(cmd)
    assert _value(cmd, "--vllm-endpoint") == "http://10.0.0.5:8000/v1"
    _, online = _resolved(cmd)
    assert online == ("MY_KEY", config.extraction.concurrency)


def test_offline_command_is_unchanged(tmp_path, monkeypatch):
    cmd = _command(tmp_path, _config(tmp_path), None)
    assert _value(cmd, "--on-missing") == "raise"
    assert _value(cmd, "--hidden-states-path") == str(tmp_path / "staging")
    assert ONLINE_FLAG not in cmd and "--vllm-endpoint" not in cmd
    _, online = _resolved(cmd)
    assert online is None


def test_online_training_without_a_server_is_refused_before_anything_runs(tmp_path):
    config = _config(tmp_path, hidden_states="online", device="cpu")
    with pytest.raises(EyrieError, match="no extraction server"):
        run_training(
            config, tmp_path / "train", "k",
            TrainingData(tmp_path / "data", tmp_path / "staging", tmp_path / "d2t", tmp_path / "t2d", [2, 4, 5], FACTS),
            [10, 20],
        )  # fmt: skip
    assert not (tmp_path / "train" / "k").exists()


def test_endpoint_is_the_openai_base_url():
    assert endpoint("http://h:1") == "http://h:1/v1"
    assert endpoint("http://h:1/") == "http://h:1/v1"
    assert endpoint("http://h:1/v1") == "http://h:1/v1"


# ---------------------------------------------------------------------------------------------------------------
# The transient files


def test_staging_is_on_tmpfs_one_folder_per_run_and_node(tmp_path, monkeypatch):
    monkeypatch.delenv("EYRIE_ONLINE_TMPFS", raising=False)
    a = staging_dir(tmp_path / "run-a")
    assert a.parent == Path("/dev/shm") and a == staging_dir(tmp_path / "run-a")
    assert a != staging_dir(tmp_path / "run-b") and a != staging_dir(tmp_path / "run-a", node="n1")
    if Path("/dev/shm").is_dir():
        assert filesystem_type(Path("/dev/shm")) in ("tmpfs", "ramfs") and on_tmpfs(a)  # a, not there yet: its parent
    monkeypatch.setenv("EYRIE_ONLINE_TMPFS", str(tmp_path / "shm"))
    assert staging_dir(tmp_path / "run-a").parent == tmp_path / "shm"


def test_clean_removes_unread_files_and_locks_only(tmp_path):
    staging = tmp_path / "staging"
    assert clean(staging) == (0, 0) and leftover_bytes(staging) == 0  # no folder yet
    staging.mkdir()
    (staging / "req-1.safetensors").write_bytes(b"x" * 100)
    (staging / "req-1.safetensors.lock").write_bytes(b"")
    (staging / "req-2.safetensors").write_bytes(b"y" * 28)
    (staging / "notes.txt").write_text("kept")
    assert leftover_bytes(staging) == 128
    assert clean(staging) == (3, 128)
    assert leftover_bytes(staging) == 0 and [p.name for p in staging.iterdir()] == ["notes.txt"]


def test_the_lock_wait_returns_as_the_writer_lets_go_and_removes_the_lock(tmp_path):
    from eyrie.stages.train.online_dataset import wait_for_lock

    lock = tmp_path / "req.safetensors.lock"
    fd = os.open(lock, os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the connector's writer holds it until the file is whole
    threading.Timer(0.05, os.close, (fd,)).start()
    t = time.monotonic()
    wait_for_lock(str(lock))
    assert 0.04 <= time.monotonic() - t < 1
    assert not lock.exists()
    fd = os.open(lock, os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(TimeoutError):
            wait_for_lock(str(lock), timeout=0.05)
    finally:
        os.close(fd)


def test_a_batch_is_fetched_concurrently_in_order(tmp_path):
    import pickle

    from eyrie.stages.train.online_dataset import OnlineDataset

    class Fake(OnlineDataset):
        def __init__(self):  # no dataset on disk, no server
            self.concurrency, self.client, self._pool, self.active, self.peak = 4, object(), None, 0, 0
            self.mutex = threading.Lock()

        def __getitem__(self, index):
            with self.mutex:
                self.active += 1
                self.peak = max(self.peak, self.active)
            time.sleep(0.05)
            with self.mutex:
                self.active -= 1
            return {"index": index}

    ds = Fake()
    assert ds.__getitems__([5, 3, 9, 1, 0, 7, 2, 8]) == [{"index": i} for i in (5, 3, 9, 1, 0, 7, 2, 8)]
    assert ds.peak == 4
    state = ds.__getstate__()
    assert state["_pool"] is None  # what a spawned loader worker gets: it makes its own threads
    del state["mutex"]
    pickle.dumps(state)


# ---------------------------------------------------------------------------------------------------------------
# The real thing


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_online_training_killed_mid_run_resumes_with_no_hidden_states_left(tmp_path, monkeypatch):
    from eyrie.hidden_states.check import context_for
    from eyrie.stages.extract.proof import prove_server
    from eyrie.stages.preflight import run_preflight
    from eyrie.stages.prepare import load_seq_lens, prepare
    from eyrie.stages.vocab import build_vocab, mapping_paths
    from eyrie.vllm.client import ServerClient
    from eyrie.vllm.process import VllmServer
    from eyrie.vllm.spec import ServerSpec

    monkeypatch.setenv("EYRIE_ONLINE_TMPFS", "/dev/shm" if on_tmpfs(Path("/dev/shm")) else str(tmp_path / "shm"))
    target = build_tiny_target("tiny-llama")
    data = config_dict(target, max_samples=32, shard_size=32, max_length=64, layer_ids=[2, 4, 5])
    data["train"] = {"epochs": 1, "max_seq_len": 64, "save_every_steps": 1, "device": "cpu", "hidden_states": "online"}
    config = parse_config(data)
    run = tmp_path / "run"
    report = run_preflight(config, run, serve=False)
    prepared = tmp_path / "prepare"
    prepare(config.target, config.data, prepared)
    seq_lens = load_seq_lens(prepared)
    size = config.vocab.draft_vocab_size
    build_vocab(prepared / "dataset" / "token_freq.pt", size, report.vocab_size, tmp_path / "vocab", "v")
    d2t, t2d = mapping_paths(tmp_path / "vocab", size)
    staging = staging_dir(run)
    spec = ServerSpec.from_config(config, layer_ids=report.captured_layer_ids, storage_path=str(staging))
    folder = register_server_folder(tmp_path / "server")
    try:
        url = VllmServer(folder).ensure(spec, config.extraction.startup_timeout_s).base_url
        # The pipeline proves the online server's capture before the trainer's first request
        # (flows/extract.py, prove_online_server): the proof reads its captures from the tmpfs staging and leaves none.
        proof = prove_server(
            context_for(config, report),
            prepared,
            tmp_path / "capture",
            VllmServer(folder).state,
            ServerClient(url),
            spec.max_model_len,
        )
        assert proof["passed"] and proof["head_check"] and proof["aux_check"]["relative_l2"], proof
        assert leftover_bytes(staging) == 0, list(staging.iterdir())
        data = TrainingData(prepared / "dataset", staging, d2t, t2d, report.aux_layer_ids, report.target_facts)
        out = tmp_path / "train"
        # SIGKILL the trainer as it saves step 4's training state (a whole checkpoint of an earlier step exists).
        monkeypatch.setenv("EYRIE_FAULTS", "train.before-state.step4=kill")
        with pytest.raises(EyrieError, match="exited with code -9"):
            run_training(config, out, "k", data, seq_lens, server_url=url)
        monkeypatch.delenv("EYRIE_FAULTS")
        notes: list[str] = []
        done = run_training(config, out, "k", data, seq_lens, server_url=url, log=notes.append)
        # The cut save was set aside and the whole one it was replacing (step 3's) put back and resumed from.
        assert any("restored checkpoint" in n for n in notes), notes
        assert done["resumed_from"], notes
        assert done["global_step"] >= 5 and done["history"], done
        log = Path(done["log"]).read_text()
        assert "--on-missing generate" in log and "Traceback" not in log.split("===== eyrie:")[-1]
        # Nothing of the hidden states stays: not in the staging folder, not anywhere under the test's folders.
        assert leftover_bytes(staging) == 0, list(staging.iterdir())
        assert not [p for p in tmp_path.rglob("*") if p.name.startswith("hs_") or p.name.endswith(".lock")]
        assert on_tmpfs(staging) or str(staging).startswith(str(tmp_path / "shm"))
    finally:
        stop_server(folder)
        shutil.rmtree(staging, ignore_errors=True)
