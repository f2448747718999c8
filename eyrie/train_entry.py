"""`python -m eyrie.train_entry ARGS` or `torchrun ... -m eyrie.train_entry ARGS`: speculators' EAGLE-3 trainer.

On GPUs this is speculators' own entry point. With EYRIE_TRAIN_DEVICE=cpu it first patches the places where
speculators 0.9.0 assumes an accelerator (the device it moves the model and batches to and resumes onto, pinned
loader memory, `torch.accelerator.synchronize`, and the autocast device type), so the demo and CI train the same
way a GPU node does.
"""

from __future__ import annotations

import os
import sys


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
    torch.accelerator.is_available = lambda: False
    current = torch.accelerator.current_accelerator

    def current_accelerator(check_available: bool = False):
        # Trainer picks its autocast device type from here, defaulting to "cuda" when there is none.
        return current(check_available=True) if check_available else torch.device("cpu")

    torch.accelerator.current_accelerator = current_accelerator


def _know_classic_weight_names() -> None:
    """speculators finds the verifier's embeddings and final norm by Llama-style names (and a few aliases); GPT-2
    calls them `wte`/`ln_f` and OPT `final_layer_norm`. (Their final norms are LayerNorms: speculators applies the
    weight as an RMSNorm, so training labels approximate those targets' distributions; see README.)"""
    from speculators.utils import loading

    aliases = loading._WEIGHT_ALIASES
    for name, extra in (("embed_tokens.weight", "wte.weight"), ("model.norm.weight", "ln_f.weight"),
                        ("model.norm.weight", "final_layer_norm.weight")):
        if extra not in aliases.setdefault(name, []):
            aliases[name].append(extra)


def _train_in_float32() -> None:
    """A warm start loads the drafter as exported (bfloat16); training keeps float32 weights, as a drafter built
    from scratch has (autocast still computes in bfloat16 on GPUs). On CPU, bfloat16 weights meet float32
    hidden states and the first matmul fails."""
    from speculators.train import cli

    build = cli.build_draft_model
    cli.build_draft_model = lambda *a, **k: build(*a, **k).float()


def main(argv: list[str]) -> None:
    _know_classic_weight_names()
    _train_in_float32()
    if os.environ.get("EYRIE_TRAIN_DEVICE") == "cpu":
        _run_on_cpu()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
