"""Faults during a real run (tiny-llama, vLLM's CPU build, Prefect): the extraction server killed mid-run, and a
second run started on a folder that is in use. Neither may end as a success with samples missing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyrie.data import load_dataset_rows, load_shards
from eyrie.extract import load_checked, sample_path
from eyrie.store import RunFolder, read_json

from conftest import REPO, register_server_folder, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def flow(config: Path, run: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--config", str(config), "--run-dir",
                             str(run), "--until", "extract"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_server_killed_mid_run_is_restarted_once_and_only_missing_samples_are_redone(tmp_path, tiny_llama):
    config, _ = write_config(tmp_path / "config.yaml", tiny_llama, max_samples=48, shard_size=8, concurrency=1,
                             layer_ids=[2, 4, 5])
    run = tmp_path / "run"
    register_server_folder(run / "extract")
    proc = flow(config, run)
    deadline, done = time.monotonic() + 900, {}
    while time.monotonic() < deadline and proc.poll() is None:
        done = {p.name: p.stat().st_mtime_ns for p in (run / "extract" / "shards").glob("*.json")}
        if done:
            break
        time.sleep(0.2)
    assert done and proc.poll() is None, "no shard finished while the flow ran"
    kept = {p.name: p.stat().st_mtime_ns for p in (run / "extract" / "hidden_states").glob("hs_*.safetensors")}
    os.killpg(read_json(run / "extract" / "server.json")["pid"], signal.SIGKILL)  # the server and its engine
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert "restarting it once" in out
    log = (run / "extract" / "server.log").read_text(errors="replace")
    assert log.count("eyrie: starting vLLM") == 2
    # Finished shards and samples written before the kill were not redone.
    for name, mtime in done.items():
        assert (run / "extract" / "shards" / name).stat().st_mtime_ns == mtime
    for name, mtime in kept.items():
        assert (run / "extract" / "hidden_states" / name).stat().st_mtime_ns == mtime
    # And nothing is missing: exactly one valid file per sample.
    rf = RunFolder(run)
    shards = load_shards(rf.prepare)
    files = list(rf.hidden_states.glob("hs_*.safetensors"))
    assert len(files) == shards[-1].stop
    for shard in shards:
        for offset, ids in enumerate(load_dataset_rows(rf.prepare, shard.start, shard.stop)):
            load_checked(sample_path(rf.hidden_states, shard.start + offset), ids, 4, 64)


def test_second_run_on_a_folder_in_use_is_refused(tmp_path, tiny_llama):
    config, _ = write_config(tmp_path / "config.yaml", tiny_llama, max_samples=8, shard_size=8)
    run = RunFolder(tmp_path / "run")
    with run.lock():
        out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(config), "--run-dir",
                              str(run.root), "--until", "prepare"], cwd=REPO, capture_output=True, text=True,
                             timeout=600)
    assert out.returncode != 0
    assert f"run folder {run.root} is in use by pid {os.getpid()}" in out.stdout + out.stderr
    assert not (run.root / "prepare").exists()  # it did nothing before refusing
