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
# The start-up switches. With DEFERRED_MASK_COMPILE, ONE_KV_LENGTH, EAGER_ROTARY and ONE_POINTWISE_CONFIG on, the
# first step from a cold compile cache on one H200 at Kimi-K2.5 width came 55.2, 44.1, 45.3 (bf16) and 44.7 s (fp8)
# after launch on two machines, and 49.3 s as the defaults on a third, at 0.929-0.936 of the bare step, with the
# image's bytecode compiled (2026-12-03; 56.5-66.7 s before, when every trainer compiled torch's compiler from
# source); 94.7 s with all four off. So they are on. ONE_KV_LENGTH costs 2.5-3% of tokens/s for about 20 s of the
# start: a run of more than ~15 minutes of training loses more GPU time to it than it saves, so
# EYRIE_TRAIN_SWITCHES_OFF=ONE_KV_LENGTH turns it off (any switch of this module, comma-separated;
# `off_by_environment`). docs/stages/train.md, Start-up, has each one's figures.
# The block mask built eagerly until a background thread has compiled its builder (patches/compile.py), FX tracing
# made per-thread so that thread cannot race the training thread (no crash in 12 cold runs on an H200); tokens/s
# unchanged with it alone (33,552 vs 33,331, an earlier call)
DEFERRED_MASK_COMPILE = True
# every TTT step's attention at one padded key length, one compile for all (one_kv_length.py): about 20 s of the cold
# start, for 2.5-3% of tokens/s (0.929-0.953 of the bare step against 0.963-0.969 without it)
ONE_KV_LENGTH = True
# Inductor's compile workers started before the heavy imports instead of at the first compiled frame (compile.py):
# off, no gain measured (first step 68.8 / 70.2 s with it, 67.7 s without, fp8, same machine)
WARM_COMPILE_WORKERS = False
# the rotary embedding's cos/sin tables made eagerly, no frame compiled for them (startup.py): that frame was 3.0-4.9 s
# of a cold first step's compiling, for a table of microseconds a step
EAGER_ROTARY = True
# Inductor compiles one launch config per pointwise Triton kernel (its untuned heuristic) instead of autotuning 2-6,
# each compiled and timed at the first launch (startup.py). With EAGER_ROTARY, on top of the two above: compiling
# 31.5 s against 41.6 s and the first step 56.5 s against 63.9 s in the same call; 0.926-0.928 of the bare step
# against 0.932 (another call)
ONE_POINTWISE_CONFIG = True

OFF_ENV = "EYRIE_TRAIN_SWITCHES_OFF"


def off_by_environment(environ=None) -> list[str]:
    """Turn off the switches $EYRIE_TRAIN_SWITCHES_OFF names (comma-separated); the names turned off. A name that is
    no switch of this module is refused, so a typo is not a switch silently left on."""
    import os

    value = (os.environ if environ is None else environ).get(OFF_ENV, "")
    names = [n.strip() for n in value.split(",") if n.strip()]
    known = {k for k, v in globals().items() if k.isupper() and isinstance(v, bool)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(
            f"{OFF_ENV} names {', '.join(unknown)}, which is no switch; the switches: {', '.join(sorted(known))}"
        )
    for name in names:
        globals()[name] = False
    return names
