"""`python -m eyrie.stages.train.entry ARGS` or `torchrun ... -m eyrie.stages.train.entry ARGS`: speculators' EAGLE-3
trainer.

On GPUs this is speculators' own entry point. With EYRIE_TRAIN_DEVICE=cpu it first patches the places where
speculators 0.9.0 assumes an accelerator (the device it moves the model and batches to and resumes onto, pinned
loader memory, `torch.accelerator.synchronize`, and the autocast device type), so the demo and CI train the same
way a GPU node does. On GPUs it changes only what costs time: AdamW runs fused and applies the gradient clip itself,
no step synchronises the GPU except logged ones (the trainer's counters, the model's accuracy counts and loss
scalars are made without waiting), batches are copied to the GPU ahead of their step on a stream of their own, the
progress bar is off, a fresh drafter is initialised on its GPU, data-loader workers (which only read files) are
forked from a server started first thing, never initialising CUDA, and on one GPU forward and backward run on
bfloat16 copies of the float32 weights made once a step (float32 master weights, gradients and optimizer state).
Each is a switch below (GPU_FEED, ...), which benchmarks/train_throughput.py turns off to measure it.
torch.compile's cache goes beside the run's checkpoints, so a retry or resume finds its kernels compiled. Every save
keeps the whole checkpoint it overwrites until the new one is whole (eyrie/stages/train/checkpoints.py).
"""

from __future__ import annotations

import json
import os
import sys


def _run_on_cpu() -> None:
    import torch
    from speculators.train import checkpointer, dataloader, trainer

    trainer.get_local_rank = lambda: "cpu"  # Trainer moves model and batches to `local_rank`
    checkpointer.get_current_device = lambda: "cpu"  # resume loads onto it ("cuda:0" without an accelerator)
    loader = dataloader.DataLoader
    dataloader.DataLoader = lambda *a, **k: loader(*a, **{**k, "pin_memory": False})  # pinning needs a device
    if torch.accelerator.is_available():
        return
    torch.accelerator.synchronize = lambda *a, **k: None
    _distributed_on_cpu()
    torch.accelerator.is_available = lambda: False
    current = torch.accelerator.current_accelerator

    def current_accelerator(check_available: bool = False):
        # Trainer picks its autocast device type from here, defaulting to "cuda" when there is none.
        return current(check_available=True) if check_available else torch.device("cpu")

    torch.accelerator.current_accelerator = current_accelerator


def _distributed_on_cpu() -> None:
    """Under torchrun without an accelerator (the DDP path's check on CPU, tests/integration/test_ddp.py),
    speculators' `maybe_setup_distributed` selects the rank's device and hands `init_process_group` that index as
    `device_id`; both need an accelerator. Here the first does nothing and the second is given no device, so the
    process group is gloo's (`get_default_backend_for_device("cpu")`) and DDP runs on CPU."""
    import torch
    import torch.distributed as dist
    from speculators.train import distributed

    torch.accelerator.set_device_index = lambda *a, **k: None

    def init_process_group(*args, device_id=None, **kwargs):  # noqa: ARG001
        return dist.init_process_group(*args, **kwargs)

    distributed.dist = _Overlay(dist, init_process_group=init_process_group)  # type: ignore[assignment]


def _worker_init(worker_id: int) -> None:  # noqa: ARG001
    """speculators' worker init, less `torch.accelerator.set_device_index`: that call creates a CUDA context in
    each of the (12, spawned) workers, which costs seconds each and GPU memory, for processes that only read files
    and collate on the CPU. Defined at module level so a spawned worker unpickles it by name."""
    import torch

    torch.set_num_threads(1)


