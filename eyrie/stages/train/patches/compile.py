"""Inductor's compile workers started early (train.speed.warm_compile_workers)."""

from __future__ import annotations


def _warm_compile_workers() -> None:
    """Start Inductor's pool of compile worker processes now, while the trainer imports speculators (15-22 s on an
    H200 node), instead of at the first compiled frame: torch starts it there (`maybe_warm_pool`), and until its
    workers are up the first frames' Triton kernels compile one by one in the training process. The workers are
    processes of their own, so their start overlaps the imports; they read TORCHINDUCTOR_CACHE_DIR, so this comes
    after `_compile_cache_beside`. torch's own check decides whether a pool is used at all (TORCH_WARM_POOL=0, one
    compile thread, no Triton)."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()
