"""Issue 25 item 6: each drafter's measurement names the vLLM version, model runner, attention backend and serving
arguments it was measured under (eyrie/vllm/provenance.py, read from the server's own log); nothing is compared
across servers that differ, a cached measurement under another server is measured again (tasks/evaluate.py), and
promotion refuses to decide across them and records both."""

from __future__ import annotations

import json
import random

import pytest
from prefect import flow

from eyrie.run.files import atomic_write_json
from eyrie.stages.evaluate import baseline_warnings, compare_drafters, request_statistics
from eyrie.stages.promote import decide, decide_and_promote
from eyrie.vllm.provenance import differences, served_under
from eyrie.vllm.spec import ServerSpec
from tasks.evaluate import EvaluateJob, stale_against_reference

# Lines of a real vLLM 0.32 CPU server log (Eyrie's evaluation server), and of a CUDA one's backend choice.
CPU_LOG = """
===== eyrie: starting vLLM at 2026-12-01 10:41:01 =====
(APIServer pid=1) INFO 12-01 10:41:10 [api_utils.py:347]  \u2584\u2584 \u2584\u2588 \u2588  version 0.32.0
(APIServer pid=1) WARNING 12-01 10:41:10 [v.py:7] Model Runner V2 requires Triton; using the V1 model runner instead.
(EngineCore pid=2) INFO 12-01 10:41:19 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='t'
(EngineCore pid=2) INFO 12-01 10:41:20 [cpu_model_runner.py:68] Starting to load model /targets/t...
(EngineCore pid=2) INFO 12-01 10:41:23 [utils.py:347] Using LBHNC KV cache layout.
"""
GPU_LOG = """
===== eyrie: starting vLLM at 2026-12-01 09:00:00 =====
(APIServer pid=1) INFO 12-01 09:00:09 [api_utils.py:347]  version 0.31.2
(EngineCore pid=2) INFO 12-01 09:00:19 [core.py:133] Initializing a V1 LLM engine (v0.31.2) with config: model='t'
(EngineCore pid=2) INFO 12-01 09:00:20 [cuda.py:507] Using FLASH_ATTN attention backend out of potential ones.
(EngineCore pid=2) INFO 12-01 09:00:21 [model_runner.py:120] Starting to load model /targets/t...
"""


def _spec(**kw) -> ServerSpec:
    return ServerSpec(model="/targets/t", drafter="/d", **kw)


def test_the_record_names_version_runner_backend_and_serving_arguments():
    rec = served_under(
        GPU_LOG + CPU_LOG, _spec(server_args=["--seed", "0", "--per-request-spec-decode-metrics", "summary"])
    )
    # Only the log's last start counts: the CPU one.
    assert rec["vllm_version"] == "0.32.0"
    assert rec["model_runner"] == "cpu_model_runner (V1; vLLM fell back from V2)"
    assert rec["attention_backend"] is None  # the CPU platform names none (it has one); "LBHNC" is no backend
    serving = rec["serving"]
    assert serving["server_args"] == ["--seed", "0"]  # how acceptance is reported is not what is computed
    assert serving["dtype"] == "bfloat16" and serving["num_speculative_tokens"] == 3 and serving["enforce_eager"]
    gpu = served_under(GPU_LOG, _spec())
    assert gpu["vllm_version"] == "0.31.2"
    assert gpu["model_runner"] == "model_runner (V2)"
    assert gpu["attention_backend"] == "FLASH_ATTN"


def test_every_change_is_named_and_a_reporting_flag_is_none():
    base = served_under(CPU_LOG, _spec())
    assert (
        differences(base, served_under(CPU_LOG, _spec(server_args=["--per-request-spec-decode-metrics=summary"]))) == []
    )
    assert differences(base, served_under(CPU_LOG, _spec(server_args=["--max-num-seqs", "4"]))) == []  # scheduling
    changed = {
        "vllm_version": served_under(CPU_LOG.replace("0.32.0", "0.33.0"), _spec()),
        "model_runner": served_under(CPU_LOG.replace("cpu_model_runner", "gpu_model_runner"), _spec()),
        "attention_backend": served_under(
            GPU_LOG.replace("0.31.2", "0.32.0").replace("model_runner.py", "cpu_model_runner.py"), _spec()
        ),
        "dtype": served_under(CPU_LOG, _spec(dtype="float16")),
        "server_args": served_under(CPU_LOG, _spec(server_args=["--kv-cache-dtype", "fp8"])),
        "server_env": served_under(CPU_LOG, _spec(server_env={"VLLM_ATTENTION_BACKEND": "TRITON_ATTN"})),
        "tensor_parallel_size": served_under(CPU_LOG, _spec(tensor_parallel_size=2)),
    }
    for field, other in changed.items():
        found = differences(base, other)
        assert any(d.startswith(f"{field}:") for d in found), (field, found)
    assert differences(None, None) == []  # two measurements from before the record: compared as before
    assert differences(base, None)  # one without it: not comparable


