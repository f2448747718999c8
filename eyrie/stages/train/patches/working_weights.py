"""bfloat16 working copies of the float32 weights, made once a step."""

from __future__ import annotations


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
