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
# the block mask built eagerly until a background thread has compiled its builder (patches/compile.py), FX tracing
# made per-thread so that thread cannot race the training thread (no crash in 4 cold runs on an H200). Off: the first
# step is still over 60 s cold with it (65-70 s with ONE_KV_LENGTH), the one bar for turning a start-up change on
# (docs/stages/train.md, Start-up); tokens/s unchanged with it alone (33,552 vs 33,331, an earlier call)
DEFERRED_MASK_COMPILE = False
# every TTT step's attention at one padded key length, one compile for all (one_kv_length.py): off, it costs about
# 2.5% tokens/s (0.944-0.953 of the bare step against the stock 0.969), which a run of more than ~15 minutes pays back
# more than the ~20 s of start-up it saves
ONE_KV_LENGTH = False
# Inductor's compile workers started before the heavy imports instead of at the first compiled frame (compile.py):
# off, no gain measured (first step 68.8 / 70.2 s with it, 67.7 s without, fp8, same machine)
WARM_COMPILE_WORKERS = False