def _gpu_speedups() -> None:
    import torch
    from speculators.train import dataloader, trainer

    dataloader._worker_init_fn = _worker_init  # looked up when the loaders are built

    build = trainer.build_optimizers

    def build_optimizers(model, config):
        """speculators builds AdamW with torch's default (foreach) implementation; the fused one does the same
        update in one kernel per group. Only for parameters that all live on a GPU (the fused kernel's need)."""
        out = []
        for opt in build(model, config):
            params = [p for g in opt.param_groups for p in g["params"]]
            if type(opt) is torch.optim.AdamW and params and all(p.is_cuda for p in params):
                groups = [{k: v for k, v in g.items() if k not in ("foreach", "fused")} for g in opt.param_groups]
                opt = torch.optim.AdamW(groups, fused=True)
            out.append(opt)
        return out

    trainer.build_optimizers = build_optimizers

    class _Torch(type(torch)):
        """The trainer's view of `torch`: `torch.tensor(<python number>, device=<gpu>)` is a host-to-device copy
        from pageable memory, which waits for the GPU; the trainer makes two per step (its error-record counters),
        so every step synchronised whatever --log-freq said. `torch.full` writes the same scalar on the device
        without waiting. Everything else is torch itself."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def tensor(data, *args, dtype=None, device=None, **kwargs):
            if (
                not args
                and not kwargs
                and isinstance(data, (int, float))
                and not isinstance(data, bool)
                and device is not None
                and torch.device(device).type == "cuda"
            ):
                return torch.full((), data, dtype=dtype or torch.get_default_dtype(), device=device)
            return torch.tensor(data, *args, dtype=dtype, device=device, **kwargs)

    trainer.torch = _Torch("torch")

    if CLIP_IN_ADAMW:
        _clip_inside_fused_adamw()
    if GPU_FEED:
        _feed_the_gpu_ahead()
        if FP8_ON_GPU:
            from eyrie.hidden_states import gpu_decode

            gpu_decode.install()
    if QUIET_PROGRESS:
        # speculators draws a rich progress bar (tqdm.rich) over every loader on rank 0: a refresh thread competing
        # for the GIL with the thread that launches the step's kernels, for a bar that lands in a log file as noise.
        # Loss, tokens/s and the step phases are logged every --log-freq steps anyway.
        trainer.tqdm = lambda iterable, *args, **kwargs: iterable
    if BUILD_ON_GPU:
        _build_on_gpu()
    if FORKSERVER_WORKERS:
        _fork_workers_from_a_server()
    if SYNC_FREE_METRICS:
        _accuracy_without_sync()
        _loss_scalars_without_sync()
    if BF16_WEIGHTS:
        _bf16_working_weights()


# Each is on for GPU training; benchmarks/train_throughput.py turns them off (`--off NAME`) to measure what each buys.
GPU_FEED = True
QUIET_PROGRESS = True
BUILD_ON_GPU = True
FORKSERVER_WORKERS = True
PINNED_LOADER = True  # with GPU_FEED: the loader pins batches (its pin-memory thread) before they are copied
SYNC_FREE_METRICS = True
CLIP_IN_ADAMW = True
BF16_WEIGHTS = True  # forward and backward on bfloat16 copies of the float32 weights, made once a step
FP8_ON_GPU = True  # with GPU_FEED: fp8 hidden-state files reach the GPU as fp8 and are decoded there (gpu_decode.py)
FEED_AHEAD = 2  # batches on the GPU, or being copied there, ahead of the step that takes them


def _copied_ahead(batches, device):
    """Iterate `batches` (a data loader's iterator) with every tensor already on `device`. A thread takes each batch
    from the loader and copies it on a CUDA stream of its own, up to FEED_AHEAD batches ahead; the step's stream
    waits for that copy alone (an event), and each tensor is marked as used by the step's stream so its memory is
    not reused before the step is done with it."""
    import queue
    import threading

    import torch

    from eyrie.hidden_states.gpu_decode import decode_batch

    copy_stream = torch.cuda.Stream(device)
    ready = queue.Queue(maxsize=FEED_AHEAD)  # type: ignore[var-annotated]
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def feed() -> None:
        try:
            torch.cuda.set_device(device)
            for batch in batches:
                with torch.cuda.stream(copy_stream):
                    moved = {
                        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                        for k, v in batch.items()
                    }
                    if FP8_ON_GPU:
                        moved = decode_batch(moved)
                    copied = torch.cuda.Event()
                    copied.record(copy_stream)
                if not put((moved, copied)):
                    return
            put((done, None))
        except BaseException as err:  # noqa: BLE001  (raised again in the training thread)
            put((err, None))

    thread = threading.Thread(target=feed, name="eyrie-gpu-feed", daemon=True)
    thread.start()
    try:
        while True:
            item, copied = ready.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            step_stream = torch.cuda.current_stream(device)
            step_stream.wait_event(copied)
            for v in item.values():
                if isinstance(v, torch.Tensor):
                    v.record_stream(step_stream)
            yield item
    finally:
        stop.set()
        thread.join(timeout=60)  # the thread ends once the batch it is waiting for arrives


def _feed_the_gpu_ahead() -> None:
    """speculators copies each batch to the GPU inside the step (`.to(non_blocking=True)` from pinned memory, on
    the step's own stream), so the ~235 MB of hidden states a packed Kimi-K2.5 batch holds crosses PCIe while the
    GPU computes nothing (4.3 ms a step on an H200), and a batch late from the loader stalls the step. Its
    loaders here hand over batches already on the GPU, copied on a stream of their own while earlier steps run
    (`_copied_ahead`); the trainer's own `.to()` then finds them there and does nothing."""
    import torch
    from speculators.train import dataloader

    class GpuFedLoader(dataloader.DataLoader):  # type: ignore[name-defined,misc]
        def __init__(self, *args, **kwargs):
            if not PINNED_LOADER:
                kwargs["pin_memory"] = False
            super().__init__(*args, **kwargs)

        def __iter__(self):
            return _copied_ahead(super().__iter__(), torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))

    dataloader.DataLoader = GpuFedLoader


def _build_on_gpu() -> None:
    """speculators builds a fresh drafter on the CPU, initialising every weight there (at Kimi-K2.5 width, a
    163840 x 7168 embedding and ~0.75 B trainable parameters: 16 s of an H200 host's start), before the trainer
    moves it to the GPU (1.6 s more). Built with its GPU as the default device, the build with the checkpoint's
    tensors read takes 1.6-1.9 s, on every launch, a retry's included. A warm start (--from-pretrained) loads as
    before."""
    import torch
    from speculators.train import cli

    build = cli.build_draft_model

    def build_draft_model(args, *rest, **kwargs):
        if getattr(args, "from_pretrained", None):
            return build(args, *rest, **kwargs)
        with torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))):
            return build(args, *rest, **kwargs)

    cli.build_draft_model = build_draft_model


