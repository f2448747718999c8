"""`python -m eyrie.train_entry ARGS` or `torchrun ... -m eyrie.train_entry ARGS`: speculators' EAGLE-3 trainer.

On GPUs this is speculators' own entry point. With EYRIE_TRAIN_DEVICE=cpu it first patches the places where
speculators 0.9.0 assumes an accelerator (the device it moves the model and batches to and resumes onto, pinned
loader memory, `torch.accelerator.synchronize`, and the autocast device type), so the demo and CI train the same
way a GPU node does. On GPUs it changes three things that cost time and nothing else: AdamW runs fused, steps that
are not logged do not synchronise the GPU, and data-loader workers (which only read files) never initialise CUDA.
torch.compile's cache goes beside the run's checkpoints, so a retry or resume finds its kernels compiled. Every
save keeps the whole checkpoint it overwrites until the new one is whole (eyrie/checkpoints.py).
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


def _worker_init(worker_id: int) -> None:  # noqa: ARG001
    """speculators' worker init, less `torch.accelerator.set_device_index`: that call creates a CUDA context in
    each of the (12, spawned) workers, which costs seconds each and GPU memory, for processes that only read files
    and collate on the CPU. Defined at module level so a spawned worker unpickles it by name."""
    import torch

    torch.set_num_threads(1)


def _gpu_speedups() -> None:
    import torch
    from speculators.train import dataloader, trainer

    dataloader._worker_init_fn = _worker_init  # looked up when the loaders are built

    build = trainer.build_optimizers

    def build_optimizers(model, config):
        """speculators builds AdamW with torch's default (foreach) implementation; the fused one does the same
        update in one kernel per group. Only for parameters that all live on a GPU (the fused kernel's need)."""
        out = []
        for opt in build(model, config):
            params = [p for g in opt.param_groups for p in g["params"]]
            if type(opt) is torch.optim.AdamW and params and all(p.is_cuda for p in params):
                groups = [{k: v for k, v in g.items() if k not in ("foreach", "fused")} for g in opt.param_groups]
                opt = torch.optim.AdamW(groups, fused=True)
            out.append(opt)
        return out

    trainer.build_optimizers = build_optimizers

    class _Torch(type(torch)):
        """The trainer's view of `torch`: `torch.tensor(<python number>, device=<gpu>)` is a host-to-device copy
        from pageable memory, which waits for the GPU; the trainer makes two per step (its error-record counters),
        so every step synchronised whatever --log-freq said. `torch.full` writes the same scalar on the device
        without waiting. Everything else is torch itself."""

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

    trainer.torch = _Torch("torch")


def _compile_cache_beside(save_path: str | None) -> None:
    """torch.compile's caches (Inductor's FX graph and AOTAutograd caches, Triton kernels) default to /tmp, which a
    fresh container or node does not have. `<run>/train/compile-cache` survives a retry or resume wherever the run
    folder does; it is keyed by content, so drafters of other keys share it safely. An explicit
    TORCHINDUCTOR_CACHE_DIR wins."""
    if save_path:
        from pathlib import Path

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(save_path).resolve().parent.parent / "compile-cache"))


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _keep_the_last_whole_checkpoint() -> None:
    """speculators overwrites `<epoch>/` in place on each save of that epoch. Rank 0 renames the whole folder aside
    first and deletes it once the new save is whole, so a kill mid-save leaves a whole checkpoint to resume from
    (eyrie.checkpoints.recover puts it back). The fault point sits between the weights and the training state."""
    from pathlib import Path

    import torch.distributed as dist
    from speculators.train import trainer

    from eyrie.checkpoints import set_aside_previous, settle_save
    from eyrie.faults import fault_point

    save = trainer.Trainer.maybe_save_checkpoint
    save_state = trainer.Trainer._save_training_state

    def maybe_save_checkpoint(self, epoch, local_step=0):
        folder = Path(self.checkpointer.path) / str(epoch)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0 and isinstance(epoch, int):
            set_aside_previous(folder)
        save(self, epoch, local_step=local_step)
        if rank0 and isinstance(epoch, int):
            settle_save(folder)

    def _save_training_state(self, epoch, local_step):
        fault_point(f"train.before-state.step{self.global_step}")
        save_state(self, epoch, local_step)

    trainer.Trainer.maybe_save_checkpoint = maybe_save_checkpoint
    trainer.Trainer._save_training_state = _save_training_state


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
    del argv[i : i + 2]
    return value


def main(argv: list[str]) -> None:
    if os.environ.get("EYRIE_TRAIN_DEVICE") != "cpu":
        _compile_cache_beside(_option(argv, "--save-path"))
    names = _pop_option(argv, "--eyrie-verifier-weights")
    if names:
        _load_verifier_weights_by(json.loads(names))
    _train_in_float32()
    _keep_the_last_whole_checkpoint()
    if os.environ.get("EYRIE_TRAIN_DEVICE") == "cpu":
        _run_on_cpu()
    else:
        _gpu_speedups()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
