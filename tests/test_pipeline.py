"""The whole pipeline on the demo's trained tiny target, run as a user runs it (`python -m flows.cli run`).

One run folder serves every test (vLLM and training are the slow parts): extraction first, then a full run whose
flow process is SIGKILLed once training has saved a step, then a resumed run, then a third run that must find
every stage cached and start no vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from eyrie.store import read_json

from conftest import REPO, build_tiny_target, register_server_folder, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def run_flow(config: Path, run: Path, until: str = "evaluate", **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(config), "--run-dir", str(run), "--until", until]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finish(proc: subprocess.Popen, timeout: float = 1500) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def vllm_starts(run: Path) -> int:
    return sum(p.read_text(errors="replace").count("eyrie: starting vLLM") for p in run.rglob("server.log"))


@dataclass
class Pipeline:
    run: Path
    config: Path
    killed_at_step: int
    resume_out: str
    third_out: str
    third_s: float
    starts_before_third: int
    starts_after_third: int


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Pipeline:
    root = tmp_path_factory.mktemp("pipeline")
    target = build_tiny_target("tiny-llama-chat")
    config, _ = write_config(root / "config.yaml", target, "tiny-llama-chat", max_samples=192, shard_size=48,
                             layer_ids=[2, 4, 5], name="pipeline",
                             train={"epochs": 3, "lr": 3e-3, "max_seq_len": 512, "save_every_steps": 4},
                             evaluate={"num_prompts": 12, "max_tokens": 32, "num_speculative_tokens": 3})
    run = root / "run"
    for folder in (run / "extract", run / "export" / "server-trained", run / "evaluate" / "server-untrained"):
        register_server_folder(folder)
    finish(run_flow(config, run, until="extract"))

    # Full run, killed (flow process group, SIGKILL) once training has checkpointed a step mid-way.
    proc = run_flow(config, run, start_new_session=True)
    deadline, step = time.monotonic() + 900, 0
    while time.monotonic() < deadline and proc.poll() is None:
        states = [read_json(p) or {} for p in run.glob("train/*/checkpoints/*/training_state.json")]
        step = max((s.get("global_step", 0) for s in states), default=0)
        if step:
            break
        time.sleep(0.5)
    assert proc.poll() is None and step, "training never checkpointed while the flow ran"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()

    resume_out = finish(run_flow(config, run))
    starts = vllm_starts(run)
    t0 = time.monotonic()
    third_out = finish(run_flow(config, run))
    return Pipeline(run, config, step, resume_out, third_out, time.monotonic() - t0, starts, vllm_starts(run))


def test_training_resumes_from_the_saved_step(pipeline):
    manifest = read_json(pipeline.run / "train" / "manifest.json")
    assert manifest["resumed_from"], "the resumed run started training over"
    log = Path(manifest["log"]).read_text(errors="replace")
    assert log.count("===== eyrie:") == 2  # one launch killed, one resumed: not a third from scratch
    history = manifest["history"]
    assert [h["epoch"] for h in history] == [0, 1, 2]
    assert manifest["global_step"] == history[-1]["global_step"] > pipeline.killed_at_step


def test_export_is_servable_and_matches_extraction(pipeline):
    export = read_json(pipeline.run / "export" / "manifest.json")
    cfg = json.loads((Path(export["drafter"]) / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    server = read_json(pipeline.run / "extract" / "shards" / "shard-00000.json")
    assert server["num_layers"] == 4  # the three aux ids plus the last layer's output
    assert Path(cfg["speculators_config"]["verifier"]["name_or_path"]).resolve() == \
        build_tiny_target("tiny-llama-chat").resolve()
    proof = export["vllm_proof"]
    assert proof["completion_tokens"] > 0 and proof["completion"]


def test_trained_drafter_beats_untrained(pipeline):
    trained = read_json(pipeline.run / "evaluate" / "trained.json")
    untrained = read_json(pipeline.run / "evaluate" / "untrained.json")
    for r in (trained, untrained):
        assert r["drafts"] > 0 and len(r["per_position_acceptance"]) == 3
        assert 1.0 <= r["acceptance_length"] <= 4.0
        # acceptance length is 1 + the per-position rates summed (bonus token included)
        assert abs(r["acceptance_length"] - 1 - sum(r["per_position_acceptance"])) < 0.01
    assert trained["acceptance_length"] >= untrained["acceptance_length"] + 0.2, (trained, untrained)


def test_second_run_is_all_cached_and_starts_no_vllm(pipeline):
    assert pipeline.starts_after_third == pipeline.starts_before_third
    for stage in ("prepare", "vocab", "train", "export", "evaluate-trained", "evaluate-untrained"):
        assert f"Task run '{stage}" in pipeline.third_out
    assert "Cached" in pipeline.third_out and "Task run 'train-" in pipeline.third_out
    finished = [line for line in pipeline.third_out.splitlines() if "Finished in state" in line
                and any(f"'{s}-" in line for s in ("prepare", "vocab", "train", "export", "evaluate", "extract"))]
    assert finished and all("Cached" in line for line in finished), "\n".join(finished)
    assert "acceptance_length" in pipeline.third_out