class _Overlay:
    """`base` with some attributes replaced: how the trainer sees `torch.nn` and `torch.nn.utils` below."""

    def __init__(self, base, **replaced):
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._base, name)


def _clip_inside_fused_adamw() -> None:
    """The trainer clips the gradient norm to 1 (`clip_grad_norm_`): a pass reading every float32 gradient for the
    norm, another reading and writing them all to scale them (~3 GB each way at Kimi-K2.5 width), then fused AdamW
    reads them once more. Fused AdamW can apply the scale itself as it reads them (`grad_scale`, which it divides
    each gradient by, as for GradScaler): the norm is taken as before and the clip factor goes to the optimizer
    step, so the scaling pass is gone (~1.5 ms a step of memory traffic by count; on an H200 its effect was within
    the run-to-run clock variation). The same update, up to rounding (a division by the reciprocal of the factor
    instead of a multiplication); where any optimizer is not fused AdamW (Muon), gradients are scaled as before."""
    import torch
    from speculators.train import trainer

    if trainer.torch is torch:  # only through the trainer's own view of torch (`_gpu_speedups`)
        return
    pending: list = []

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        pending[:] = [(params, float(max_norm), total, foreach)]
        return total

    step = trainer.Trainer._optimizers_step

    def _optimizers_step(self):
        if not pending:
            return step(self)
        params, max_norm, total, foreach = pending.pop()
        if not all(type(o) is torch.optim.AdamW and o.defaults.get("fused") for o in self.optimizers):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
            return step(self)
        scale = torch.clamp((total + 1e-6) / max_norm, min=1.0)  # 1 / min(max_norm / (total + 1e-6), 1)
        for opt in self.optimizers:
            opt.grad_scale = scale
        try:
            return step(self)
        finally:
            for opt in self.optimizers:
                del opt.grad_scale

    utils = _Overlay(torch.nn.utils, clip_grad_norm_=clip_grad_norm_)
    trainer.torch.nn = _Overlay(torch.nn, utils=utils)
    trainer.Trainer._optimizers_step = _optimizers_step


