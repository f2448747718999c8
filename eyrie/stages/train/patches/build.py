"""The drafter built on its GPU, and trained in float32."""

from __future__ import annotations

import os


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


def _train_in_float32() -> None:
    """A warm start loads the drafter as exported (bfloat16); training keeps float32 weights, as a drafter built
    from scratch has (autocast still computes in bfloat16 on GPUs). On CPU, bfloat16 weights meet float32
    hidden states and the first matmul fails."""
    from speculators.train import cli

    build = cli.build_draft_model
    cli.build_draft_model = lambda *a, **k: build(*a, **k).float()
