"""eyrie: the exact command training_command() builds, run as run_training runs it."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from train_bench.common import PIDS, SCRIPT, STEP_RE, GpuSampler, emit, gzip_trace, load, metric
from train_bench.entry_hooks import BENCH_MARK

MILESTONES = {
    "config resolved": "speculator_type=",
    "model build started": "Loading vocab mappings",
    "trainer built": "Starting fresh training run",
    "epoch started": "Training epoch 1/",
}


def eyrie_command(args, root: Path, optimizer: str) -> tuple[list[str], Path, dict]:
    from eyrie.stages.prepare import load_seq_lens
    from eyrie.stages.train.command import training_command
    from eyrie.stages.train.data import TrainingData
    from eyrie.stages.train.trainer import steps_per_epoch
    from eyrie.stages.vocab import mapping_paths

    config, facts = load(root)
    config = config.model_copy(update={"train": config.train.model_copy(update={"optimizer": optimizer})})
    device = "cpu" if args.tiny else "cuda"
    # the same checkpoint frequency run_training passes (one GPU)
    spe = steps_per_epoch(load_seq_lens(root / "prepare"), config.train.max_seq_len, 1 - config.train.val_fraction)
    every = config.train.save_every_steps
    freq = 1.0 if not every or every >= spe else max(every / spe, 1 / spe)
    d2t, t2d = mapping_paths(root / "vocab", config.vocab.draft_vocab_size)
    save_path = root / "train" / f"bench-{optimizer}" / "checkpoints"
    if not args.keep_checkpoints:  # a fresh start (a kept folder would resume); the compile cache beside it stays
        shutil.rmtree(save_path.parent, ignore_errors=True)
    cmd = training_command(
        config,
        TrainingData(
            root / "prepare" / "dataset",
            root / "extract" / "hidden_states",
            d2t,
            t2d,
            config.extraction.layer_ids,
            facts,
        ),
        save_path,
        freq,
        device,
    )
    return (
        cmd,
        save_path,
        {
            "device": device,
            "steps_per_epoch": spe,
            "checkpoint_freq": freq,
            "log_every_steps": config.train.log_every_steps,
            "optimizer": optimizer,
        },
    )


def startup_cpu(sampler: GpuSampler, t0: float, t1: float, every_s: float = 2.0) -> list:
    """How busy the machine's cores were from launch to the first step: [seconds after launch, busy fraction of all
    cores] every ~`every_s` (from /proc/stat, which the GPU sampler reads every half second)."""
    c = [(t, v) for t, v in sampler.cpu if v and t0 - 1 <= t <= t1 + 1]
    out, last = [], None
    for t, v in c:
        if last is None:
            last = (t, v)
        elif t - last[0] >= every_s:
            busy = (v[0] - last[1][0]) / max(1, v[1] - last[1][1])
            out.append([round(t - t0, 1), round(busy, 2)])
            last = (t, v)
    return out


def switched(cmd: list[str], off: list[str], on: list[str]) -> None:
    """The trainer's options file (its --eyrie-options) with the train.speed choices `off` turned off and `on` turned
    on (names as train.speed's fields; the upper-case names of earlier results are accepted)."""
    from eyrie.stages.train.options import OPTIONS_FLAG, TrainerOptions

    path = Path(cmd[cmd.index(OPTIONS_FLAG) + 1])
    options = TrainerOptions.from_dict(json.loads(path.read_text()))
    values = options.switches.to_dict()
    for names, value in ((off, False), (on, True)):
        for name in names:
            if not isinstance(values.get(name.lower()), bool):
                raise SystemExit(f"{name} is no on/off choice of train.speed: {sorted(values)}")
            values[name.lower()] = value
    options = TrainerOptions.from_dict({**options.to_dict(), "speed": values})
    options.write(path)


def cmd_eyrie(args, optimizer: str | None = None) -> dict:
    optimizer = optimizer or args.optimizer
    root = Path(args.root)
    cmd, save_path, info = eyrie_command(args, root, optimizer)
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="2000")
    switched(cmd, args.off, getattr(args, "on", []))
    if not args.exact:  # the same argv through eyrie.stages.train.entry.main, with _bench_entry's measuring hooks
        i = cmd.index("eyrie.stages.train.entry")
        cmd = [cmd[0], str(SCRIPT), "_bench_entry", *cmd[i + 1 :]]
        bench = {
            "inmem": args.inmem,
            "off": args.off,
            "on": getattr(args, "on", []),
            "out": str(Path(args.log_dir).resolve()),
            "name": f"eyrie_{optimizer}{'_' + args.tag if args.tag else ''}",
        }
        if args.profile:
            bench["profile"] = [int(x) for x in args.profile.split(",")]
        env["EYRIE_BENCH"] = json.dumps(bench)
        info["hooks"] = bench
    if args.inmem:
        info["loader"] = "one pinned batch from memory (speculators' loaders replaced)"
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # eyrie.stages.train.entry's default: <run>/train/compile-cache
    compile_cache = root / "train" / "compile-cache"
    if getattr(args, "cold", False):  # a first launch on a fresh node: nothing compiled anywhere
        for cache in [compile_cache, Path.home() / ".triton", *Path("/tmp").glob("torchinductor_*")]:
            shutil.rmtree(cache, ignore_errors=True)
        info["cold"] = True
    cache_files_before = sum(1 for _ in compile_cache.rglob("*")) if compile_cache.exists() else 0
    log_path = Path(args.log_dir) / f"train_{optimizer}{'_' + args.tag if args.tag else ''}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sampler = GpuSampler()
    sampler.start()
    t_start = time.time()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        bufsize=1,
        text=True,
        errors="replace",
    )
    with open(PIDS, "a") as f:  # the shell wrapper kills these process groups if anything is left behind
        f.write(f"{proc.pid}\n")

    def on_term(signum, frame):  # `timeout` stops this driver: take the trainer (its own session) down too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    lines: queue.Queue = queue.Queue()

    def reader() -> None:
        for ln in proc.stdout:
            lines.put((time.time(), ln))
        lines.put((time.time(), None))

    threading.Thread(target=reader, daemon=True).start()
    steps: list[tuple[float, int, float | None]] = []  # (arrival, global_step, real tokens in that step)
    marks: dict[str, float] = {}
    bench_marks: dict[str, float] = {}
    bench_json: dict[str, list] = {}
    window_start = None
    deadline = t_start + args.startup_s
    with open(log_path, "w") as log:
        log.write("===== " + " ".join(cmd) + "\n")
        while time.time() < deadline:
            try:
                now, line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            log.write(line)
            for name, text in MILESTONES.items():
                if name not in marks and text in line:
                    marks[name] = round(now - t_start, 1)
            if line.startswith(BENCH_MARK + " "):  # _bench_entry's marks carry their own clock
                name, _, at = line[len(BENCH_MARK) + 1 :].strip().rpartition(" ")
                bench_marks.setdefault(name, round(float(at) - t_start, 1))
            elif line.startswith(BENCH_MARK + "-json "):
                for k, v in json.loads(line.split(" ", 1)[1]).items():
                    bench_json.setdefault(k, []).append(v)
            m = STEP_RE.search(line)
            if m and "profile" in line:
                tps, ms = metric(line, "tokens_per_s"), metric(line, "step_ms")
                steps.append((now, int(m.group(1)), tps * ms / 1000 if tps is not None and ms else None))
                if window_start is None and int(m.group(1)) >= args.warmup_steps:
                    window_start = now
                    deadline = now + args.window_s
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(1.0)
        while True:
            try:
                _, line = lines.get_nowait()
            except queue.Empty:
                break
            if line:
                log.write(line)
    proc.wait()
    sampler.stop.set()
    for trace in Path(args.log_dir).glob(f"trace_{proc.pid}.json"):
        gzip_trace(trace, f"trace_{optimizer}{'_' + args.tag if args.tag else ''}")
    out = {
        "what": "eyrie",
        "tag": args.tag,
        **info,
        "cmd": cmd,
        "log": str(log_path),
        "compile_cache_files_before": cache_files_before,
        "startup_milestones_s": marks,
        "startup_marks_s": bench_marks,
        "logged_steps": len(steps),
        **{k: v if k == "feed" else v[-1] for k, v in bench_json.items()},
    }
    try:  # every setting as speculators resolves the argv train_entry hands it
        from speculators.train.config import TrainConfig

        argv = cmd[cmd.index("eyrie.stages.train.entry" if args.exact else "_bench_entry") + 1 :]
        for own in ("--eyrie-verifier-weights", "--eyrie-metrics", "--eyrie-options", "--eyrie-plateau"):  # the entry's
            if own in argv:
                del argv[argv.index(own) : argv.index(own) + 2]
        flat = TrainConfig.resolve(argv).flatten()
        out["resolved"] = {
            k: flat.get(k)
            for k in (
                "optimizer",
                "lr",
                "muon_lr",
                "log_freq",
                "draft_attn_impl",
                "loss_implementation",
                "num_workers",
                "prefetch_factor",
                "hidden_states_dtype",
                "hidden_states_backend",
                "total_seq_len",
                "ttt_steps",
            )
        }
    except Exception as err:  # noqa: BLE001
        out["resolved"] = f"could not resolve: {err}"
    if steps:
        out["first_step_s"] = round(steps[0][0] - t_start, 1)
        out["startup_cpu_busy"] = startup_cpu(sampler, t_start, steps[0][0])
    win = [s for s in steps if window_start is not None and s[0] >= window_start]
    if len(win) >= 2:
        (t0, s0, _), (t1, s1, _) = win[0], win[-1]
        toks = [x for _, _, x in win if x]
        tok_step = sum(toks) / len(toks) if toks else float("nan")
        out["window"] = {
            "steps": s1 - s0,
            "s": round(t1 - t0, 2),
            "tokens_per_step": round(tok_step, 1),
            "steps_per_s": round((s1 - s0) / (t1 - t0), 3),
            "tokens_per_s": round((s1 - s0) * tok_step / (t1 - t0)),
            "gpu": sampler.summary(t0, t1),
        }
        out["tokens_per_s"] = out["window"]["tokens_per_s"]
    else:
        out["error_tail"] = log_path.read_text(errors="replace").splitlines()[-30:]
    return emit(args, out)