class _WorkingWeights:
    """bfloat16 working copies of a model's float32 weights, the way FSDP2's mixed precision runs (param_dtype
    bfloat16, float32 master weights and gradients for the optimizer), for one process without DDP or FSDP.

    Before each forward (a pre-hook on the model) every float32 parameter's `.data` becomes a bfloat16 copy:
    trainable ones copied from their float32 master every step, frozen ones (the target's embedding, norm and head,
    which nothing updates during training) once. Forward and backward then run on bfloat16 weights with no casts:
    under autocast a float32 weight is cast again in each compiled graph that uses it (each TTT step), its gradient
    cast back and summed in float32 per use, and the frozen float32 embedding turns the first layer's input and
    its elementwise work float32. `to_master()` puts the float32 weights back and hands each parameter its gradient
    as float32; it runs before the gradient clip and the optimizer step (which then see float32 weights and
    gradients, as before), after a forward without gradients (validation), and before any checkpoint is saved.
    What changes is rounding: the weights a matmul sees are the same bfloat16 values autocast makes, but norms
    multiply by bfloat16 weights, activations between layers are rounded to bfloat16, and a weight's gradient is
    summed over the TTT steps in bfloat16 before it is made float32."""

    def __init__(self, model, dtype) -> None:
        import torch

        self.params = [p for p in model.parameters() if p.dtype == torch.float32]
        self.master = [p.data for p in self.params]
        self.work = [torch.empty_like(m, dtype=dtype) for m in self.master]
        self.copied = [False] * len(self.params)
        self.working = False
        model.register_forward_pre_hook(lambda module, args: self.to_working())
        model.register_forward_hook(lambda module, args, out: None if torch.is_grad_enabled() else self.to_master())

    def to_working(self) -> None:
        import torch

        if self.working:
            return
        stale = [i for i, p in enumerate(self.params) if p.requires_grad or not self.copied[i]]
        with torch.no_grad():
            torch._foreach_copy_([self.work[i] for i in stale], [self.master[i] for i in stale])
        for i in stale:
            self.copied[i] = True
        for p, w in zip(self.params, self.work):
            p.data = w
        self.working = True

    def to_master(self) -> None:
        if not self.working:
            return
        for p, m in zip(self.params, self.master):
            g, p.grad = p.grad, None
            p.data = m
            if g is not None:
                p.grad = g.to(m.dtype)
        self.working = False


_WORKING: list = []  # the _WorkingWeights of this process's model (one, or none)


def _to_master_weights() -> None:
    for w in _WORKING:
        w.to_master()


def _bf16_working_weights() -> None:
    """The trainer keeps float32 weights and runs each step under bfloat16 autocast: at Kimi-K2.5 width the casts
    of weights and gradients and the float32 elementwise work they bring cost ~10 ms of an H200's 130 ms step
    (weight copies, float32 gradient sums, float32 norms over the first layer's input). `_WorkingWeights` runs
    forward and backward on bfloat16 copies made once a step instead, with float32 master weights, gradients and
    optimizer state, on one GPU (DDP and FSDP are left as they are; speculators' FSDP path already runs this way
    through its MixedPrecisionPolicy). The clip and the optimizer step see float32 weights and gradients; so does
    every checkpoint.

    Not under DDP, where they would be wrong rather than slow: DDP's reducer hooks each parameter's gradient
    accumulator, and a `.data` of another dtype gives the parameter a new one, so no gradient would be averaged and
    the ranks would drift apart without an error (measured with gloo on CPU: the two ranks' gradients differ after
    the first step). DDP's own mixed precision (`mixed_precision=`, a private `_MixedPrecision` in torch 2.13)
    needs streams and events, so it cannot be checked on CPU. Under DDP the trainer runs float32 weights under
    autocast; tests/integration/test_ddp.py checks that update against one process's."""
    import torch
    from speculators.train import trainer

    if trainer.torch is torch:  # only through the trainer's own view of torch (`_gpu_speedups`)
        return
    setup_model = trainer.Trainer.setup_model

    def setup_model_(self):
        setup_model(self)
        dtype = self.config.hidden_states_dtype
        one_process = not self.is_distributed and isinstance(self.model, torch.nn.Module)
        _WORKING[:] = [_WorkingWeights(self.model, dtype)] if one_process and dtype != torch.float32 else []

    clip = trainer.torch.nn.utils.clip_grad_norm_  # eyrie's (CLIP_IN_ADAMW) or torch's

    def clip_grad_norm_(parameters, *args, **kwargs):
        _to_master_weights()
        return clip(parameters, *args, **kwargs)

    step = trainer.Trainer._optimizers_step

    def _optimizers_step(self):
        _to_master_weights()
        return step(self)

    save = trainer.Trainer.maybe_save_checkpoint

    def maybe_save_checkpoint(self, *args, **kwargs):
        _to_master_weights()
        return save(self, *args, **kwargs)

    utils = _Overlay(torch.nn.utils, clip_grad_norm_=clip_grad_norm_)
    trainer.torch.nn = _Overlay(torch.nn, utils=utils)
    trainer.Trainer.setup_model = setup_model_
    trainer.Trainer._optimizers_step = _optimizers_step
    trainer.Trainer.maybe_save_checkpoint = maybe_save_checkpoint


