"""The drafter's accuracy counts and loss scalars made without synchronising the GPU (train.speed.sync_free_metrics),
as pieces of the drafter's own forward (eyrie/stages/train/drafter.py): nothing of speculators is replaced.
tests/unit/test_train_patch_guards.py pins the speculators functions these copy."""

from __future__ import annotations

from eyrie.stages.train.patches.overlay import with_globals

# speculators' `Eagle3DraftModel.forward` starts its loss at `torch.tensor(0.0, device=device)` and ends with
# `metrics["loss_total"] = torch.tensor(1.0, device=device)`; its TTT loop breaks torch.compile's graph, so both run
# eagerly, each a copy from pageable host memory that waits for the GPU: twice a step the host loses its lead and
# the GPU waits for it. The drafter's forward is speculators' source with these two calls replaced by tensors made on
# the GPU (no wait): ~28.9k to ~31.5k tokens/s on an H200 at Kimi-K2.5 width, the GPU then busy 99% of the time.
# Applied only when each of the two is found exactly once; otherwise the forward is speculators' own code.
LOSS_SCALAR_EDITS = {
    "torch.tensor(0.0, device=device)": "torch.zeros((), device=device)",
    "torch.tensor(1.0, device=device)": "torch.ones((), device=device)",
}


def compute_accuracy_single_step(pred_ids, target_ids, loss_mask, prev_correct):
    """speculators' `compute_accuracy_single_step` (speculators/models/metrics.py) without `torch.masked_select`,
    whose output size depends on the data: the GPU was synchronised there, three times a step, and each time the GPU
    idled while the host queued the small eager ops that follow (the TTT mask extension). The counts are the same
    without selecting: correct-and-masked positions summed, masked positions summed. On an H200 at Kimi-K2.5 width
    this took Eyrie's train stage from ~25.4k to ~28.1-28.9k tokens/s."""
    import torch

    correct = pred_ids == target_ids
    cond_total = torch.tensor(correct.numel(), dtype=torch.float, device=correct.device)
    if prev_correct is not None:
        cond_total = prev_correct.sum().float()
        correct = torch.logical_and(prev_correct, correct, out=prev_correct)
    if loss_mask is not None:
        mask = loss_mask.to(torch.bool)
        correct_sum = torch.logical_and(correct, mask).float().sum()
        full_total = mask.sum().float()
    else:
        correct_sum = correct.float().sum()
        full_total = torch.tensor(correct.numel(), dtype=torch.float, device=correct.device)
    return correct_sum, full_total, correct_sum.clone(), cond_total


def compute_metrics_without_sync():
    """speculators' EAGLE-3 `compute_metrics` (its code as installed) reading `compute_accuracy_single_step` above
    instead of speculators': the function the drafter's forward calls for each TTT step's loss and counts."""
    from speculators.models.eagle3 import metrics

    namespace = {**vars(metrics), "compute_accuracy_single_step": compute_accuracy_single_step}
    return with_globals(metrics.compute_metrics, namespace)
