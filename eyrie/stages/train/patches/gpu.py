"""The drafter on GPUs: what changes in speculators' EAGLE-3 model code, each behind a choice of train.speed
(switches.py). The trainer's own GPU changes are `EyrieTrainer`'s (eyrie/stages/train/eyrie_trainer.py) and the
loaders' are eyrie/stages/train/loaders.py."""

from __future__ import annotations

from eyrie.stages.train.patches.switches import Switches


def _drafter_speedups(switches: Switches | None = None) -> None:
    """Before the drafter is built: its accuracy counts and loss scalars without a GPU sync (sync_free_metrics), the
    block mask compiled after the first step (deferred_mask_compile), one launch config per pointwise kernel
    (one_pointwise_config), one key length for every TTT step (one_kv_length, last: it wraps the forward and mask
    builder the others put in place)."""
    switches = switches or Switches()
    if switches.sync_free_metrics:
        from eyrie.stages.train.patches.metrics import _accuracy_without_sync, _loss_scalars_without_sync

        _accuracy_without_sync()
        _loss_scalars_without_sync()
    if switches.deferred_mask_compile:
        from eyrie.stages.train.patches.compile import _block_mask_compiled_after_the_first_step

        _block_mask_compiled_after_the_first_step()
    if switches.one_pointwise_config:
        from eyrie.stages.train.patches.startup import _one_pointwise_config

        _one_pointwise_config()
    if switches.one_kv_length:
        from eyrie.stages.train.patches.one_kv_length import _one_kv_length

        _one_kv_length()