def _accuracy_without_sync() -> None:
    """speculators counts each TTT step's correct predictions with `torch.masked_select`, whose output size depends
    on the data: the GPU is synchronised there, three times a step, and each time the GPU idles while the host
    queues the small eager ops that follow (the TTT mask extension). The counts are the same without selecting:
    correct-and-masked positions summed, masked positions summed. On an H200 at Kimi-K2.5 width this took Eyrie's
    train stage from ~25.4k to ~28.1-28.9k tokens/s."""
    import torch
    from speculators.models.eagle3 import metrics

    def compute_accuracy_single_step(pred_ids, target_ids, loss_mask, prev_correct):
        correct = pred_ids == target_ids
        cond_total = torch.tensor(correct.numel(), dtype=torch.float, device=correct.device)
        if prev_correct is not None:
            cond_total = prev_correct.sum().float()
            correct = torch.logical_and(prev_correct, correct, out=prev_correct)
        if loss_mask is not None:
            mask = loss_mask.to(torch.bool)
            correct_sum = torch.logical_and(correct, mask).float().sum()
            full_total = mask.sum().float()
        else:
            correct_sum = correct.float().sum()
            full_total = torch.tensor(correct.numel(), dtype=torch.float, device=correct.device)
        return correct_sum, full_total, correct_sum.clone(), cond_total

    metrics.compute_accuracy_single_step = compute_accuracy_single_step


def _loss_scalars_without_sync() -> None:
    """`Eagle3DraftModel.forward` starts its loss at `torch.tensor(0.0, device=device)` and ends with
    `metrics["loss_total"] = torch.tensor(1.0, device=device)`; its TTT loop breaks torch.compile's graph, so both
    run eagerly, each a copy from pageable host memory that waits for the GPU: twice a step the host loses its lead
    and the GPU waits for it. The same forward, from speculators' own source with `torch.zeros((), ...)` and
    `torch.ones((), ...)` (made on the GPU, no wait) in their place, compiled the same way: ~28.9k to ~31.5k
    tokens/s on an H200 at Kimi-K2.5 width, the GPU then busy 99% of the time. Applied only when each of the two
    lines is found exactly once; otherwise speculators' forward is left as it is."""
    import inspect
    import textwrap

    from speculators.models.eagle3 import core

    compiled = core.Eagle3DraftModel.forward
    forward = getattr(compiled, "__wrapped__", compiled)
    edits = {
        "torch.tensor(0.0, device=device)": "torch.zeros((), device=device)",
        "torch.tensor(1.0, device=device)": "torch.ones((), device=device)",
    }
    try:
        lines, first = inspect.getsourcelines(forward)
    except (OSError, TypeError):
        return
    source = textwrap.dedent("".join(lines))
    if any(source.count(old) != 1 for old in edits):
        return
    for old, new in edits.items():
        source = source.replace(old, new)
    body = source.splitlines()
    while body and body[0].lstrip().startswith("@"):  # the compile decorator, applied again below
        body.pop(0)
        first += 1
    namespace: dict = {}
    code = compile("\n" * (first - 1) + "\n".join(body) + "\n", inspect.getsourcefile(forward) or "<eagle3>", "exec")
    exec(code, vars(core), namespace)  # noqa: S102  (speculators' own source, two calls replaced)
    patched = namespace[forward.__name__]
    patched.__qualname__ = forward.__qualname__
    core.Eagle3DraftModel.forward = core.conditional_torch_compile(patched)


_WORKER_SERVER_PRELOAD = ["torch", "speculators.train.data", "eyrie.stages.train.entry"]


