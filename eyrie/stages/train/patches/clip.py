"""The gradient clip applied by fused AdamW as it reads the gradients."""

from __future__ import annotations

from eyrie.stages.train.patches.overlay import _Overlay


def _clip_inside_fused_adamw() -> None:
    """The trainer clips the gradient norm to 1 (`clip_grad_norm_`): a pass reading every float32 gradient for the
    norm, another reading and writing them all to scale them (~3 GB each way at Kimi-K2.5 width), then fused AdamW
    reads them once more. Fused AdamW can apply the scale itself as it reads them (`grad_scale`, which it divides
    each gradient by, as for GradScaler): the norm is taken as before and the clip factor goes to the optimizer
    step, so the scaling pass is gone (~1.5 ms a step of memory traffic by count; on an H200 its effect was within
    the run-to-run clock variation). The same update, up to rounding (a division by the reciprocal of the factor
    instead of a multiplication); where any optimizer is not fused AdamW (Muon), gradients are scaled as before."""
    import torch
    from speculators.train import trainer

    if trainer.torch is torch:  # only through the trainer's own view of torch (`_gpu_speedups`)
        return
    pending: list = []

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        pending[:] = [(params, float(max_norm), total, foreach)]
        return total

    step = trainer.Trainer._optimizers_step

    def _optimizers_step(self):
        if not pending:
            return step(self)
        params, max_norm, total, foreach = pending.pop()
        if not all(type(o) is torch.optim.AdamW and o.defaults.get("fused") for o in self.optimizers):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
            return step(self)
        scale = torch.clamp((total + 1e-6) / max_norm, min=1.0)  # 1 / min(max_norm / (total + 1e-6), 1)
        for opt in self.optimizers:
            opt.grad_scale = scale
        try:
            return step(self)
        finally:
            for opt in self.optimizers:
                del opt.grad_scale

    utils = _Overlay(torch.nn.utils, clip_grad_norm_=clip_grad_norm_)
    trainer.torch.nn = _Overlay(torch.nn, utils=utils)
    trainer.Trainer._optimizers_step = _optimizers_step
