"""speculators on a CPU: the places where it assumes an accelerator."""

from __future__ import annotations

from eyrie.stages.train.patches.overlay import _Overlay


def _run_on_cpu() -> None:
    import torch
    from speculators.train import checkpointer, dataloader, trainer

    trainer.get_local_rank = lambda: "cpu"  # Trainer moves model and batches to `local_rank`
    checkpointer.get_current_device = lambda: "cpu"  # resume loads onto it ("cuda:0" without an accelerator)
    loader = dataloader.DataLoader
    dataloader.DataLoader = lambda *a, **k: loader(*a, **{**k, "pin_memory": False})  # pinning needs a device
    if torch.accelerator.is_available():
        return
    torch.accelerator.synchronize = lambda *a, **k: None
    _distributed_on_cpu()
    torch.accelerator.is_available = lambda: False
    current = torch.accelerator.current_accelerator

    def current_accelerator(check_available: bool = False):
        # Trainer picks its autocast device type from here, defaulting to "cuda" when there is none.
        return current(check_available=True) if check_available else torch.device("cpu")

    torch.accelerator.current_accelerator = current_accelerator


def _distributed_on_cpu() -> None:
    """Under torchrun without an accelerator (the DDP path's check on CPU, tests/integration/test_ddp.py),
    speculators' `maybe_setup_distributed` selects the rank's device and hands `init_process_group` that index as
    `device_id`; both need an accelerator. Here the first does nothing and the second is given no device, so the
    process group is gloo's (`get_default_backend_for_device("cpu")`) and DDP runs on CPU."""
    import torch
    import torch.distributed as dist
    from speculators.train import distributed

    torch.accelerator.set_device_index = lambda *a, **k: None

    def init_process_group(*args, device_id=None, **kwargs):  # noqa: ARG001
        return dist.init_process_group(*args, **kwargs)

    distributed.dist = _Overlay(dist, init_process_group=init_process_group)  # type: ignore[assignment]
