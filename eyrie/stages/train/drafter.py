"""The drafter's GPU speed choices (train.speed, patches/switches.py) applied to the built drafter instance alone:
speculators' `Eagle3DraftModel` class, its module and the modules it imports are left as installed.

`apply_speed_choices(drafter, switches)` binds on the instance:

- `forward`: speculators' forward, its own code (as installed; pinned by tests/unit/test_train_patch_guards.py)
  reading Eyrie's pieces where it names `DynamicCache`, `extend_mask_for_draft_tokens` and `compute_metrics`, and
  compiled as speculators compiles it (`conditional_torch_compile`): sync_free_metrics (patches/metrics.py: no GPU
  sync for the accuracy counts and the loss scalars) and one_kv_length (patches/one_kv_length.py: one key length for
  every TTT step);
- `_build_attn_mask`: the block mask built eagerly from the documents' block layout (deferred_mask_compile:
  torch.compiler.disable, no frame compiled for it, and eyrie/stages/train/block_mask.py, speculators' BlockMask
  without the dense mask; compiling speculators' builder cost 24 s of the first step from a cold cache on an H200 at
  Kimi-K2.5 width), padded to the TTT steps' key length with one_kv_length;
- the rotary embedding's `forward` eager (eager_rotary, patches/startup.py).

`inductor_settings(switches)` is the context the trainer runs in for one_pointwise_config (Inductor's own
`config.patch`).
"""

from __future__ import annotations

import contextlib
import types

from eyrie.stages.train.patches.overlay import with_globals
from eyrie.stages.train.patches.switches import Switches


def drafter_forward(switches: Switches):
    """The EAGLE-3 forward `switches` asks for (an unbound function of (self, ...)), or None for speculators' own."""
    if not (switches.sync_free_metrics or switches.one_kv_length):
        return None
    from speculators.models.eagle3 import core

    from eyrie.stages.train.patches import metrics, one_kv_length

    compiled = core.Eagle3DraftModel.forward
    stock = getattr(compiled, "__wrapped__", compiled)
    namespace = dict(vars(core))
    edits = None
    if switches.sync_free_metrics:
        namespace["compute_metrics"] = metrics.compute_metrics_without_sync()
        edits = metrics.LOSS_SCALAR_EDITS
    if switches.one_kv_length:
        namespace["DynamicCache"] = one_kv_length.fixed_length_cache(core.DynamicCache)
        namespace["extend_mask_for_draft_tokens"] = one_kv_length.extend_mask_for_draft_tokens
    forward = core.conditional_torch_compile(with_globals(stock, namespace, edits))
    if switches.one_kv_length:
        forward = one_kv_length.around_forward(forward, stock)
    return forward


def mask_builder(switches: Switches):
    """The drafter's `_build_attn_mask` `switches` asks for (unbound), or None for speculators' own: eager
    (torch.compiler.disable, no frame compiled for it), from the documents' block layout where it can be
    (eyrie/stages/train/block_mask.py: speculators' BlockMask without the dense mask), else speculators' builder."""
    if not (switches.deferred_mask_compile or switches.one_kv_length):
        return None
    import inspect

    import torch
    from speculators.models.eagle3 import core

    from eyrie.stages.train.block_mask import document_block_mask, fits

    stock = core.Eagle3DraftModel._build_attn_mask
    block = inspect.signature(core.create_block_mask).parameters["BLOCK_SIZE"].default  # create_block_mask's own

    def _build_attn_mask(self, doc_ids_1d, seq_len, device, sliding_window=None):
        if (
            self._create_mask_fn is core.create_block_mask
            and sliding_window is None
            and isinstance(block, int)
            and doc_ids_1d.device.type == torch.device(device).type
            and fits(doc_ids_1d, seq_len, block)
        ):
            mask_mod = core.create_combined_mask_mod(doc_ids_1d, seq_len, sliding_window=None)
            return document_block_mask(doc_ids_1d, seq_len, mask_mod, block)
        return stock(self, doc_ids_1d, seq_len, device, sliding_window)

    build = torch.compiler.disable(_build_attn_mask)
    if switches.one_kv_length:
        from eyrie.stages.train.patches.one_kv_length import padded_mask_builder

        build = padded_mask_builder(build)
    return build


def apply_speed_choices(drafter, switches: Switches) -> None:
    """The drafter's speed choices bound on `drafter` (an Eagle3DraftModel) itself; see the module's docstring."""
    forward = drafter_forward(switches)
    if forward is not None:
        drafter.forward = types.MethodType(forward, drafter)
    build = mask_builder(switches)
    if build is not None:
        drafter._build_attn_mask = types.MethodType(build, drafter)
    if switches.eager_rotary:
        from eyrie.stages.train.patches.startup import rotary_eager

        rotary_eager(drafter)


def inductor_settings(switches: Switches | None) -> contextlib.AbstractContextManager:
    """The Inductor settings the trainer runs under: with one_pointwise_config, one launch config per pointwise
    kernel (patches/startup.py), set by Inductor's own `config.patch` for as long as the context lasts."""
    if switches is None or not switches.one_pointwise_config:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    from eyrie.stages.train.patches.startup import ONE_POINTWISE_CONFIG

    return inductor_config.patch(ONE_POINTWISE_CONFIG)
