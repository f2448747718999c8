"""The multi-GPU (DDP) training path, checked on CPU with gloo: two ranks of speculators' trainer under torchrun,
through Eyrie's train entry's patches, each on its half of a global batch, make the update one process makes on
the whole batch (the mean of the two halves' losses), step for step. Issue 24 item 4, issue 23 item 4.

This file is also the ranks' program: `torchrun --nproc-per-node 2 tests/integration/test_ddp.py OUT MODE`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
LR = 1e-3


def _tiny_eagle3():
    """A one-layer EAGLE-3 drafter at toy width (seeded: every rank and the reference build the same one)."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig, core
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=256,
        num_hidden_layers=1,
    )
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=64,
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="x", architectures=["X"]),
        ),
    )
    torch.manual_seed(0)
    model = core.Eagle3DraftModel(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.05)
    t2d = torch.zeros(256, dtype=torch.bool)
    ids = torch.randperm(256)[:64].sort().values
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(64))
    return model


def _batch(step: int, rank: int, dtype) -> dict:
    """Rank `rank`'s share of step `step`'s global batch: one packed sequence of two documents, differing in length
    and loss-mask count from rank to rank (so the mean of the ranks' losses is not a token-weighted one)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    n = 48
    first = 18 + 6 * rank
    return dict(
        hidden_states=torch.randn(1, n, 96, generator=g).to(dtype),
        input_ids=torch.randint(0, 256, (1, n), generator=g),
        document_ids=torch.cat([torch.zeros(first), torch.ones(n - 2 - first), -torch.ones(2)]).long()[None],
        loss_mask=torch.randint(0, 2, (1, n), generator=g),
        position_ids=torch.cat([torch.arange(first), torch.arange(n - 2 - first), torch.zeros(2)]).long()[None],
        verifier_last_hidden_states=torch.randn(1, n, 32, generator=g).to(dtype),
        error_records=0,
    )


def _call_kwargs() -> dict:
    from speculators.losses import resolve_loss_config

    return {"ttt_steps": 3, "loss_config": resolve_loss_config("kl_div", "eager")}


class _Loader:
    """What the trainer asks of its loader: a length, a batch sampler (none here) and the batches."""

    batch_sampler = None

    def __init__(self, batches: list[dict]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter([dict(b) for b in self.batches])


def _trainer_config(save_path: Path, dtype):
    from speculators.train.trainer import TrainerConfig

    return TrainerConfig(
        num_epochs=1,
        save_path=str(save_path),
        lr=LR,
        train_call_kwargs=_call_kwargs(),
        scheduler_type="none",
        hidden_states_dtype=dtype,
        log_freq=1,
        max_steps=STEPS,
    )


def _rank_main(out: Path, mode: str) -> None:
    """One rank: Eyrie's CPU patches (and, in `mode` bf16, the GPU path's: BF16_WEIGHTS, the trainer's view of
    torch, sync-free metrics), speculators' own distributed set-up under torchrun, then its trainer's epoch on this
    rank's halves of the global batches; rank 0 writes the weights."""
    import torch

    from eyrie.stages.train import entry

    os.environ["EYRIE_TRAIN_DEVICE"] = "cpu"
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    entry._run_on_cpu()
    if mode == "bf16":
        entry._gpu_speedups()
    from speculators.train import distributed
    from speculators.train.trainer import Trainer

    distributed.maybe_setup_distributed()
    rank = distributed.get_rank()
    assert distributed.is_distributed() and distributed.get_world_size() == 2
    assert torch.distributed.get_backend() == "gloo"
    trainer = Trainer(
        _tiny_eagle3(),
        _trainer_config(out / "checkpoints", dtype),
        _Loader([_batch(s, rank, dtype) for s in range(STEPS)]),
    )
    assert isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
    trainer.train_epoch(0)
    entry._to_master_weights()
    state = {k: v.detach().clone() for k, v in trainer.model.module.state_dict().items()}
    torch.save({"state": state, "working": len(entry._WORKING)}, out / f"rank{rank}.pt")
    distributed.maybe_destroy_distributed()


def _one_process(dtype, ranks: tuple[int, ...] = (0, 1), working: bool = False) -> dict:
    """The trainer's step (autocast forward, zero_grad, backward, clip to 1, AdamW) in one process on the whole
    global batch: the loss is the mean of the ranks' losses, as DDP's mean of their gradients is. `working`:
    BF16_WEIGHTS' bfloat16 working copies (put back before the clip, as the trainer's patched clip does)."""
    import torch
    from speculators.train.optimizers import build_optimizers

    from eyrie.stages.train import entry

    model = _tiny_eagle3()
    weights = entry._WorkingWeights(model, dtype) if working else None
    (opt,) = build_optimizers(model, _trainer_config(Path("unused"), dtype))
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=dtype):
            loss = sum(model(**_batch(step, r, dtype), **_call_kwargs())[1] for r in ranks) / len(ranks)
        opt.zero_grad()
        loss.backward()
        if weights is not None:
            weights.to_master()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp(tmp_path: Path, mode: str) -> tuple[dict, dict]:
    env = {
        **os.environ,
        "EYRIE_TRAIN_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "MASTER_ADDR": "127.0.0.1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={_free_port()}",
        __file__,
        str(tmp_path),
        mode,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    import torch

    return tuple(torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))  # type: ignore[return-value]


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].is_floating_point())


@pytest.mark.slow
def test_ddp_on_two_gloo_ranks_makes_the_one_process_update_of_the_global_batch(tmp_path):
    """float32 weights under autocast (what DDP runs without BF16_WEIGHTS): after two steps both ranks hold the
    same weights, and they are the weights one process reaches on the whole global batch (to float32 rounding of
    gloo's sum); a rank's own half alone would have moved them measurably elsewhere."""
    import torch

    rank0, rank1 = _ddp(tmp_path, "fp32")
    assert all(torch.equal(rank0["state"][k], rank1["state"][k]) for k in rank0["state"])
    want = _one_process(torch.float32)
    got = rank0["state"]
    assert got.keys() == want.keys()
    assert _max_diff(got, want) < 1e-6
    initial = _tiny_eagle3().state_dict()
    assert _max_diff(got, initial) > 100 * _max_diff(got, want)  # the weights moved
    alone = _one_process(torch.float32, ranks=(0,))
    assert _max_diff(got, alone) > 100 * _max_diff(got, want)  # and not as rank 0's half alone moves them


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), sys.argv[2])
