"""`python -m eyrie.train_entry ARGS` or `torchrun ... -m eyrie.train_entry ARGS`: speculators' EAGLE-3 trainer.

On GPUs this is speculators' own entry point. With EYRIE_TRAIN_DEVICE=cpu it first patches the places where
speculators 0.9.0 assumes an accelerator (the device it moves the model and batches to and resumes onto, pinned
loader memory, `torch.accelerator.synchronize`, and the autocast device type), so the demo and CI train the same
way a GPU node does.
"""

from __future__ import annotations

import json
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


def _load_verifier_weights_by(names: dict[str, str]) -> None:
    """speculators asks its loader for the verifier's `embed_tokens.weight`, `lm_head.weight` and
    `model.norm.weight` and matches them by suffix and a few aliases, so a target with other names (GPT-NeoX's
    `gpt_neox.embed_in`, GPT-2's `transformer.wte`) fails with a KeyError or, worse, gets a layer's norm. Preflight
    resolved the checkpoint's own names; here the loader is given exactly those. A name left out (a tied head) is
    not asked for, and speculators falls back to the embedding as it does for tied targets."""
    from speculators.utils import loading

    load = loading.load_model_layers

    def load_model_layers(layer_names: list[str], model_path: str):
        wanted = {n: names[n] for n in layer_names if n in names}
        found = load(list(wanted.values()), model_path)
        return {n: found[key] for n, key in wanted.items() if key in found}

    loading.load_model_layers = load_model_layers


def _train_in_float32() -> None:
    """A warm start loads the drafter as exported (bfloat16); training keeps float32 weights, as a drafter built
    from scratch has (autocast still computes in bfloat16 on GPUs). On CPU, bfloat16 weights meet float32
    hidden states and the first matmul fails."""
    from speculators.train import cli

    build = cli.build_draft_model
    cli.build_draft_model = lambda *a, **k: build(*a, **k).float()


def _pop_option(argv: list[str], name: str) -> str | None:
    if name not in argv:
        return None
    i = argv.index(name)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def main(argv: list[str]) -> None:
    names = _pop_option(argv, "--eyrie-verifier-weights")
    if names:
        _load_verifier_weights_by(json.loads(names))
    _train_in_float32()
    if os.environ.get("EYRIE_TRAIN_DEVICE") == "cpu":
        _run_on_cpu()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
