"""A server start's phases, read from its log: vLLM's own line formats (vllm 0.32's CPU build, and the GPU model
runner's wording of the same phases), the last start of a log that holds several, and a phase whose lines are absent
left out rather than guessed."""

from __future__ import annotations

from datetime import datetime

from conftest import server_recorded_as_this_process

from eyrie.ops.status import server_status
from eyrie.vllm import phases

# Lines as vLLM 0.32 (CPU) wrote them for the demo's extraction server, abridged.
CPU_START = """
===== eyrie: starting vLLM at 2026-12-01 10:20:27 =====
(APIServer pid=21905) INFO 12-01 10:20:53 [api_utils.py:347]  version 0.32.0
(EngineCore pid=22805) INFO 12-01 10:21:39 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: ...
(Worker pid=23031) INFO 12-01 10:22:04 [cpu_model_runner.py:68] Starting to load model /targets/tiny-llama-chat...
(Worker pid=23031) INFO 12-01 10:22:04 [default_loader.py:501] Loading weights took 0.01 seconds
(Worker pid=23031) INFO 12-01 10:22:06 [cpu_model_runner.py:75] Loading drafter model...
(Worker pid=23031) INFO 12-01 10:22:06 [default_loader.py:501] Loading weights took 1581.85 seconds
(EngineCore pid=3) INFO 12-01 10:22:14 [core.py:402] init engine (profile, create kv cache, warmup model) took 6.07 s
INFO:     Application startup complete.
"""

# The same phases as the GPU model runner words them (vllm/v1/worker/gpu_model_runner.py, v1/engine/core.py).
GPU_START = """
===== eyrie: starting vLLM at 2026-12-02 08:00:00 =====
(APIServer pid=1) INFO 12-02 08:00:40 [api_utils.py:347]  version 0.33.0
(Worker_TP0 pid=5) INFO 12-02 08:01:10 [gpu_model_runner.py:4100] Starting to load model /data/kimi...
(Worker_TP0 pid=5) INFO 12-02 08:25:10 [default_loader.py:501] Loading weights took 1430.12 seconds
(Worker_TP0 pid=5) INFO 12-02 08:25:40 [gpu_model_runner.py:5150] Model loading took 71.2 GiB memory and 1465.3 seconds
(Worker_TP0 pid=5) INFO 12-02 08:27:00 [monitor.py:20] torch.compile took 61.20 s in total
(Worker_TP0 pid=5) INFO 12-02 08:28:00 [gpu_model_runner.py:6582] Graph capturing finished in 38 secs, took 1.2 GiB
(EngineCore pid=3) INFO 12-02 08:28:30 [core.py:396] init engine (profile, create kv cache, warmup model) took \
170.50 s (compilation: 61.20 s)
"""


def _ts(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S").timestamp()


def test_phases_of_a_cpu_start_are_timed_by_the_lines_stamps_not_vllms_wrong_drafter_figure():
    measured = phases.phases(CPU_START, ready_at=_ts("2026-12-01 10:22:18"))
    assert measured == {
        "imports": 26.0,
        "engine start": 71.0,
        "weights": 2.0,  # 10:22:04 -> 10:22:06, not the 1,581 s vLLM printed for the extraction head
        "engine init": 6.07,
        "API server": 4.0,
        "total": 111.0,
    }


def test_phases_of_a_gpu_start_split_the_engine_init_into_compile_and_cuda_graphs():
    measured = phases.phases(GPU_START, ready_at=_ts("2026-12-02 08:28:45"))
    assert measured["weights"] == 24 * 60 + 30  # 08:01:10 -> 08:25:40, the "Model loading took" line
    assert measured["engine init"] == 170.5 and measured["compile"] == 61.2 and measured["CUDA graphs"] == 38.0
    assert measured["total"] == 28 * 60 + 45
    table = phases.table(measured)
    assert "| weights | 1470 | 85% |" in table and "|   of which compile | 61 |" in table
    assert phases.summary(measured).startswith("imports 40 s, engine start 30 s, weights 1470 s, engine init 170 s")


def test_only_the_last_start_of_a_log_counts_and_missing_lines_are_left_out():
    measured = phases.phases(GPU_START + CPU_START)
    assert measured["weights"] == 2.0 and "compile" not in measured
    assert "API server" not in measured and "total" not in measured  # no ready time given
    assert phases.phases("nothing vLLM wrote\n") == {}


def test_status_names_where_a_servers_start_went(tmp_path):
    # A server recorded as this process (alive, owned): status reads its phases from server.json's record.
    server = server_recorded_as_this_process(tmp_path, started_at=_ts("2026-12-02 08:00:00"))
    server.log_path.write_text(GPU_START)
    line = server_status(server)
    assert line.startswith("starting: pid") and "weights 1470 s" in line and "so far" in line, line
