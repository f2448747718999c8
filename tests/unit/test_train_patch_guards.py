"""Each thing of speculators or torch that the train entry replaces, overrides or composes again is pinned here by
the hash of its source as installed: a speculators (or torch) upgrade that changes one fails this test, naming it,
instead of changing the trainer silently. When it fails, read the new source against the Eyrie code named beside
it, adapt that code, then record the new hash.

The source is read from the installed file (by the dotted path), not from the live object, so a patch another test
left in this process does not hide a change."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import types

import pytest

# dotted path -> (sha256 of its source, first 16 hex; the Eyrie code that depends on it)
PINNED: dict[str, tuple[str, str]] = {
    # composed again by eyrie.stages.train.entry.train / build_drafter and eyrie.stages.train.loaders
    "speculators.train.cli.main": ("5f74150696b12633", "entry.train mirrors it for EAGLE-3"),
    "speculators.train.cli.build_draft_model": ("ac6be11efba71645", "entry.build_drafter calls it"),
    "speculators.train.dataloader._setup_dataloader": ("cc6f8b1422d2aeac", "loaders.make_loader mirrors it"),
    "speculators.train.dataloader.create_train_val_loaders": ("905c713f5a193a14", "loaders.train_val_loaders"),
    # overridden by EyrieTrainer (eyrie/stages/train/eyrie_trainer.py)
    "speculators.train.trainer.Trainer.__init__": ("43460380b84f53d6", "EyrieTrainer.__init__/setup_trainer"),
    "speculators.train.trainer.Trainer.setup_model": ("c245abb790911475", "EyrieTrainer.setup_model"),
    "speculators.train.trainer.Trainer.setup_optimizer": ("a632bda4cb1e1500", "EyrieTrainer.setup_optimizer"),
    "speculators.train.trainer.Trainer._optimizers_step": ("b90cd6e4f1e97d40", "EyrieTrainer._optimizers_step"),
    "speculators.train.trainer.Trainer.maybe_save_checkpoint": ("587a694a7c01d07b", "whole checkpoints"),
    "speculators.train.trainer.Trainer._save_training_state": ("937fd4895118f054", "the fault point"),
    "speculators.train.trainer.Trainer.maybe_update_best": ("fcc394f5ce9ec1a0", "validation record, plateau"),
    "speculators.train.trainer.Trainer.run_training": ("058928a81417e087", "PlateauReached ends it"),
    # their own code bound on the EyrieTrainer, reading Eyrie's view of `torch` and `tqdm` (_bind_trainer_view)
    "speculators.train.trainer.Trainer.train_epoch": ("508528826dbbd72e", "the trainer's view of torch, tqdm"),
    "speculators.train.trainer.Trainer.val_epoch": ("eb864dbed935f2bc", "the trainer's view of torch, tqdm"),
    # patches/cpu.py
    "speculators.train.checkpointer.SingleGPUCheckpointer.load_model_state_dict": ("9bca89b14110ce61", "cpu"),
    "speculators.train.distributed.maybe_setup_distributed": ("7b5f6228c3cd6b91", "cpu: gloo under torchrun"),
    # the drafter's own forward and mask builder (eyrie/stages/train/drafter.py): speculators' code with Eyrie's
    # pieces (patches/metrics.py, one_kv_length.py) in its namespace, bound on the built instance
    "speculators.models.eagle3.core.Eagle3DraftModel.forward": ("29c0bcfe6b6b6348", "drafter: metrics, one_kv"),
    "speculators.models.eagle3.core.Eagle3DraftModel._build_attn_mask": ("7f54d513ba6b2106", "drafter: eager mask"),
    "speculators.models.eagle3.metrics.compute_metrics": ("4abeefe69cf60564", "metrics: with Eyrie's counts"),
    "speculators.models.metrics.compute_accuracy_single_step": ("1b3327e9a9781e97", "metrics: Eyrie's copy"),
    "speculators.models.eagle3.attention.extend_mask_for_draft_tokens": ("12aeb8f658cf8a6f", "one_kv_length"),
    "speculators.models.eagle3.attention.create_combined_mask_mod": ("af3944c86943cd58", "block_mask: its layout"),
    # patches/verifier.py, target_transform.py
    "speculators.utils.loading.load_model_layers": ("f2a738b8793a5b47", "verifier: names by preflight"),
    "speculators.models.eagle3.core.Eagle3DraftModel.load_verifier_weights": ("5ad63d62575ec7fc", "labels"),
    # online_dataset.py: the connector's lock wait, polled every 2 ms
    "hs_connectors.transfer.wait_for_lock": ("5753e049c78b84ac", "online_dataset.wait_for_lock"),
}


def installed_source(dotted: str) -> str:
    """The source of the module-level function, class or method at `dotted`, read from the installed file."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:cut]))
        except ModuleNotFoundError:  # a class's name: a shorter path is the module
            continue
        if spec is not None and spec.origin:
            break
    else:
        raise AssertionError(f"no module found for {dotted}")
    text = open(spec.origin).read()
    nodes: list = ast.parse(text).body
    node = None
    for name in parts[cut:]:
        node = next(
            (
                n
                for n in nodes
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
            ),
            None,
        )
        assert node is not None, f"{dotted}: {name} is gone from {spec.origin}"
        nodes = node.body
    return ast.get_source_segment(text, node) or ""


