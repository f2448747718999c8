"""The GPU changes' switches: each is on for GPU training; benchmarks/train_throughput.py turns them off
(`--off NAME`) to measure what each buys."""

from __future__ import annotations

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
# the block mask built eagerly until a background thread has compiled its builder (patches/compile.py): off, since
# that thread's FX tracing races the training thread's model calls (a crash after step 1, docs/stages/train.md)
DEFERRED_MASK_COMPILE = False
# every TTT step's attention at one padded key length, one compile for all (one_kv_length.py): off until the
# background mask compile's race with FX tracing is fixed (docs/stages/train.md, Start-up) and its tokens/s measured
ONE_KV_LENGTH = False
# Inductor's compile workers started before the heavy imports instead of at the first compiled frame (compile.py)
WARM_COMPILE_WORKERS = False
