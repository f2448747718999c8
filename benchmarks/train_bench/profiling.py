"""Kernel tables, their comparison, compile summaries and trace analysis."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

from train_bench.common import _NVML, emit, gpu_energy_mj


def kernel_kind(name: str, cat: str) -> str:
    n = name.lower()
    if cat != "kernel":
        return cat + (" HtoD" if "htod" in n else " DtoH" if "dtoh" in n else " DtoD" if "dtod" in n else "")
    for k, pats in (
        ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90")),
        ("flex attention", ("flex", "triton_tem")),
        ("fused adam", ("fused_adam", "fusedadam")),
        ("foreach (clip, zero)", ("multi_tensor", "foreach")),
        ("triton fused", ("triton",)),
    ):
        if any(x in n for x in pats):
            return k
    return "other"


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def family(name: str) -> str:
    """A kernel's name less what differs between two compilations of the same code: Inductor numbers its kernels
    per graph (triton_tem_fused_flex_attention_3 in one, _4 in another)."""
    return re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name


class ClockProbe(threading.Thread):
    """GPU 0's SM clock, sampled every 20 ms through NVML, and its energy counter at the start and the end: what
    the GPU ran at while a profiled window ran (kernel times scale with the clock)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop, self.clocks, self.t0, self.e0 = threading.Event(), [], time.time(), gpu_energy_mj()

    def run(self) -> None:
        while not self.stop.is_set() and _NVML and _NVML[0] is not None:
            nvml, handle = _NVML[0]
            try:
                self.clocks.append(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
            except Exception:  # noqa: BLE001
                return
            self.stop.wait(0.02)

    def summary(self) -> dict:
        self.stop.set()
        out: dict = {"sm_clock_MHz": round(sum(self.clocks) / len(self.clocks)) if self.clocks else None}
        e1, dt = gpu_energy_mj(), time.time() - self.t0
        if self.e0 is not None and e1 is not None and dt > 0:
            out["energy_W"] = round((e1 - self.e0) / 1000 / dt, 1)
        return out


def kernel_table(trace: Path, steps: int) -> dict:
    """Every GPU kernel, copy and memset of a profiled window by full name: launches and milliseconds per step."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    rows: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in GPU_CATS:
            row = rows.setdefault(e.get("name", "?"), [kernel_kind(e.get("name", ""), e["cat"]), 0, 0.0])
            row[1] += 1
            row[2] += float(e["dur"]) / 1000
    table = sorted(([n, k, c / steps, ms / steps] for n, (k, c, ms) in rows.items()), key=lambda r: -r[3])
    return {
        "steps": steps,
        "gpu_ms_per_step": round(sum(r[3] for r in table), 3),
        "rows": [[n, k, round(c, 2), round(ms, 4)] for n, k, c, ms in table],
    }


def key_averages_table(prof) -> str:
    """torch.profiler's own table of the window, by GPU time (the sort key's name differs between versions)."""
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=120, max_name_column_width=110)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=120)


def write_profile_tables(prof, trace: Path, steps: int, out_dir: Path, name: str, clocks: dict) -> dict:
    """kernels_<name>.json (kernel_table, with the window's clock and power) and keyavg_<name>.txt (key_averages)
    in out_dir: what `compare` reads. Returns the window's totals."""
    table = {"name": name, "clocks": clocks, **kernel_table(trace, steps)}
    (out_dir / f"kernels_{name}.json").write_text(json.dumps(table, indent=0) + "\n")
    try:
        (out_dir / f"keyavg_{name}.txt").write_text(key_averages_table(prof) + "\n")
    except Exception as err:  # noqa: BLE001  (the kernel table above is the comparison's input anyway)
        (out_dir / f"keyavg_{name}.txt").write_text(f"key_averages failed: {err}\n")
    return {"tables": f"kernels_{name}.json", "gpu_ms_per_step": table["gpu_ms_per_step"], "clocks": clocks}


def compare_tables(a: dict, b: dict, top: int = 40) -> tuple[dict, str]:
    """Kernel by kernel, b against a, per step: by kind, by family (Inductor's numbering removed) and by name.
    With both windows' SM clocks known, b's time is also given at a's clock (times scaled by clock_b / clock_a,
    right for kernels bound by the clock, such as matrix products), which separates more work from a slower GPU."""
    ca, cb = (a.get("clocks") or {}).get("sm_clock_MHz"), (b.get("clocks") or {}).get("sm_clock_MHz")
    scale = cb / ca if ca and cb else None

    def group(t: dict, key) -> dict:
        out: dict = {}
        for n, k, c, ms in t["rows"]:
            g = out.setdefault(key(n, k), [0.0, 0.0])
            g[0] += c
            g[1] += ms
        return out

    sections = {}
    lines = [
        f"{b['name']} against {a['name']}, per step: GPU time {b['gpu_ms_per_step']:.2f}"
        f" vs {a['gpu_ms_per_step']:.2f} ms"
        f" (SM clock {cb} vs {ca} MHz; energy {b.get('clocks', {}).get('energy_W')} vs"
        f" {a.get('clocks', {}).get('energy_W')} W)"
    ]
    if scale:
        lines.append(f"{b['name']} at {a['name']}'s clock: {b['gpu_ms_per_step'] * scale:.2f} ms")
    for title, key, limit in (
        ("kind", lambda n, k: k, None),
        ("family", lambda n, k: family(n)[:100], top),
        ("name", lambda n, k: n[:100], top),
    ):
        ga, gb = group(a, key), group(b, key)
        rows = []
        for k in set(ga) | set(gb):
            (na, ma), (nb, mb) = ga.get(k, [0.0, 0.0]), gb.get(k, [0.0, 0.0])
            rows.append([k, round(na, 2), round(nb, 2), round(ma, 3), round(mb, 3), round(mb - ma, 3)])
            if scale:
                rows[-1].append(round(mb * scale - ma, 3))
        rows.sort(key=lambda r: -abs(r[5]))
        sections[title] = rows[:limit] if limit else rows
        head = f"{'by ' + title:<102} {'n/step a':>9} {'b':>7} {'ms a':>8} {'ms b':>8} {'b-a':>8}"
        lines += ["", head + (f" {'b@a-clk-a':>9}" if scale else "")]
        for r in sections[title]:
            lines.append(
                f"{r[0]:<102} {r[1]:>9} {r[2]:>7} {r[3]:>8.3f} {r[4]:>8.3f} {r[5]:>8.3f}"
                + (f" {r[6]:>9.3f}" if scale else "")
            )
    return {"a": a["name"], "b": b["name"], "clock_scale_b_to_a": scale, **sections}, "\n".join(lines)


def cmd_compare(args) -> dict:
    a, b = (json.loads(Path(x).read_text()) for x in args.compare)
    record, text = compare_tables(a, b)
    print(text, flush=True)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"compare_{b['name']}_vs_{a['name']}.txt").write_text(text + "\n")
    return emit(args, {"what": "compare", **record})


