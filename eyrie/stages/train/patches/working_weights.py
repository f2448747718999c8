"""bfloat16 working copies of the float32 weights, made once a step."""

from __future__ import annotations

from eyrie.stages.train.patches.overlay import _Overlay


class _WorkingWeights:
    """bfloat16 working copies of a model's float32 weights, the way FSDP2's mixed precision runs (param_dtype
    bfloat16, float32 master weights and gradients for the optimizer), for one process without DDP or FSDP.

    Before each forward (a pre-hook on the model) every float32 parameter's `.data` becomes a bfloat16 copy:
    trainable ones copied from their float32 master every step, frozen ones (the target's embedding, norm and head,
    which nothing updates during training) once. Forward and backward then run on bfloat16 weights with no casts:
    under autocast a float32 weight is cast again in each compiled graph that uses it (each TTT step), its gradient
    cast back and summed in float32 per use, and the frozen float32 embedding turns the first layer's input and
    its elementwise work float32. `to_master()` puts the float32 weights back and hands each parameter its gradient
    as float32; it runs before the gradient clip and the optimizer step (which then see float32 weights and
    gradients, as before), after a forward without gradients (validation), and before any checkpoint is saved.
    What changes is rounding: the weights a matmul sees are the same bfloat16 values autocast makes, but norms
    multiply by bfloat16 weights, activations between layers are rounded to bfloat16, and a weight's gradient is
    summed over the TTT steps in bfloat16 before it is made float32."""

    def __init__(self, model, dtype) -> None:
        import torch

        self.params = [p for p in model.parameters() if p.dtype == torch.float32]
        self.master = [p.data for p in self.params]
        self.work = [torch.empty_like(m, dtype=dtype) for m in self.master]
        self.copied = [False] * len(self.params)
        self.working = False
        model.register_forward_pre_hook(lambda module, args: self.to_working())
        model.register_forward_hook(lambda module, args, out: None if torch.is_grad_enabled() else self.to_master())

    def to_working(self) -> None:
        import torch

        if self.working:
            return
        stale = [i for i, p in enumerate(self.params) if p.requires_grad or not self.copied[i]]
        with torch.no_grad():
            torch._foreach_copy_([self.work[i] for i in stale], [self.master[i] for i in stale])
        for i in stale:
            self.copied[i] = True
        for p, w in zip(self.params, self.work):
            p.data = w
        self.working = True

    def to_master(self) -> None:
        if not self.working:
            return
        for p, m in zip(self.params, self.master):
            g, p.grad = p.grad, None
            p.data = m
            if g is not None:
                p.grad = g.to(m.dtype)
        self.working = False


_WORKING: list = []  # the _WorkingWeights of this process's model (one, or none)


def _to_master_weights() -> None:
    for w in _WORKING:
        w.to_master()


def _bf16_working_weights() -> None:
    """The trainer keeps float32 weights and runs each step under bfloat16 autocast: at Kimi-K2.5 width the casts
    of weights and gradients and the float32 elementwise work they bring cost ~10 ms of an H200's 130 ms step
    (weight copies, float32 gradient sums, float32 norms over the first layer's input). `_WorkingWeights` runs
    forward and backward on bfloat16 copies made once a step instead, with float32 master weights, gradients and
    optimizer state, on one GPU (DDP and FSDP are left as they are; speculators' FSDP path already runs this way
    through its MixedPrecisionPolicy). The clip and the optimizer step see float32 weights and gradients; so does
    every checkpoint.

    Not under DDP, where they would be wrong rather than slow: DDP's reducer hooks each parameter's gradient
    accumulator, and a `.data` of another dtype gives the parameter a new one, so no gradient would be averaged and
    the ranks would drift apart without an error (measured with gloo on CPU: the two ranks' gradients differ after
    the first step). DDP's own mixed precision (`mixed_precision=`, a private `_MixedPrecision` in torch 2.13)
    needs streams and events, so it cannot be checked on CPU. Under DDP the trainer runs float32 weights under
    autocast; tests/integration/test_ddp.py checks that update against one process's."""
    import torch
    from speculators.train import trainer

    if trainer.torch is torch:  # only through the trainer's own view of torch (`_gpu_speedups`)
        return
    setup_model = trainer.Trainer.setup_model

    def setup_model_(self):
        setup_model(self)
        dtype = self.config.hidden_states_dtype
        one_process = not self.is_distributed and isinstance(self.model, torch.nn.Module)
        _WORKING[:] = [_WorkingWeights(self.model, dtype)] if one_process and dtype != torch.float32 else []

    clip = trainer.torch.nn.utils.clip_grad_norm_  # eyrie's (CLIP_IN_ADAMW) or torch's

    def clip_grad_norm_(parameters, *args, **kwargs):
        _to_master_weights()
        return clip(parameters, *args, **kwargs)

    step = trainer.Trainer._optimizers_step

    def _optimizers_step(self):
        _to_master_weights()
        return step(self)

    save = trainer.Trainer.maybe_save_checkpoint

    def maybe_save_checkpoint(self, *args, **kwargs):
        _to_master_weights()
        return save(self, *args, **kwargs)

    utils = _Overlay(torch.nn.utils, clip_grad_norm_=clip_grad_norm_)
    trainer.torch.nn = _Overlay(torch.nn, utils=utils)
    trainer.Trainer.setup_model = setup_model_
    trainer.Trainer._optimizers_step = _optimizers_step
    trainer.Trainer.maybe_save_checkpoint = maybe_save_checkpoint
