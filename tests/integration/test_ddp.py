"""The multi-GPU (DDP) training path, checked on CPU with gloo: two ranks of the train entry's trainer
(`EyrieTrainer`, speculators' Trainer subclassed) under torchrun, with the entry's CPU set-up, each on its half of a
global batch, make the update one process makes on
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
sys.path.insert(0, str(REPO / "tests"))  # torchrun runs this file as a script: tests/ for tiny_drafter
from tiny_drafter import ListLoader, tiny_eagle3  # noqa: E402

STEPS = 2
LR = 1e-3
MODES = ("fp32", "bf16")


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


def _rank_main(out: Path) -> None:
    """One rank: the train entry's CPU set-up (`_run_on_cpu`) and speculators' own distributed set-up under
    torchrun, then two of the entry's trainers (`EyrieTrainer`) on this rank's halves of the global batches, rank 0
    writing each one's weights: `fp32` as the entry trains on CPU (float32 weights, no GPU choices), then `bf16`
    with the GPU path's choices as well (train.speed: the trainer's view of torch, fused-AdamW clip, sync-free
    counters, bf16_weights, and the drafter's own, `apply_speed_choices`) and bfloat16 autocast, which is how DDP
    trains on GPUs."""
    import torch

    from eyrie.stages.train.drafter import apply_speed_choices
    from eyrie.stages.train.eyrie_trainer import EyrieTrainer
    from eyrie.stages.train.patches import cpu, working_weights
    from eyrie.stages.train.patches.switches import Switches

    torch.set_num_threads(1)
    cpu._run_on_cpu()
    from speculators.train import distributed

    distributed.maybe_setup_distributed()
    assert distributed.is_distributed() and distributed.get_world_size() == 2
    assert torch.distributed.get_backend() == "gloo"
    rank = distributed.get_rank()
    for mode in MODES:
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        switches = None
        model = tiny_eagle3()
        if mode == "bf16":  # less what concerns the loader and the model's build, which this program makes itself
            switches = Switches(gpu_feed=False, build_on_gpu=False, forkserver_workers=False)
            apply_speed_choices(model, switches)  # as the entry's build_drafter does on GPUs
        trainer = EyrieTrainer(
            model,
            _trainer_config(out / mode / "checkpoints", dtype),
            ListLoader([_batch(s, rank, dtype) for s in range(STEPS)]),
            device="cpu",
            switches=switches,
        )
        assert isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
        trainer.train_epoch(0)
        working_weights._to_master_weights()
        state = {k: v.detach().clone() for k, v in trainer.model.module.state_dict().items()}
        torch.save({"state": state, "working": len(working_weights._WORKING)}, out / f"{mode}-rank{rank}.pt")
    distributed.maybe_destroy_distributed()


def _one_process(dtype, ranks: tuple[int, ...] = (0, 1), working: bool = False) -> dict:
    """The trainer's step (autocast forward, zero_grad, backward, clip to 1, AdamW) in one process on the whole
    global batch: the gradient is the mean of the ranks' halves' gradients, accumulated in float32, as DDP's is.
    `working`: BF16_WEIGHTS' bfloat16 working copies (put back before the clip, as the trainer's patched clip does)."""
    import torch
    from speculators.train.optimizers import build_optimizers

    from eyrie.stages.train.patches import working_weights

    model = tiny_eagle3()
    weights = working_weights._WorkingWeights(model, dtype) if working else None
    (opt,) = build_optimizers(model, _trainer_config(Path("unused"), dtype))
    for step in range(STEPS):
        opt.zero_grad()
        for r in ranks:  # a forward each, as each rank makes (autocast's bfloat16 weight copies are made per forward)
            with torch.autocast("cpu", dtype=dtype):
                loss = model(**_batch(step, r, dtype), **_call_kwargs())[1]
            (loss / len(ranks)).backward()
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


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Both modes' weights from both ranks, from one torchrun of two gloo ranks (the imports dominate its cost)."""
    import torch

    out = tmp_path_factory.mktemp("ddp")
    env = {
        **os.environ,
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
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return {m: tuple(torch.load(out / f"{m}-rank{i}.pt") for i in (0, 1)) for m in MODES}  # type: ignore[misc]


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].is_floating_point())


@pytest.mark.slow
def test_ddp_on_two_gloo_ranks_makes_the_one_process_update_of_the_global_batch(ddp_weights):
    """float32 weights (how the entry trains on CPU): after two steps both ranks hold the same weights, and they are
    the weights one process reaches on the whole global batch (to float32 rounding of gloo's sum); a rank's own half
    alone would have moved them measurably elsewhere."""
    import torch

    rank0, rank1 = ddp_weights["fp32"]
    assert all(torch.equal(rank0["state"][k], rank1["state"][k]) for k in rank0["state"])
    want = _one_process(torch.float32)
    got = rank0["state"]
    assert got.keys() == want.keys()
    assert _max_diff(got, want) < 1e-6
    initial = tiny_eagle3().state_dict()
    assert _max_diff(got, initial) > 100 * _max_diff(got, want)  # the weights moved
    alone = _one_process(torch.float32, ranks=(0,))
    assert _max_diff(got, alone) > 100 * _max_diff(got, want)  # and not as rank 0's half alone moves them


@pytest.mark.slow
def test_ddp_with_the_gpu_patches_trains_float32_weights_under_autocast_like_one_process(ddp_weights):
    """The GPU path's choices (train.speed, `EyrieTrainer` and `apply_speed_choices`) under DDP: bf16_weights'
    working copies are for one process only,
    so DDP trains float32 weights under bfloat16 autocast, and its update is the one process's update of the same
    global batch under the same autocast; both ranks agree."""
    import torch

    rank0, rank1 = ddp_weights["bf16"]
    assert rank0["working"] == rank1["working"] == 0  # no working copies under DDP
    assert all(torch.equal(rank0["state"][k], rank1["state"][k]) for k in rank0["state"])
    got = rank0["state"]
    assert all(v.dtype == torch.float32 for v in got.values() if v.is_floating_point())
    want = _one_process(torch.bfloat16)
    assert _max_diff(got, want) < 1e-6
    alone = _one_process(torch.bfloat16, ranks=(0,))
    assert _max_diff(got, alone) > 100 * max(_max_diff(got, want), 1e-8)


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
