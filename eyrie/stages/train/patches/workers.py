"""The loaders' workers: no CUDA context in them, forked from a server started first thing."""

from __future__ import annotations

import os


def _worker_init(worker_id: int) -> None:  # noqa: ARG001
    """speculators' worker init, less `torch.accelerator.set_device_index`: that call creates a CUDA context in
    each of the (12, spawned) workers, which costs seconds each and GPU memory, for processes that only read files
    and collate on the CPU. Defined at module level so a spawned worker unpickles it by name."""
    import torch

    torch.set_num_threads(1)


_WORKER_SERVER_PRELOAD = ["torch", "speculators.train.data", "eyrie.stages.train.patches.workers"]


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
