"""fp8 hidden-state files decoded on the GPU instead of in the loader workers (train_entry's FP8_ON_GPU).

speculators' `fp8` backend (FP8Transfer) dequantizes each file to bfloat16 in a loader worker: a CPU cast that runs
at ~4-5k tokens/s per worker at Kimi-K2.5 dimensions, far below the trainer's ~33k tokens/s, and that doubles the
bytes every later copy moves (collate, pinning, host to device). Here a sample travels from the worker to the GPU
as its file's bytes: the fp8 values with the token's float32 scale appended to every layer's row (uint8
[T, L, H + 4]), so the scales follow their rows through speculators' own split, shift and packing untouched. The GPU
feed decodes the batch with FP8Transfer's arithmetic (`values.to(bf16) * scales.to(bf16)`), so the trainer gets the
same tensors, bit for bit.

Only the trainer's GPU path installs this (`install`); the classes live in a module of their own because the loader
workers, started before the trainer patches anything, unpickle them by reference.
"""

from __future__ import annotations

from typing import Any

import torch
from hs_connectors import HiddenStatesBackend
from hs_connectors.transfer import FP8Backend
from speculators.train.data import CollateFn

from eyrie.hidden_states.encoding import FP8, READER_BACKEND, SCALES_KEY, dequantize
from eyrie.hidden_states.pack_reader import PackedFP8Transfer

CARRIED_KEY = "eyrie_fp8_carried"  # on a collated batch of carried samples: (hidden size, the trainer's dtype name)
SCALE_BYTES = 4  # a float32 scale per token
HIDDEN_KEYS = ("hidden_states", "verifier_last_hidden_states")


def to_carried(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 values [T, L, H] and float32 scales [T, 1, 1] -> uint8 [T, L, H + 4]: each row's bytes, then its scale's."""
    tokens, layers, _ = values.shape
    scale_bytes = scales.reshape(tokens, 1, 1).to(torch.float32).contiguous().view(torch.uint8)
    return torch.cat([values.view(torch.uint8), scale_bytes.expand(tokens, layers, SCALE_BYTES)], dim=-1)


def from_carried(carried: torch.Tensor, hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 [..., n * (H + 4)] (n rows side by side, as speculators flattens layers) -> [..., n * H] in `dtype`,
    decoded as FP8Transfer decodes (to bfloat16) and then cast as speculators' collate casts."""
    rows = carried.unflatten(-1, (-1, hidden_size + SCALE_BYTES))
    values = rows[..., :hidden_size].view(getattr(torch, FP8))
    # a copy of its own: a view (already contiguous when there is one row) may start off a 4-byte boundary
    scales = rows[..., hidden_size:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return dequantize(values, scales).to(dtype).flatten(-2)


def decode_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A collated batch with its hidden states decoded where they are (the GPU); batches not carried pass through."""
    carried = batch.pop(CARRIED_KEY, None)
    if carried is None:
        return batch
    hidden_size, dtype = carried
    for key in HIDDEN_KEYS:
        batch[key] = from_carried(batch[key], hidden_size, getattr(torch, dtype))
    return batch


class CarriedFP8Transfer(PackedFP8Transfer):
    """FP8Transfer that leaves fp8 samples as bytes (`to_carried`) for the GPU to decode; bf16 files pass
    unchanged. It reads packed storage as well (`extraction.storage: packed`, eyrie/hidden_states/pack_reader.py)."""

    def _dequantize(self, sample: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        if sample is None or SCALES_KEY not in sample:
            return sample
        out = {k: v for k, v in sample.items() if k != SCALES_KEY}
        out["hidden_states"] = to_carried(sample["hidden_states"], sample[SCALES_KEY])
        return out


class CarriedFP8Backend(FP8Backend):
    """speculators' `fp8` backend (same arguments, same files) handing the trainer a CarriedFP8Transfer."""

    @staticmethod
    def from_train_args(args, data_path: str) -> CarriedFP8Transfer:  # type: ignore[no-untyped-def,override]
        plain = FP8Backend.from_train_args(args, data_path)
        return CarriedFP8Transfer(plain.hidden_states_path, plain.dequantize_dtype)


class CarryingCollate(CollateFn):
    """speculators' collate, collating carried samples as bytes (its cast to the trainer's dtype would read fp8 bytes
    as numbers) and marking the batch for `decode_batch`."""

    def __call__(self, batch):  # type: ignore[no-untyped-def]
        samples = [b for b in batch if isinstance(b, dict)]
        carried = [b["hidden_states"].dtype == torch.uint8 for b in samples]
        if not any(carried):
            return super().__call__(batch)
        if not all(carried):
            raise ValueError(
                "a batch mixes fp8 and bfloat16 hidden-state files: the extraction folder holds files of two "
                "extraction.hidden_states_dtype settings; extract again (`eyrie run` redoes shards of the other dtype)"
            )
        dtype, self.dtype = self.dtype, torch.uint8
        try:
            out = super().__call__(batch)
        finally:
            self.dtype = dtype
        out[CARRIED_KEY] = (self.hidden_size, str(dtype).removeprefix("torch."))
        return out


def install() -> None:
    """The trainer's loaders read fp8 files through CarriedFP8Transfer and collate with CarryingCollate; the GPU
    feed (train_entry._copied_ahead) then calls `decode_batch`."""
    from speculators.train import dataloader

    HiddenStatesBackend.registry[READER_BACKEND] = CarriedFP8Backend
    dataloader.CollateFn = CarryingCollate  # type: ignore[misc]
