"""`EyrieTrainer`: speculators' `Trainer` (which takes the drafter and its loaders in its constructor) with what Eyrie
adds, as overridden methods:

- whole checkpoints: every save of an epoch sets the whole folder it overwrites aside and deletes it once the new
  one is whole (eyrie/stages/train/checkpoints.py); a fault point sits between the weights and the training state;
- every epoch's validation written beside its checkpoint, and the plateau stop (`PlateauReached`);
- on CPU: the model, batches and autocast on the CPU (speculators assumes an accelerator);
- on GPUs (`Switches`, train.speed): fused AdamW (`clip_in_adamw`: the gradient clip applied by the optimizer as it
  reads the gradients), bfloat16 working copies of the float32 weights on one process (`bf16_weights`), and the
  step's counters made without synchronising the GPU (`sync_free_metrics`).

speculators' `train_epoch` and `val_epoch` read `torch` and `tqdm` from their module: with `switches` the instance's
two are speculators' own code reading Eyrie's view of both instead (`_bind_trainer_view`), speculators' module left as
it is (tests/unit/test_train_patch_guards.py fails when either method changes in speculators).
"""

from __future__ import annotations

import types
from pathlib import Path

import torch
import torch.distributed as dist
from speculators.train import trainer as _trainer_module
from speculators.train.trainer import Trainer

from eyrie.stages.train.patches.overlay import _Overlay, rebound
from eyrie.stages.train.patches.plateau import PlateauReached
from eyrie.stages.train.patches.switches import Switches
from eyrie.stages.train.patches.working_weights import _WORKING, _to_master_weights, _WorkingWeights


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class EyrieTrainer(Trainer):
    """speculators' Trainer plus Eyrie's whole checkpoints, validation record and plateau stop; on CPU it trains on
    the CPU; `switches` (GPUs) adds fused AdamW with the clip inside it, bfloat16 working weights and sync-free
    counters. `plateau`: (patience, min_delta) of the predicted acceptance length, or None."""

    def __init__(
        self,
        model,
        config,
        train_loader,
        val_loader=None,
        *,
        device: str = "cuda",
        switches: Switches | None = None,
        plateau: tuple[int, float] | None = None,
    ):
        self.eyrie_device = device
        self.switches = switches
        self.plateau = plateau
        self._pending_clip: list = []
        _WORKING.clear()
        if switches is not None:
            _bind_trainer_view(switches, self)
        super().__init__(model, config, train_loader, val_loader)

    # -- where it trains ------------------------------------------------------------------------------------------

    def setup_trainer(self):
        if self.eyrie_device == "cpu":  # speculators moves the model and batches to its local rank's accelerator
            self.local_rank = "cpu"  # type: ignore[assignment]
            self.device_type = "cpu"  # autocast's device ("cuda" when there is no accelerator)
        super().setup_trainer()

    def setup_model(self):
        super().setup_model()
        s = self.switches
        dtype = self.config.hidden_states_dtype
        one_process = not self.is_distributed and isinstance(self.model, torch.nn.Module)
        if s is not None and s.bf16_weights and one_process and dtype != torch.float32:
            _WORKING[:] = [_WorkingWeights(self.model, dtype)]

    def setup_optimizer(self):
        super().setup_optimizer()
        if self.switches is not None:
            for opt in self.optimizers:
                _fuse_adamw(opt)

    # -- the step ---------------------------------------------------------------------------------------------------

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """The trainer's clip (through its view of torch): float32 weights and gradients back first; with
        clip_in_adamw the norm is taken and the clip factor left for fused AdamW (`_optimizers_step`)."""
        _to_master_weights()
        if self.switches is None or not self.switches.clip_in_adamw:
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        self._pending_clip[:] = [(params, float(max_norm), total, foreach)]
        return total

    def _optimizers_step(self):
        """With a clip pending, fused AdamW applies it as it reads the gradients (`grad_scale`, which it divides
        each by): the norm as before, no scaling pass. Any other optimizer (Muon): gradients scaled as before."""
        _to_master_weights()
        if not self._pending_clip:
            return super()._optimizers_step()
        params, max_norm, total, foreach = self._pending_clip.pop()
        if not all(type(o) is torch.optim.AdamW and o.defaults.get("fused") for o in self.optimizers):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
            return super()._optimizers_step()
        scale = torch.clamp((total + 1e-6) / max_norm, min=1.0)  # 1 / min(max_norm / (total + 1e-6), 1)
        for opt in self.optimizers:
            opt.grad_scale = scale  # type: ignore[attr-defined]
        try:
            return super()._optimizers_step()
        finally:
            for opt in self.optimizers:
                del opt.grad_scale  # type: ignore[attr-defined]

    # -- saving -----------------------------------------------------------------------------------------------------

    def maybe_save_checkpoint(self, epoch, local_step=0):
        """speculators overwrites `<epoch>/` in place on each save of that epoch: rank 0 sets the whole folder aside
        first and deletes it once the new save is whole, so a kill mid-save leaves a whole checkpoint to resume from
        (eyrie.stages.train.checkpoints.recover puts it back). Saved weights are the float32 ones."""
        from eyrie.stages.train.checkpoints import set_aside_previous, settle_save

        _to_master_weights()
        folder = Path(self.checkpointer.path) / str(epoch)
        whole = _rank0() and isinstance(epoch, int)
        if whole:
            set_aside_previous(folder)
        super().maybe_save_checkpoint(epoch, local_step=local_step)
        if whole:
            settle_save(folder)

    def _save_training_state(self, epoch, local_step):
        from eyrie.run.faults import fault_point

        fault_point(f"train.before-state.step{self.global_step}")
        super()._save_training_state(epoch, local_step)

    # -- validation -------------------------------------------------------------------------------------------------

    def maybe_update_best(self, epoch, val_metrics):
        """Every epoch's validation metrics written beside its checkpoint (speculators writes them only when the loss
        improved); with `plateau`, training stops once the predicted acceptance length has stopped rising
        (`plateau.json` in the checkpoints folder tells Eyrie not to relaunch). Every rank holds the same
        all-reduced metrics, so every rank decides the same."""
        from eyrie.run.files import atomic_write_json
        from eyrie.stages.train.validation import (
            PLATEAU,
            VALIDATION,
            epoch_validation,
            plateaued,
            predicted_acceptance_length,
        )

        super().maybe_update_best(epoch, val_metrics)
        if val_metrics is None:
            return
        save_path = Path(self.checkpointer.path)
        if _rank0():
            atomic_write_json(save_path / str(epoch) / VALIDATION, val_metrics)
        if self.plateau is None:
            return
        scores = {}
        for e in range(epoch + 1):
            metrics = val_metrics if e == epoch else epoch_validation(save_path / str(e))
            if metrics:
                scores[e] = predicted_acceptance_length(metrics)
        if plateaued(list(scores.values()), *self.plateau):
            best = max(scores, key=lambda e: scores[e])
            if _rank0():
                atomic_write_json(save_path / PLATEAU, {"epoch": epoch, "best_epoch": best, "scores": scores})
            raise PlateauReached(f"validation plateaued at epoch {epoch} (best: epoch {best})")