@pytest.mark.parametrize("dotted", sorted(PINNED))
def test_what_the_trainer_replaces_or_composes_is_unchanged(dotted):
    want, used_by = PINNED[dotted]
    got = hashlib.sha256(installed_source(dotted).encode()).hexdigest()[:16]
    assert got == want, (
        f"{dotted} changed in the installed package (source hash {got}, pinned {want}); Eyrie's {used_by} "
        "depends on it: check that code against the new source, then pin the new hash here"
    )


def test_the_swapped_attributes_are_counted_and_few():
    """benchmarks/train_swaps.py counts the attributes of other packages the train entry's code replaces at run
    time; every one is covered above, and their number only goes down."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from train_swaps import swaps

    assert len(swaps()) <= MOST_SWAPS, "\n".join(swaps())


MOST_SWAPS = 8


def test_speculators_epochs_are_bound_with_eyries_view_inside_their_own_decorators(monkeypatch):
    """EyrieTrainer binds speculators' own train_epoch and val_epoch (val_epoch under its torch.no_grad() decorator)
    with its view of torch and tqdm; a wrapper put on the class with functools.wraps (a profiler's, a user's) stays
    around the bound code. A wrapper that hides what it wraps is refused by name at the trainer's construction: bound
    to speculators' globals it failed with a NameError at the first step, after the model's build and compile."""
    import functools

    import torch
    from speculators.train import trainer as speculators_trainer

    from eyrie.stages.train.eyrie_trainer import _bind_trainer_view
    from eyrie.stages.train.patches.switches import Switches

    class Holder:
        pass

    seen = []
    holder = Holder()
    _bind_trainer_view(Switches(), holder)
    for name in ("train_epoch", "val_epoch"):
        fn = getattr(holder, name).__func__
        code = inspect.unwrap(fn)
        assert code.__globals__["torch"] is not torch and code.__globals__["torch"].trainer is holder, name
        assert code.__code__ is inspect.unwrap(getattr(speculators_trainer.Trainer, name)).__code__, name
    # val_epoch still runs under torch.no_grad(): the decorator kept around the bound code, which runs
    assert holder.val_epoch.__func__.__code__ is speculators_trainer.Trainer.val_epoch.__code__
    grad_inside = []

    class Model:
        def eval(self):
            pass

        def __call__(self, **batch):
            grad_inside.append(torch.is_grad_enabled())
            return None, None, {"loss": batch["x"].sum()}

    holder.__dict__.update(
        val_loader=torch.utils.data.DataLoader([{"x": torch.ones(2)}], batch_size=None),
        model=Model(),
        rank=0,
        local_rank="cpu",
        device_type="cpu",
        is_distributed=False,
        global_step=0,
        config=types.SimpleNamespace(hidden_states_dtype=torch.bfloat16, val_call_kwargs=None),
        _maybe_val_sync=lambda i: None,
    )
    assert holder.val_epoch(0) == {"loss_epoch": 2.0} and grad_inside == [False]

    original = speculators_trainer.Trainer.train_epoch

    @functools.wraps(original)
    def measured(self, *args, **kwargs):
        seen.append("measured")
        return original(self, *args, **kwargs)

    decorated = speculators_trainer.Trainer.val_epoch  # under torch.no_grad()

    @functools.wraps(decorated)
    def timed(self, *args, **kwargs):
        seen.append("timed")
        return decorated(self, *args, **kwargs)

    monkeypatch.setattr(speculators_trainer.Trainer, "train_epoch", measured)
    monkeypatch.setattr(speculators_trainer.Trainer, "val_epoch", timed)
    _bind_trainer_view(Switches(), holder)
    for name, wrapper in (("train_epoch", measured), ("val_epoch", timed)):
        bound = getattr(holder, name).__func__
        assert bound.__code__ is wrapper.__code__, name  # the wrapper kept, outermost
        assert inspect.unwrap(bound).__globals__["torch"].trainer is holder, name  # speculators' code, Eyrie's view
    assert holder.val_epoch.__func__.__wrapped__.__code__ is decorated.__code__  # torch.no_grad() kept inside it

    def hiding(self, epoch, *args, **kwargs):
        return None

    monkeypatch.setattr(speculators_trainer.Trainer, "train_epoch", hiding)
    with pytest.raises(RuntimeError, match=r"Trainer\.train_epoch: .*hiding is not .*own function.*instance"):
        _bind_trainer_view(Switches(), holder)