def _measured(label, rate, served, seed=0):
    rng = random.Random(seed)
    reqs = []
    for _ in range(30):
        n = rng.randint(5, 30)
        acc = sum(sum(1 for _ in range(3) if rng.random() < rate) for _ in range(n))
        reqs.append({"drafts": n, "accepted": acc, "per_pos": [acc // 3] * 3})
    stats = request_statistics(reqs)
    return {
        "label": label,
        "acceptance_length": stats["pooled"]["acceptance_length"]["value"],
        "requests": reqs,
        "statistics": stats,
        "served_under": served,
        "drafter": f"/promo/versions/{label}",
    }


def test_nothing_is_compared_across_servers_and_promotion_refuses(tmp_path):
    here = served_under(CPU_LOG, _spec())
    elsewhere = served_under(CPU_LOG.replace("0.32.0", "0.33.0"), _spec())
    results = {"trained": _measured("trained", 0.8, here), "current": _measured("current", 0.2, elsewhere, 1)}
    comparisons = compare_drafters(results)
    assert "current" not in comparisons  # no paired difference across servers
    warnings = baseline_warnings(results, comparisons)
    assert any("measured under different servers" in w and "vllm_version: '0.32.0' vs '0.33.0'" in w for w in warnings)
    candidate = {**results["trained"], "versus": comparisons}
    ok, why = decide(candidate, results["current"])
    assert not ok and "measured under another server" in why and "measures the current drafter again" in why
    # The same drafters under one server: compared, and the better one promoted; the record names its server.
    results["current"]["served_under"] = here
    comparisons = compare_drafters(results)
    assert comparisons["current"]["clearly_better"]
    drafter = tmp_path / "new"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    promo = tmp_path / "promo"
    (promo / "versions" / "current").mkdir(parents=True)
    (promo / "current").symlink_to("versions/current")
    d = decide_and_promote(promo, drafter, "v2", {**results["trained"], "versus": comparisons}, results["current"], {})
    assert d["promoted"], d["reason"]
    record = json.loads((promo / "versions" / "v2" / "promotion.json").read_text())
    assert record["served_under"]["vllm_version"] == "0.32.0"
    assert record["served_under"]["model_runner"].startswith("cpu_model_runner")
    assert record["current_served_under"] == here


def test_a_cached_measurement_under_another_server_is_measured_again(tmp_path):
    spec = _spec()
    job = EvaluateJob("current", "/d", spec, str(tmp_path / "s"), [], 8, str(tmp_path / "current.json"), "k", 1.0)
    assert stale_against_reference(job) == []  # nothing measured yet
    atomic_write_json(tmp_path / "trained.json", {"served_under": served_under(CPU_LOG, spec)})
    atomic_write_json(tmp_path / "current.json", {"key": "k", "served_under": served_under(CPU_LOG, spec)})
    assert stale_against_reference(job) == []  # the same server: the measurement stands
    atomic_write_json(tmp_path / "trained.json", {"served_under": served_under(GPU_LOG, spec)})
    changed = stale_against_reference(job)
    assert any(c.startswith("vllm_version:") for c in changed) and any(
        c.startswith("attention_backend:") for c in changed
    )
    # The trained drafter is the reference itself; an explicit reference is read where it is given.
    trained = EvaluateJob("trained", "/d", spec, str(tmp_path / "s"), [], 8, str(tmp_path / "trained.json"), "k", 1.0)
    assert trained.reference_path() is None and stale_against_reference(trained) == []
    atomic_write_json(tmp_path / "other.json", {"served_under": served_under(CPU_LOG, spec)})
    job.reference = str(tmp_path / "other.json")
    assert stale_against_reference(job) == []


@pytest.mark.usefixtures("flow_api")
def test_the_task_measures_the_current_drafter_again_when_the_trained_one_was_served_otherwise(tmp_path, monkeypatch):
    """Through Prefect, with the task's cache: the current drafter's finished measurement (same key) is reused
    while the trained drafter's was measured under the same server, and measured again once it was not."""
    from test_acceptance_statistics import FakeClient

    import tasks.evaluate as te

    hists = {f"p{i}": [1, 2, 1, i % 3] for i in range(4)}
    client = FakeClient(hists, per_request=True)
    sent = []
    real_chat = client.chat
    client.chat = lambda messages, max_tokens: (sent.append(messages), real_chat(messages, max_tokens))[1]
    monkeypatch.setattr(te, "serve", lambda spec, folder, timeout: client)
    monkeypatch.setattr(te, "stop", lambda folder: None)
    server_dir = tmp_path / "server-current"
    server_dir.mkdir()
    (server_dir / "server.log").write_text(CPU_LOG)
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(4)]
    job = EvaluateJob(
        "current", "/d", _spec(), str(server_dir), prompts, 8, str(tmp_path / "current.json"), f"k-{tmp_path.name}", 1.0
    )
    atomic_write_json(tmp_path / "trained.json", {"served_under": served_under(CPU_LOG, _spec())})

    @flow
    def evaluate_once():
        return te.evaluate_task(job)

    first = evaluate_once()
    assert len(sent) == 4 and first["served_under"]["model_runner"].startswith("cpu_model_runner")
    evaluate_once()
    assert len(sent) == 4  # the same server: the finished measurement stands
    atomic_write_json(tmp_path / "trained.json", {"served_under": served_under(GPU_LOG, _spec())})
    again = evaluate_once()
    assert len(sent) == 8  # the trained drafter was served otherwise: measured again before any comparison
    assert again["served_under"] == first["served_under"]
