"""Shared by the train benchmarks: the dimensions, the results file, the GPU and host samplers, the run folder's
config and the draft geometry."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "train_throughput.py"  # the CLI, which the trainer subprocess runs as `_bench_entry`
sys.path.insert(0, str(REPO))

KIMI = dict(
    hidden=7168,
    vocab=163840,
    draft_vocab=32000,
    layers=61,
    heads=64,
    kv_heads=64,
    qk_rope=64,
    intermediate=18432,
    aux=[2, 30, 58],
    seq=4096,
    row_tokens=2048,
    mask=163839,
)
TINY = dict(
    hidden=64,
    vocab=4096,
    draft_vocab=512,
    layers=8,
    heads=4,
    kv_heads=4,
    qk_rope=16,
    intermediate=128,
    aux=[2, 4, 5],
    seq=256,
    row_tokens=128,
    mask=4095,
)
PIDS = Path("/tmp/eyrie-train-throughput-pids")


def dims(args) -> dict:
    return TINY if args.tiny else KIMI


def emit(args, record: dict) -> dict:
    record = {"ts": round(time.time(), 3), **record}
    print(json.dumps(record), flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def load(root: Path):
    from eyrie.config import load_config

    return load_config(root / "eyrie.yaml"), json.loads((root / "target_facts.json").read_text())


def draft_geometry(root: Path) -> dict:
    from eyrie.target.drafter import draft_layer_config

    config, _ = load(root)
    c = draft_layer_config(config.target, config.train.num_layers)
    return {
        "hidden": c.hidden_size,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate": c.intermediate_size,
        "layers": c.num_hidden_layers,
    }


# ---------------------------------------------------------------------------------------------------------------
# step: the bare model step at the draft geometry Eyrie builds


def gzip_trace(trace: Path, name: str | None = None) -> None:
    import gzip

    with open(trace, "rb") as f, gzip.open(trace.with_name((name or trace.stem) + ".json.gz"), "wb", 6) as g:
        shutil.copyfileobj(f, g)
    trace.unlink()


# ---------------------------------------------------------------------------------------------------------------
# eyrie: the exact command training_command() builds, as run_training runs it


STEP_RE = re.compile(r"global_step[\"']?\s*[:=]\s*(\d+)")
NUM = r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"


class GpuSampler(threading.Thread):
    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.samples, self.stop = period, [], threading.Event()
        self.cpu: list = []
        self.energy: list = []  # (time, mJ since the driver loaded)

    def run(self) -> None:
        q = "utilization.gpu,power.draw,memory.used,clocks.sm"
        while not self.stop.is_set():
            e = gpu_energy_mj()
            if e is not None:
                self.energy.append((time.time(), e))
            try:
                r = subprocess.run(
                    ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                )
                self.samples.append((time.time(), [float(x) for x in r.stdout.strip().split("\n")[0].split(",")]))
            except Exception:  # noqa: BLE001  (no nvidia-smi on a CPU check)
                pass
            self.cpu.append((time.time(), cpu_times()))
            self.stop.wait(self.period)

    def summary(self, t0: float, t1: float) -> dict | None:
        s = [v for t, v in self.samples if t0 <= t <= t1]
        if not s:
            return None
        out = {}
        for i, c in enumerate(["util_gpu_pct", "power_W", "mem_used_MiB", "sm_clock_MHz"]):
            xs = sorted(v[i] for v in s)
            out[c] = {"mean": round(sum(xs) / len(xs), 1), "min": xs[0], "max": xs[-1]}
        out["samples"] = len(s)
        c = [v for t, v in self.cpu if t0 <= t <= t1 and v]
        if len(c) >= 2:  # all cores together, from /proc/stat
            out["cpu_busy_frac"] = round((c[-1][0] - c[0][0]) / max(1, c[-1][1] - c[0][1]), 3)
        e = [(t, v) for t, v in self.energy if t0 <= t <= t1]
        if len(e) >= 2 and e[-1][0] > e[0][0]:  # the GPU's own energy counter: mean power, exactly
            out["energy_W"] = round((e[-1][1] - e[0][1]) / 1000 / (e[-1][0] - e[0][0]), 1)
        return out


_NVML: list = []


def gpu_energy_mj() -> float | None:
    """GPU 0's energy counter (millijoules since the driver loaded), through NVML; None where there is none."""
    if not _NVML:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML.append((pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)))
        except Exception:  # noqa: BLE001  (no NVML or no GPU: a CPU check)
            _NVML.append(None)
    if _NVML[0] is None:
        return None
    nvml, handle = _NVML[0]
    try:
        return float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except Exception:  # noqa: BLE001  (a GPU without the counter)
        return None


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def metric(line: str, key: str) -> float | None:
    m = re.search(re.escape(key) + r"[\"']?\s*[:=]\s*" + NUM, line)
    return float(m.group(1)) if m else None
