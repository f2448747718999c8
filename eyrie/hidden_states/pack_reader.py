"""speculators' trainer reading packed hidden states (`extraction.storage: packed`, eyrie/hidden_states/packs.py).

speculators reads sample i through its hidden-states transfer's `get_cached(i)` (hs_connectors: FileTransfer opens
`hs_<i>.safetensors`, FP8Transfer dequantizes what it returns). `PackedFileTransfer` answers from the sample's pack
when a pack holds it, and otherwise opens the file exactly as FileTransfer does, so one reader serves both storages.
FP8Transfer's dequantization (and gpu_decode's CarriedFP8Transfer, which subclasses `PackedFP8Transfer`) sits above
it unchanged. `install` puts these behind speculators' `file` and `fp8` backends in the trainer process.

The classes live in a module of their own: loader workers unpickle the transfer by reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hs_connectors import FileTransfer, FP8Transfer, HiddenStatesBackend
from hs_connectors.transfer import FileBackend, FP8Backend

from eyrie.hidden_states.packs import PackReader


class PackedFileTransfer(FileTransfer):
    """FileTransfer that reads a sample from its pack when one holds it."""

    def __init__(self, hidden_states_path: Path):
        super().__init__(hidden_states_path)
        self.packs = PackReader(hidden_states_path)

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        sample = self.packs.read(file_idx)
        return sample if sample is not None else super().get_cached(file_idx)


class PackedFP8Transfer(FP8Transfer, PackedFileTransfer):
    """FP8Transfer over PackedFileTransfer (its `super()` is PackedFileTransfer here): packs and files, fp8
    dequantized, bf16 passed through."""


class PackedFileBackend(FileBackend):
    @staticmethod
    def from_train_args(args, data_path: str) -> PackedFileTransfer:  # type: ignore[no-untyped-def,override]
        return PackedFileTransfer(FileBackend.from_train_args(args, data_path).hidden_states_path)


class PackedFP8Backend(FP8Backend):
    @staticmethod
    def from_train_args(args, data_path: str) -> PackedFP8Transfer:  # type: ignore[no-untyped-def,override]
        plain = FP8Backend.from_train_args(args, data_path)
        return PackedFP8Transfer(plain.hidden_states_path, plain.dequantize_dtype)


def install() -> None:
    """speculators' `file` and `fp8` backends read packs too (a folder without packs reads as before)."""
    HiddenStatesBackend.registry["file"] = PackedFileBackend
    HiddenStatesBackend.registry["fp8"] = PackedFP8Backend