def compile_summary() -> dict:
    """Where torch.compile's time went up to now (dynamo's per-phase totals), how many graphs it made and why it
    broke them, and Inductor's cache counters: read after the first step, whose wait is mostly compiling."""
    out: dict = {}
    try:
        from torch._dynamo.utils import compile_times, counters

        out["compile_times"] = compile_times(repr="str", aggregate=True)
        out["stats"] = dict(counters["stats"])
        out["graph_breaks"] = dict(counters["graph_break"].most_common(12))
        out["inductor"] = {k: v for k, v in counters["inductor"].items() if "cache" in k or "compile" in k}
        out["aot_autograd"] = dict(counters["aot_autograd"])
        from torch._dynamo import utils as dynamo_utils

        frames = []  # each compiled frame: its compile time and its slowest Triton kernels to compile
        for m in list(getattr(dynamo_utils, "_compilation_metrics", [])):
            kernels = getattr(m, "triton_kernel_compile_times_us", None)
            frames.append(
                [
                    getattr(m, "co_name", None),
                    getattr(m, "entire_frame_compile_time_s", None),
                    getattr(m, "backend_compile_time_s", None),
                    json.loads(kernels)[:6] if isinstance(kernels, str) else kernels,
                ]
            )
        out["frames"] = frames
    except Exception as err:  # noqa: BLE001  (another torch's internals: the marks still say when)
        out["error"] = repr(err)
    return out


