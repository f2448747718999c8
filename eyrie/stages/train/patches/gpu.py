"""speculators on GPUs: only what costs time changes, each change behind a switch (switches.py, train.speed)."""

from __future__ import annotations

from eyrie.stages.train.patches.switches import Switches


def _gpu_speedups(switches: Switches | None = None) -> None:
    import torch
    from speculators.train import dataloader, trainer

    from eyrie.stages.train.patches.build import _build_on_gpu
    from eyrie.stages.train.patches.clip import _clip_inside_fused_adamw
    from eyrie.stages.train.patches.compile import _block_mask_compiled_after_the_first_step
    from eyrie.stages.train.patches.feed import _feed_the_gpu_ahead
    from eyrie.stages.train.patches.metrics import _accuracy_without_sync, _loss_scalars_without_sync
    from eyrie.stages.train.patches.workers import _fork_workers_from_a_server, _worker_init
    from eyrie.stages.train.patches.working_weights import _bf16_working_weights

    switches = switches or Switches()
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

    if switches.clip_in_adamw:
        _clip_inside_fused_adamw()
    if switches.gpu_feed:
        _feed_the_gpu_ahead(switches)
        if switches.fp8_on_gpu:
            from eyrie.hidden_states import gpu_decode

            gpu_decode.install()
    if switches.quiet_progress:
        # speculators draws a rich progress bar (tqdm.rich) over every loader on rank 0: a refresh thread competing
        # for the GIL with the thread that launches the step's kernels, for a bar that lands in a log file as noise.
        # Loss, tokens/s and the step phases are logged every --log-freq steps anyway.
        trainer.tqdm = lambda iterable, *args, **kwargs: iterable
    if switches.build_on_gpu:
        _build_on_gpu()
    if switches.forkserver_workers:
        _fork_workers_from_a_server()
    if switches.sync_free_metrics:
        _accuracy_without_sync()
        _loss_scalars_without_sync()
    if switches.bf16_weights:
        _bf16_working_weights()
    if switches.deferred_mask_compile:
        _block_mask_compiled_after_the_first_step()
    if switches.eager_rotary:
        from eyrie.stages.train.patches.startup import _rotary_tables_eager

        _rotary_tables_eager()
    if switches.one_pointwise_config:
        from eyrie.stages.train.patches.startup import _one_pointwise_config

        _one_pointwise_config()
    if switches.one_kv_length:  # last: it wraps the forward and mask builder the patches above put in place
        from eyrie.stages.train.patches.one_kv_length import _one_kv_length

        _one_kv_length()
