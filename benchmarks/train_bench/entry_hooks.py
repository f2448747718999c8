"""_bench_entry: Eyrie's train entry with measuring hooks that change nothing it does (start-up marks, batch waits,
host time per step, a profiler window)."""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path

from train_bench.profiling import ClockProbe, analyse_trace, compile_summary, write_profile_tables

BENCH_MARK = "eyrie-bench"  # "<BENCH_MARK> <name> <unix time>" and "<BENCH_MARK>-json {...}" lines in the trainer log


def _mark(name: str) -> None:
    print(f"{BENCH_MARK} {name} {time.time():.3f}", flush=True)


def _memory_loaders(
    *,
    data_path,
    total_seq_len,
    hidden_states_dtype,
    hidden_size,
    num_target_layers,
    preprocess,
    train_data_ratio=0.9,
    gpu_feed=True,
    **_,
):
    """speculators' loaders replaced by one collated, pinned batch served from memory (same model, optimizer,
    trainer loop and host-to-device copy): the trainer without its loader."""
    import math

    import torch
    from datasets import load_from_disk
    from speculators.train.data import CollateFn

    from eyrie.stages.train.patches import feed

    class MemoryLoader:
        batch_sampler = None

        def __init__(self, batch: dict, n: int):
            self.batch, self.n = batch, n

        def __len__(self) -> int:
            return self.n

        def __iter__(self):
            batches = (dict(self.batch) for _ in range(self.n))
            if gpu_feed and torch.cuda.is_available():  # as eyrie.stages.train.entry feeds speculators' loaders
                return feed._copied_ahead(batches, torch.device("cuda", 0))
            return batches

    ds = load_from_disk(data_path).with_format(None)
    lens = list(ds["seq_len"])
    g = torch.Generator().manual_seed(0)
    samples, used, i = [], 0, 0
    while used < total_seq_len:
        t = lens[i % len(lens)]
        hs = torch.randn(t, num_target_layers + 1, hidden_size, generator=g).to(hidden_states_dtype)
        samples.append(
            {
                "hidden_states": hs[:, :-1].flatten(1),
                "input_ids": torch.tensor(ds[i]["input_ids"]),
                "verifier_last_hidden_states": hs[:, -1],
                "loss_mask": torch.tensor(ds[i]["loss_mask"]),
                "lengths": torch.tensor([t]),
                "position_ids": torch.arange(t),
            }
        )
        used += t
        i += 1
    batch = CollateFn(
        total_seq_len,
        hidden_size,
        num_target_layers=num_target_layers,
        dtype=hidden_states_dtype,
        preprocess=preprocess,
    )(samples)
    if torch.cuda.is_available():
        batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    n_train = int(len(lens) * train_data_ratio)
    steps = max(1, math.ceil(sum(min(x, total_seq_len) for x in lens[:n_train]) / total_seq_len))
    return MemoryLoader(batch, steps), MemoryLoader(batch, 2)


