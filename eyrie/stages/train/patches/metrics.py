"""The model's accuracy counts and loss scalars made without synchronising the GPU."""

from __future__ import annotations


def _accuracy_without_sync() -> None:
    """speculators counts each TTT step's correct predictions with `torch.masked_select`, whose output size depends
    on the data: the GPU is synchronised there, three times a step, and each time the GPU idles while the host
    queues the small eager ops that follow (the TTT mask extension). The counts are the same without selecting:
    correct-and-masked positions summed, masked positions summed. On an H200 at Kimi-K2.5 width this took Eyrie's
    train stage from ~25.4k to ~28.1-28.9k tokens/s."""
    import torch
    from speculators.models.eagle3 import metrics

    def compute_accuracy_single_step(pred_ids, target_ids, loss_mask, prev_correct):
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

    metrics.compute_accuracy_single_step = compute_accuracy_single_step


def _loss_scalars_without_sync() -> None:
    """`Eagle3DraftModel.forward` starts its loss at `torch.tensor(0.0, device=device)` and ends with
    `metrics["loss_total"] = torch.tensor(1.0, device=device)`; its TTT loop breaks torch.compile's graph, so both
    run eagerly, each a copy from pageable host memory that waits for the GPU: twice a step the host loses its lead
    and the GPU waits for it. The same forward, from speculators' own source with `torch.zeros((), ...)` and
    `torch.ones((), ...)` (made on the GPU, no wait) in their place, compiled the same way: ~28.9k to ~31.5k
    tokens/s on an H200 at Kimi-K2.5 width, the GPU then busy 99% of the time. Applied only when each of the two
    lines is found exactly once; otherwise speculators' forward is left as it is."""
    import inspect
    import textwrap

    from speculators.models.eagle3 import core

    compiled = core.Eagle3DraftModel.forward
    forward = getattr(compiled, "__wrapped__", compiled)
    edits = {
        "torch.tensor(0.0, device=device)": "torch.zeros((), device=device)",
        "torch.tensor(1.0, device=device)": "torch.ones((), device=device)",
    }
    try:
        lines, first = inspect.getsourcelines(forward)
    except (OSError, TypeError):
        return
    source = textwrap.dedent("".join(lines))
    if any(source.count(old) != 1 for old in edits):
        return
    for old, new in edits.items():
        source = source.replace(old, new)
    body = source.splitlines()
    while body and body[0].lstrip().startswith("@"):  # the compile decorator, applied again below
        body.pop(0)
        first += 1
    namespace: dict = {}
    code = compile("\n" * (first - 1) + "\n".join(body) + "\n", inspect.getsourcefile(forward) or "<eagle3>", "exec")
    exec(code, vars(core), namespace)  # noqa: S102  (speculators' own source, two calls replaced)
    patched = namespace[forward.__name__]
    patched.__qualname__ = forward.__qualname__
    core.Eagle3DraftModel.forward = core.conditional_torch_compile(patched)
