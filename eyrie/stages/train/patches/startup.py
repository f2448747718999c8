"""Less to compile before the first step: the rotary tables made eagerly, one launch config per pointwise kernel.

speculators' EAGLE-3 forward breaks its graph inside the TTT loop, so Dynamo runs the loop itself in Python and
compiles each module the loop calls as a frame of its own, one after another, each waiting for its Triton kernels
before it runs. From a cold compile cache on an H200 at Kimi-K2.5 width two costs stood out in those frames:

- the rotary embedding's frame (transformers' `dynamic_rope_update` `wrapper`): 3.0-4.9 s to compile a kernel that
  makes a [4096, 64] cos/sin table, three times a step, without gradients. Eager it is a few microsecond kernels.
- Inductor autotunes a pointwise kernel over 2 launch configs (1-D) or 6 (2-D tiles, the transposes around
  attention), compiling every one and timing them on the first launch; the rotary kernel's 6 configs were most of
  its compile. Pointwise kernels are memory-bound and their first config is the heuristic Inductor picks when it
  does not tune (`triton.autotune_pointwise = False`), so one config is compiled and none is timed. Reductions and
  the flex-attention templates are tuned as before.

Both on the drafter's own instance and Inductor's own settings (eyrie/stages/train/drafter.py): nothing replaced.
"""

from __future__ import annotations


def rotary_eager(model) -> None:
    """The drafter's rotary embedding runs eagerly (torch.compiler.disable on the instance's forward): no frame
    compiled for it. Same tables, up to the rounding of eager against Triton's cos/sin."""
    import torch

    rotary = getattr(model, "rotary_emb", None)
    if isinstance(rotary, torch.nn.Module):
        rotary.forward = torch.compiler.disable(rotary.forward)


# Inductor compiles one launch config per pointwise Triton kernel instead of autotuning several: the settings
# eyrie.stages.train.drafter.inductor_settings hands Inductor's `config.patch` around the training.
ONE_POINTWISE_CONFIG = {"triton.autotune_pointwise": False}