def _start_worker_server() -> None:
    """speculators starts its loader workers (12 by default, for training and again for validation) with `spawn`:
    each a new interpreter that imports torch, datasets and speculators before it reads a file, all at once when
    the first epoch begins, while the first step waits for its batch. A `forkserver` started here, first thing,
    imports them once while this process imports and builds, and forks every worker already loaded; like spawn,
    and unlike a fork of the trainer, a worker never inherits its CUDA state. Measured on an H200 host: the first
    batch 2-3 s after the loaders are built, against 18-20 s with spawn. The server gets the one-thread settings
    speculators gives its workers (`_limit_worker_threads`); this process keeps its own."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(_WORKER_SERVER_PRELOAD)
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    saved = {k: os.environ.get(k) for k in names}
    for k in names:
        os.environ.setdefault(k, "1")
    try:
        forkserver.ensure_running()  # starts it and returns; it imports the preloads on its own
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fork_workers_from_a_server() -> None:
    """The loaders' workers come from `_start_worker_server`'s forkserver instead of `spawn`."""
    import multiprocessing

    from speculators.train import dataloader

    base = dataloader.DataLoader

    def loader(*args, **kwargs):
        if kwargs.get("multiprocessing_context") == "spawn":
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(_WORKER_SERVER_PRELOAD)
            kwargs["multiprocessing_context"] = context
        return base(*args, **kwargs)

    dataloader.DataLoader = loader


def _compile_cache_beside(save_path: str | None) -> None:
    """torch.compile's caches (Inductor's FX graph and AOTAutograd caches, Triton kernels) default to /tmp, which a
    fresh container or node does not have. `<run>/train/compile-cache` survives a retry or resume wherever the run
    folder does; it is keyed by content, so drafters of other keys share it safely. An explicit
    TORCHINDUCTOR_CACHE_DIR wins."""
    if save_path:
        from pathlib import Path

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(save_path).resolve().parent.parent / "compile-cache"))


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _keep_the_last_whole_checkpoint() -> None:
    """speculators overwrites `<epoch>/` in place on each save of that epoch. Rank 0 renames the whole folder aside
    first and deletes it once the new save is whole, so a kill mid-save leaves a whole checkpoint to resume from
    (eyrie.stages.train.checkpoints.recover puts it back). The fault point sits between the weights and the training
    state."""
    from pathlib import Path

    import torch.distributed as dist
    from speculators.train import trainer

    from eyrie.run.faults import fault_point
    from eyrie.stages.train.checkpoints import set_aside_previous, settle_save

    save = trainer.Trainer.maybe_save_checkpoint
    save_state = trainer.Trainer._save_training_state

    def maybe_save_checkpoint(self, epoch, local_step=0):
        folder = Path(self.checkpointer.path) / str(epoch)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0 and isinstance(epoch, int):
            set_aside_previous(folder)
        save(self, epoch, local_step=local_step)
        if rank0 and isinstance(epoch, int):
            settle_save(folder)

    def _save_training_state(self, epoch, local_step):
        fault_point(f"train.before-state.step{self.global_step}")
        save_state(self, epoch, local_step)

    trainer.Trainer.maybe_save_checkpoint = maybe_save_checkpoint
    trainer.Trainer._save_training_state = _save_training_state


class PlateauReached(Exception):
    """Raised after an epoch's validation when training has plateaued: ends speculators' epoch loop."""


def _record_validation(plateau: tuple[int, float] | None) -> None:
    """Write every epoch's validation metrics beside its checkpoint (speculators writes them only when the loss
    improved), and with `plateau` (patience, min_delta) stop once the predicted acceptance length has stopped
    rising: `plateau.json` in the checkpoints folder tells Eyrie not to relaunch. Every rank holds the same
    all-reduced metrics, so every rank decides the same."""
    from pathlib import Path

    import torch.distributed as dist
    from speculators.train import trainer

    from eyrie.run.folder import atomic_write_json
    from eyrie.stages.train.validation import (
        PLATEAU,
        VALIDATION,
        epoch_validation,
        plateaued,
        predicted_acceptance_length,
    )

    update_best = trainer.Trainer.maybe_update_best

    def maybe_update_best(self, epoch, val_metrics):
        update_best(self, epoch, val_metrics)
        if val_metrics is None:
            return
        save_path = Path(self.checkpointer.path)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            atomic_write_json(save_path / str(epoch) / VALIDATION, val_metrics)
        if plateau is None:
            return
        scores = {}
        for e in range(epoch + 1):
            metrics = val_metrics if e == epoch else epoch_validation(save_path / str(e))
            if metrics:
                scores[e] = predicted_acceptance_length(metrics)
        if plateaued(list(scores.values()), *plateau):
            best = max(scores, key=lambda e: scores[e])
            if rank0:
                atomic_write_json(save_path / PLATEAU, {"epoch": epoch, "best_epoch": best, "scores": scores})
            raise PlateauReached(f"validation plateaued at epoch {epoch} (best: epoch {best})")

    trainer.Trainer.maybe_update_best = maybe_update_best


def _load_verifier_weights_by(names: dict[str, str]) -> None:
    """speculators asks its loader for the verifier's `embed_tokens.weight`, `lm_head.weight` and
    `model.norm.weight` and matches them by suffix and a few aliases, so a target with other names (GPT-NeoX's
    `gpt_neox.embed_in`, GPT-2's `transformer.wte`) fails with a KeyError or, worse, gets a layer's norm. Preflight
    resolved the checkpoint's own names; here the loader is given exactly those. A name left out (a tied head) is
    not asked for, and speculators falls back to the embedding as it does for tied targets."""
    from speculators.utils import loading

    load = loading.load_model_layers

    def load_model_layers(layer_names: list[str], model_path: str):
        wanted = {n: names[n] for n in layer_names if n in names}
        found = load(list(wanted.values()), model_path)
        return {n: found[key] for n, key in wanted.items() if key in found}

    loading.load_model_layers = load_model_layers


def _train_in_float32() -> None:
    """A warm start loads the drafter as exported (bfloat16); training keeps float32 weights, as a drafter built
    from scratch has (autocast still computes in bfloat16 on GPUs). On CPU, bfloat16 weights meet float32
    hidden states and the first matmul fails."""
    from speculators.train import cli

    build = cli.build_draft_model
    cli.build_draft_model = lambda *a, **k: build(*a, **k).float()


def _pop_option(argv: list[str], name: str) -> str | None:
    if name not in argv:
        return None
    i = argv.index(name)
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def _online_hidden_states(argv: list[str]) -> None:
    """`--eyrie-online` (train.hidden_states: online, eyrie/stages/train/online.py): speculators' generate path builds
    the loaders'
    datasets, asking Eyrie's extraction server by its served name and API key (eyrie/stages/train/online_dataset.py)."""
    from eyrie.stages.train.online import API_KEY_ENV_FLAG, CONCURRENCY_FLAG, ONLINE_FLAG

    key_env = _pop_option(argv, API_KEY_ENV_FLAG)
    concurrency = _pop_option(argv, CONCURRENCY_FLAG)
    if ONLINE_FLAG in argv:
        argv.remove(ONLINE_FLAG)
        from eyrie.stages.train.online_dataset import install

        install(key_env, int(concurrency or 8))


def main(argv: list[str]) -> None:
    if os.environ.get("EYRIE_TRAIN_DEVICE") != "cpu":
        if FORKSERVER_WORKERS:
            _start_worker_server()
        _compile_cache_beside(_option(argv, "--save-path"))
    names = _pop_option(argv, "--eyrie-verifier-weights")
    if names:
        _load_verifier_weights_by(json.loads(names))
    _train_in_float32()
    _keep_the_last_whole_checkpoint()
    plateau = _pop_option(argv, "--eyrie-plateau")  # "patience,min_delta"
    _record_validation((int(plateau.split(",")[0]), float(plateau.split(",")[1])) if plateau else None)
    from eyrie.hidden_states.encoding import reader_arguments

    argv = reader_arguments(argv)  # speculators' fp8 backend: dequantizes fp8 files, reads bf16 ones unchanged
    from eyrie.hidden_states import pack_reader

    pack_reader.install()  # ... and reads packed storage (extraction.storage: packed); the GPU's install keeps it
    _online_hidden_states(argv)
    if os.environ.get("EYRIE_TRAIN_DEVICE") == "cpu":
        _run_on_cpu()
    else:
        _gpu_speedups()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    try:
        train(TrainConfig.resolve(argv))
    except PlateauReached as stop:
        from speculators.train.distributed import maybe_destroy_distributed

        print(f"eyrie: {stop}; training stops here", flush=True)
        maybe_destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