def analyse_trace(path: Path, gap_ms: float = 0.3) -> dict:
    """Where a torch.profiler window's time went on the GPU: the span from the first to the last GPU activity,
    the time some kernel or copy ran (busy), kernel time by kind, the largest kernels, and the GPU's idle gaps with
    what the training thread was doing on the host meanwhile (the ops that overlap each gap most)."""
    events = json.loads(path.read_text()).get("traceEvents", [])
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e)
        for e in xs
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    busy, gaps = 0.0, []
    cur_s, cur_e = gpu[0][0], gpu[0][1]
    for s, e, _ in gpu[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e, _ in gpu) - gpu[0][0]

    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    streams: dict[str, float] = {}
    for s, e, ev in gpu:
        k = kernel_kind(ev.get("name", ""), ev["cat"])
        by_kind[k] = by_kind.get(k, 0.0) + (e - s)
        row = by_name.setdefault(ev.get("name", "?")[:90], [0, 0.0])
        row[0] += 1
        row[1] += e - s
        sid = str(ev.get("args", {}).get("stream", ev.get("tid")))
        streams[sid] = streams.get(sid, 0.0) + (e - s)
    host = [e for e in xs if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")]
    per_tid: dict = {}  # the training thread: the one that launches the most kernels
    for e in host:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "aunch" in e.get("name", ""):
            per_tid[e.get("tid")] = per_tid.get(e.get("tid"), 0) + 1
    main_tid = max(per_tid, key=lambda t: per_tid[t]) if per_tid else None
    main = [e for e in host if e.get("tid") == main_tid]
    sync_names = ("Synchronize", "cudaMemcpy ", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaHostRegister")
    syncs: dict[str, list] = {}
    for e in host:
        name = e.get("name", "")
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and (
            any(x in name for x in sync_names) or name == "cudaMemcpy"
        ):
            row = syncs.setdefault(f"{name} (tid {e.get('tid')})", [0, 0.0])
            row[0] += 1
            row[1] += float(e["dur"])
    big = sorted((g for g in gaps if (g[1] - g[0]) / 1000 >= gap_ms), key=lambda g: g[0] - g[1])
    gap_rows = []
    for g0, g1 in big[:15]:
        overlap: dict[str, float] = {}
        for e in main:
            s, t = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            o = min(t, g1) - max(s, g0)
            if o > 0:
                overlap[e.get("name", "?")[:70]] = overlap.get(e.get("name", "?")[:70], 0.0) + o
        gap_rows.append(
            {
                "at_ms": round((g0 - gpu[0][0]) / 1000, 2),
                "ms": round((g1 - g0) / 1000, 2),
                "host_ops": {k: round(v / 1000, 2) for k, v in sorted(overlap.items(), key=lambda kv: -kv[1])[:4]},
            }
        )
    ms = lambda us: round(us / 1000, 2)  # noqa: E731
    return {
        "span_ms": ms(span),
        "busy_ms": ms(busy),
        "busy_frac": round(busy / span, 3) if span else None,
        "idle_gaps": {
            f">={gap_ms}ms": [
                sum(1 for g in gaps if (g[1] - g[0]) / 1000 >= gap_ms),
                ms(sum(g[1] - g[0] for g in gaps if (g[1] - g[0]) / 1000 >= gap_ms)),
            ],
            "all": [len(gaps), ms(sum(g[1] - g[0] for g in gaps))],
        },
        "gpu_ms_by_kind": {k: ms(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "gpu_ms_by_stream": {k: ms(v) for k, v in streams.items()},
        "training_thread": main_tid,
        "top_kernels": [[n, c, ms(t)] for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]],
        "host_sync_calls": {k: [c, ms(t)] for k, (c, t) in sorted(syncs.items(), key=lambda kv: -kv[1][1])[:12]},
        "largest_gaps": gap_rows,
    }