def _fuse_adamw(opt) -> None:
    """speculators builds AdamW with torch's default (foreach) implementation; the fused one does the same update
    in one kernel per group. Only where every parameter lives on a GPU (the fused kernel's need); its step counts
    (loaded on a resume) go where the fused kernel reads them."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if type(opt) is not torch.optim.AdamW or not params or not all(p.is_cuda for p in params):
        return
    opt.defaults.update(fused=True, foreach=False)
    for group in opt.param_groups:
        group.update(fused=True, foreach=False)
        for p in group["params"]:
            state = opt.state.get(p)
            if state and "step" in state:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


class _TrainerTorch(type(torch)):  # type: ignore[misc]
    """speculators' trainer's view of `torch` (its module global, read by `train_epoch`): `torch.tensor(<python
    number>, device=<gpu>)` is a host-to-device copy from pageable memory, which waits for the GPU; the trainer
    makes two per step (its error-record counters), so every step synchronised whatever --log-freq said.
    `torch.full` writes the same scalar on the device without waiting. `nn.utils.clip_grad_norm_` is the running
    EyrieTrainer's. Everything else is torch itself."""

    trainer: EyrieTrainer | None = None

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


def _quiet(iterable, *args, **kwargs):  # noqa: ARG001
    """No progress bar: speculators draws a rich one (tqdm.rich) over every loader on rank 0, a refresh thread
    competing for the GIL with the thread that launches the step's kernels, for a bar that lands in a log file as
    noise. Loss, tokens/s and the step phases are logged every --log-freq steps anyway."""
    return iterable


def _trainer_view(switches: Switches, trainer: EyrieTrainer | None):
    """What speculators' `train_epoch` reads as its module globals `torch` and `tqdm`, for `trainer`: its view of
    torch (sync-free counters, the clip through `trainer`) and, with quiet_progress, no progress bar."""
    view = _TrainerTorch("torch")
    view.trainer = trainer

    def clip_grad_norm_(parameters, *args, **kwargs):
        running = view.trainer
        return (running or torch.nn.utils).clip_grad_norm_(parameters, *args, **kwargs)

    view.nn = _Overlay(torch.nn, utils=_Overlay(torch.nn.utils, clip_grad_norm_=clip_grad_norm_))
    if not switches.sync_free_metrics:
        view.tensor = torch.tensor  # type: ignore[method-assign,assignment]
    return view, (_quiet if switches.quiet_progress else _trainer_module.tqdm)


def _bind_trainer_view(switches: Switches, trainer: EyrieTrainer) -> None:
    """speculators' `Trainer.train_epoch` and `val_epoch`, their own code as installed, bound on `trainer` and reading
    `_trainer_view`'s `torch` and `tqdm` instead of their module's: speculators' trainer module is left as it is."""
    view, tqdm = _trainer_view(switches, trainer)
    namespace = {**vars(_trainer_module), "torch": view, "tqdm": tqdm}
    for name in ("train_epoch", "val_epoch"):
        try:
            fn = rebound(getattr(Trainer, name), namespace, vars(_trainer_module))
        except RuntimeError as err:
            raise RuntimeError(
                f"speculators' Trainer.{name}: {err}. Eyrie binds speculators' own {name} on each EyrieTrainer: wrap "
                "the instance's bound method after EyrieTrainer.__init__, or the class attribute with functools.wraps"
            ) from None
        setattr(trainer, name, types.MethodType(fn, trainer))