def _bench_entry(argv: list[str]) -> None:
    """Eyrie's train entry (`eyrie.stages.train.entry.main`, the same argv) with measuring hooks that change nothing it
    does: marks of where start-up time goes, the time the training thread waits for each batch, host time per step
    and, with `profile`, a torch.profiler window over a few steps, analysed (`analyse_trace`) and written beside
    the log. Options come as JSON in EYRIE_BENCH: inmem (the loaders replaced by `_memory_loaders`), profile
    ([first step, steps]), off (eyrie.stages.train.entry switches turned off), out (folder for the trace and
    summary)."""
    opts = json.loads(os.environ.pop("EYRIE_BENCH", "{}"))
    _mark("entry")
    import eyrie.stages.train.entry as entry  # light: its imports come inside main()
    from eyrie.stages.train.options import OPTIONS_FLAG, TrainerOptions
    from eyrie.stages.train.patches import workers

    # the options file cmd_eyrie wrote (its --off/--on applied there), read as main() will read it
    options = TrainerOptions.from_dict(json.loads(Path(argv[argv.index(OPTIONS_FLAG) + 1]).read_text()))
    switches = options.switches
    if switches.forkserver_workers and options.device != "cpu":
        workers._start_worker_server()  # where main() starts it, before the heavy imports (again there: a no-op)
    if options.device != "cpu":
        # as main() does before its imports: importing speculators sets TORCHINDUCTOR_CACHE_DIR to /tmp's default
        # when it is unset, and main()'s own call after the imports below would then leave it there
        entry._compile_cache_beside(entry._option(argv, "--save-path"))
        if switches.warm_compile_workers:  # where main() starts them, before the heavy imports (again: a no-op)
            from eyrie.stages.train.patches.compile import _warm_compile_workers

            _warm_compile_workers()
    import torch

    _mark("torch imported")
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train import cli, trainer

    _mark("speculators imported")
    from eyrie.stages.train import loaders

    if opts.get("inmem"):  # eyrie.stages.train.entry.train imports train_val_loaders when it runs

        def memory_loaders(args, hidden_size, num_target_layers, preprocess, **_):
            return _memory_loaders(
                data_path=args.data_path,
                total_seq_len=args.total_seq_len,
                hidden_states_dtype=getattr(torch, args.hidden_states_dtype),
                hidden_size=hidden_size,
                num_target_layers=num_target_layers,
                preprocess=preprocess,
                train_data_ratio=args.train_data_ratio,
                gpu_feed=switches.gpu_feed,
            )

        loaders.train_val_loaders = memory_loaders  # type: ignore[assignment]

    def timed(owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def wrapper(*a, **k):
            _mark(name + " start")
            try:
                return fn(*a, **k)
            finally:
                _mark(name + " end")

        setattr(owner, attr, wrapper)

    timed(cli, "parse_vocab_mappings", "vocab")
    timed(cli, "build_draft_model", "build")  # inside entry.build_drafter (GPU device, float32)
    timed(Eagle3DraftModel, "load_verifier_weights", "verifier weights")
    timed(loaders, "train_val_loaders", "loaders")
    timed(trainer.Trainer, "__init__", "trainer init")
    cuda = torch.cuda.is_available()
    profile = opts.get("profile")
    out = Path(opts.get("out") or ".")
    stats = {"wait_s": 0.0, "batches": 0}

    class TimedLoader:
        """The train loader as the loop sees it, timing each wait for the next batch."""

        def __init__(self, loader):
            self._loader = loader

        def __getattr__(self, name):
            return getattr(self._loader, name)

        def __len__(self) -> int:
            return len(self._loader)

        def __iter__(self):
            it = iter(self._loader)
            while True:
                t = time.perf_counter()
                with torch.profiler.record_function("eyrie-bench.next_batch"):
                    try:
                        batch = next(it)
                    except StopIteration:
                        return
                stats["wait_s"] += time.perf_counter() - t
                stats["batches"] += 1
                if stats["batches"] == 1:
                    _mark("first batch")
                yield batch

    probe: list = []

    gc_pause = {"n": [0, 0, 0], "s": [0.0, 0.0, 0.0], "t": 0.0}

    def on_gc(phase: str, info: dict) -> None:  # the collector's pauses, by generation
        if phase == "start":
            gc_pause["t"] = time.perf_counter()
        else:
            gc_pause["n"][info["generation"]] += 1
            gc_pause["s"][info["generation"]] += time.perf_counter() - gc_pause["t"]

    import gc

    gc.callbacks.append(on_gc)

    def train_epoch_measured(self, epoch, train_epoch, *args, step_callback=None, **kwargs):
        prof = None
        last = {"t": time.perf_counter(), "step": self.global_step, "wait": 0.0, "gc": [0, 0.0]}

        def after_step() -> None:
            nonlocal prof
            if step_callback is not None:  # eyrie.stages.train.entry's own, outside this one
                step_callback()
            n = self.global_step
            if n == 1:
                if cuda:
                    torch.cuda.synchronize()
                _mark("first step done")
                print(f"{BENCH_MARK}-json " + json.dumps({"compile": compile_summary()}), flush=True)
            if profile and n == profile[0] and cuda:
                prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                prof.start()
                probe[:] = [ClockProbe()]
                probe[0].start()
            if prof is not None and n == profile[0] + profile[1]:
                prof.stop()
                clocks = probe[0].summary()
                trace = out / f"trace_{os.getpid()}.json"
                prof.export_chrome_trace(str(trace))
                summary = {"steps": profile[1], "first_step": profile[0], **analyse_trace(trace)}
                name = opts.get("name") or f"trainer_{os.getpid()}"
                summary.update(write_profile_tables(prof, trace, profile[1], out, name, clocks))
                prof = None
                print(f"{BENCH_MARK}-json " + json.dumps({"profile": summary}), flush=True)
                last.update(
                    t=time.perf_counter(), step=n, wait=stats["wait_s"], gc=[gc_pause["n"][2], sum(gc_pause["s"])]
                )
            if n % 25 == 0 and n > last["step"]:
                dt = time.perf_counter() - last["t"]
                feed = {
                    "step": n,
                    "host_ms_per_step": round(dt * 1000 / (n - last["step"]), 1),
                    "loader_wait_ms_per_step": round((stats["wait_s"] - last["wait"]) * 1000 / (n - last["step"]), 1),
                    "gc_gen2_passes": gc_pause["n"][2] - last["gc"][0],
                    "gc_pause_ms": round((sum(gc_pause["s"]) - last["gc"][1]) * 1000, 1),
                }
                print(f"{BENCH_MARK}-json " + json.dumps({"feed": feed}), flush=True)
                last.update(
                    t=time.perf_counter(), step=n, wait=stats["wait_s"], gc=[gc_pause["n"][2], sum(gc_pause["s"])]
                )

        loader = self.train_loader
        self.train_loader = TimedLoader(loader)
        try:
            return train_epoch(epoch, *args, step_callback=after_step, **kwargs)
        finally:
            self.train_loader = loader

    # Around each EyrieTrainer's own bound train_epoch (speculators' code, which EyrieTrainer binds in its __init__
    # with its view of torch): the class attribute Trainer.train_epoch stays speculators' own.
    from eyrie.stages.train.eyrie_trainer import EyrieTrainer

    eyrie_init = EyrieTrainer.__init__

    def init_measured(self, *args, **kwargs):
        eyrie_init(self, *args, **kwargs)
        inner = self.train_epoch
        self.train_epoch = types.MethodType(
            lambda self, epoch, *a, **kw: train_epoch_measured(self, epoch, inner, *a, **kw), self
        )

    EyrieTrainer.__init__ = init_measured
    entry.main(argv)
