"""fp8 hidden states decoded after the loader (eyrie/hidden_states/gpu_decode.py): through speculators' own dataset,
shift and
collate, the carried batches decode to exactly the batches its FP8Transfer path makes. The decode runs on the CPU
here; on a GPU the trainer's feed runs the same function there."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from eyrie.hidden_states import gpu_decode
from eyrie.hidden_states.encoding import BFLOAT16, FP8, encode

LAYERS, HIDDEN, PACKED = 4, 24, 64


def write_run(folder, dtypes, seed=0):
    """One file per entry of `dtypes` (its encoding) and speculators' prepared dataset for them."""
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()
    g = torch.Generator().manual_seed(seed)
    hidden = folder / "hidden_states"
    hidden.mkdir(parents=True)
    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, dtype in enumerate(dtypes):
        n = 9 + 5 * i
        x = torch.randn(n, LAYERS, HIDDEN, generator=g) * torch.logspace(-1, 2, LAYERS).reshape(1, LAYERS, 1)
        ids = torch.randint(0, 1000, (n,), generator=g)
        save_file(
            encode({"hidden_states": x.to(torch.bfloat16), "token_ids": ids}, dtype),
            str(hidden / f"hs_{i}.safetensors"),
        )
        cols["input_ids"].append(ids.tolist())
        cols["loss_mask"].append([i % 2] * n)
        cols["seq_len"].append(n)
    Dataset.from_dict(cols).with_format("torch").save_to_disk(str(folder / "dataset"))
    return folder


def batches(folder, transfer_cls, collate_cls, monkeypatch, dtype=torch.bfloat16):
    """Every batch speculators' trainer loader makes of `folder` (no workers), with this transfer and collate."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import dataloader
    from speculators.train.data import ArrowDataset

    monkeypatch.setattr(dataloader, "CollateFn", collate_cls)
    dataset = ArrowDataset(
        PACKED, str(folder / "dataset"), transfer=transfer_cls(folder / "hidden_states"), on_missing="raise"
    )
    dataset.hidden_states_dtype = dtype
    loader = dataloader._setup_dataloader(
        dataset,
        PACKED,
        HIDDEN,
        num_workers=0,
        num_target_layers=LAYERS - 1,
        prefetch_factor=None,
        preprocess=shift_batch,
    )
    return list(loader)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_carried_batches_decode_to_speculators_own(tmp_path, monkeypatch, dtype):
    from hs_connectors import FP8Transfer
    from speculators.train.data import CollateFn

    folder = write_run(tmp_path, [FP8] * 5)
    stock = batches(folder, FP8Transfer, CollateFn, monkeypatch, dtype)
    carried = batches(folder, gpu_decode.CarriedFP8Transfer, gpu_decode.CarryingCollate, monkeypatch, dtype)
    assert len(stock) == len(carried) > 1
    for want, got in zip(stock, carried, strict=True):
        assert got["hidden_states"].dtype == torch.uint8  # what crosses to the GPU: the file's bytes
        assert got["hidden_states"].shape[-1] == (LAYERS - 1) * (HIDDEN + gpu_decode.SCALE_BYTES)
        got = gpu_decode.decode_batch(got)
        assert gpu_decode.CARRIED_KEY not in got
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype, key
                assert torch.equal(got[key], value), key  # bit for bit, padding included
            else:
                assert got[key] == value, key


def test_bf16_files_pass_through_unchanged(tmp_path, monkeypatch):
    from hs_connectors import FP8Transfer
    from speculators.train.data import CollateFn

    folder = write_run(tmp_path, [BFLOAT16] * 3)
    stock = batches(folder, FP8Transfer, CollateFn, monkeypatch)
    carried = batches(folder, gpu_decode.CarriedFP8Transfer, gpu_decode.CarryingCollate, monkeypatch)
    for want, got in zip(stock, carried, strict=True):
        assert gpu_decode.CARRIED_KEY not in got
        assert torch.equal(gpu_decode.decode_batch(got)["hidden_states"], want["hidden_states"])


def test_a_batch_mixing_the_encodings_is_refused(tmp_path, monkeypatch):
    folder = write_run(tmp_path, [FP8, BFLOAT16, FP8])
    with pytest.raises(ValueError, match="mixes fp8 and bfloat16"):
        batches(folder, gpu_decode.CarriedFP8Transfer, gpu_decode.CarryingCollate, monkeypatch)


def test_install_swaps_speculators_reader_and_collate(monkeypatch):
    from hs_connectors import HiddenStatesBackend
    from speculators.train import dataloader

    monkeypatch.setitem(HiddenStatesBackend.registry, "fp8", HiddenStatesBackend.registry["fp8"])
    monkeypatch.setattr(dataloader, "CollateFn", dataloader.CollateFn)
    gpu_decode.install()
    assert HiddenStatesBackend.registry["fp8"] is gpu_decode.CarriedFP8Backend
    assert dataloader.CollateFn is gpu_decode.CarryingCollate


@pytest.mark.parametrize("tokens,layers,hidden", [(5, 2, 7), (1, 5, 3), (1, 1, 5), (0, 4, 16)])
def test_carried_rows_decode_whatever_their_shape(tokens, layers, hidden):
    """Odd widths, one token (a carried row that is contiguous on its own, its scale off a 4-byte boundary), none."""
    from eyrie.hidden_states.encoding import dequantize, quantize

    x = (torch.randn(tokens, layers, hidden) * torch.logspace(-2, 3, layers).reshape(1, layers, 1)).bfloat16()
    values, scales = quantize(x)
    carried = gpu_decode.to_carried(values, scales)
    want = dequantize(values, scales)
    assert torch.equal(gpu_decode.from_carried(carried[:, :-1].flatten(1), hidden), want[:, :-1].flatten(1))
    assert torch.equal(gpu_decode.from_carried(carried[:, -1], hidden), want[:, -1])
