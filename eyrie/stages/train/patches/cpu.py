"""speculators on a CPU: the places where it assumes an accelerator."""

from __future__ import annotations

from eyrie.stages.train.patches.overlay import _Overlay


def _run_on_cpu() -> None:
    """What `EyrieTrainer(device="cpu")` cannot reach: the checkpointer's resume device, the step timer's
    synchronisation on logged steps, and (under torchrun) speculators' distributed set-up."""
    import torch
    from speculators.train import checkpointer

    checkpointer.get_current_device = lambda: "cpu"  # resume loads onto it ("cuda:0" without an accelerator)
    if torch.accelerator.is_available():
        return
    torch.accelerator.synchronize = lambda *a, **k: None  # the step timer's, on logged steps; raises without one
    _distributed_on_cpu()


def _distributed_on_cpu() -> None:
    """Under torchrun without an accelerator (the DDP path's check on CPU, tests/integration/test_ddp.py),
    speculators' `maybe_setup_distributed` selects the rank's device and hands `init_process_group` that index as
    `device_id`; both need an accelerator. Here the first does nothing and the second is given no device, so the
    process group is gloo's (`get_default_backend_for_device("cpu")`) and DDP runs on CPU."""
    import torch
    import torch.distributed as dist
    from speculators.train import distributed

    torch.accelerator.set_device_index = lambda *a, **k: None
    current = torch.accelerator.current_accelerator

    def current_accelerator(check_available: bool = False):
        # maybe_setup_distributed picks its backend from here (gloo for the CPU) and refuses None
        return current(check_available=True) if check_available else torch.device("cpu")

    torch.accelerator.current_accelerator = current_accelerator
    torch.accelerator.is_available = lambda: False  # it asks current_accelerator(), which now names the CPU

    def init_process_group(*args, device_id=None, **kwargs):  # noqa: ARG001
        return dist.init_process_group(*args, **kwargs)

    distributed.dist = _Overlay(dist, init_process_group=init_process_group)  # type: ignore[assignment]
