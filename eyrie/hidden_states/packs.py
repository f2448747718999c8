"""Packed hidden-state storage (`extraction.storage: packed`): one safetensors file per shard, not one per sample.

A shard's pack, `packs/<start>_<stop>.safetensors` inside the hidden-states folder, holds sample i's tensors under
`<i>/hidden_states`, `<i>/token_ids` (and `<i>/hidden_states_scales` for fp8), each the bytes of its per-sample file
copied unchanged. safetensors keeps every tensor's offsets in the file's header, so a reader maps the pack and reads
one sample without the rest (`PackReader`). The rows are in the name, so the folder's listing is the index: no index
file that shards extracting at once (or nodes sharing the folder) would have to update together.

Only the standard library, torch and safetensors here: extraction writes packs, the trainer's loader workers read
them (eyrie/hidden_states/pack_reader.py plugs `PackReader` into speculators' reader).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from eyrie.run.files import TMP_SUFFIX, fsync_path, remove_abandoned, temporary_file
from eyrie.run.folder import sample_name

if TYPE_CHECKING:
    import torch

FILES = "files"
PACKED = "packed"
STORAGES = (FILES, PACKED)
PACKS_DIR = "packs"
KEY_METADATA = "eyrie_shard_key"  # the pack's safetensors metadata: the shard key it was made for
_PACK = re.compile(r"(\d+)_(\d+)\.safetensors")
_COPY_CHUNK = 8 << 20


def pack_name(start: int, stop: int) -> str:
    """The pack of rows [start, stop), relative to the hidden-states folder (as its shard manifest lists it)."""
    return f"{PACKS_DIR}/{start}_{stop}.safetensors"


def pack_ranges(hidden_dir: Path) -> list[tuple[int, int, Path]]:
    """(start, stop, path) of every pack in the folder, by start; half-written ones (`.<name>.eyrie-tmp`) aside."""
    try:
        names = os.listdir(Path(hidden_dir) / PACKS_DIR)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if m := _PACK.fullmatch(name):
            out.append((int(m[1]), int(m[2]), Path(hidden_dir) / PACKS_DIR / name))
    return sorted(out)


def temporary_pack(dest: Path) -> Path:
    """Where the pack `dest` is written before it is renamed into place."""
    return dest.with_name(f".{dest.name}{TMP_SUFFIX}")


def remove_half_written(hidden_dir: Path) -> int:
    """Remove the half-written packs whose writer is gone (killed inside `write_pack`: up to a shard's bytes each),
    of any row range (a range a later plan no longer has too); a pack being written now is locked by its writer,
    on this node or another sharing the folder, and kept. Returns how many went."""
    try:
        entries = list(os.scandir(Path(hidden_dir) / PACKS_DIR))
    except FileNotFoundError:
        return 0
    return sum(remove_abandoned(Path(e.path)) for e in entries if e.name.endswith(TMP_SUFFIX))


def remove_overlapping(hidden_dir: Path, start: int, stop: int) -> int:
    """Remove every pack holding any of rows [start, stop), and every abandoned half-written pack
    (`remove_half_written`): a shard about to be extracted must not leave a reader (which prefers packs to files) an
    older copy of its samples. Returns how many whole packs went."""
    n = 0
    for a, b, path in pack_ranges(hidden_dir):
        if a < stop and start < b:
            path.unlink(missing_ok=True)
            n += 1
    remove_half_written(hidden_dir)
    return n


def shard_entries(manifest: dict) -> Iterator[tuple[str, str]]:
    """(its key in the manifest's `files`, its path relative to the hidden-states folder) for each file a shard
    manifest lists: its pack, or each sample's file."""
    if manifest.get("storage") == PACKED:
        for name in manifest["files"]:
            yield name, name
    else:
        for idx in manifest["files"]:
            yield idx, sample_name(int(idx))


def _header(path: Path) -> tuple[int, dict]:
    """(where the data starts, the tensors' entries) of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def write_pack(samples: list[tuple[int, Path]], dest: Path, key: str) -> dict:
    """Copy the per-sample files `samples` ((index, path) in row order) into one safetensors file at `dest`, whole
    or not at all (a temporary file, fsynced, renamed, the folder fsynced). Returns {"bytes", "sha256", "stat"} of
    the pack, hashed as it is written (a pack is a shard's worth of bytes: not read a second time).

    Streamed tensor by tensor, so a shard of any size takes little memory. The tensors are laid out by element size,
    largest first (all token ids, then fp8 scales, then hidden states), as safetensors lays out its own files: every
    tensor starts aligned to its element size with no padding between them."""
    entries = []
    for idx, path in samples:
        base, header = _header(path)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            numel = math.prod(info["shape"])
            size = (end - begin) // numel if numel else 1
            entries.append((-size, idx, name, info, path, base + begin, end - begin))
    entries.sort(key=lambda e: e[:3])
    tensors, offset = {}, 0
    for _, idx, name, info, _, _, length in entries:
        tensors[f"{idx}/{name}"] = {
            "dtype": info["dtype"],
            "shape": info["shape"],
            "data_offsets": [offset, offset + length],
        }
        offset += length
    header_bytes = json.dumps({"__metadata__": {KEY_METADATA: key}, **tensors}, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_pack(dest)
    digest = hashlib.sha256()
    buf = bytearray(_COPY_CHUNK)
    try:
        # Locked by this writer until the rename: `remove_half_written` removes it only once the writer is gone.
        with temporary_file(tmp) as out:
            for block in (len(header_bytes).to_bytes(8, "little"), header_bytes):
                out.write(block)
                digest.update(block)
            for *_, path, start, length in entries:
                with open(path, "rb") as src:
                    src.seek(start)
                    while length:
                        view = memoryview(buf)[: min(length, _COPY_CHUNK)]
                        got = src.readinto(view)
                        if not got:
                            raise OSError(f"{path}: ended early while packing it")
                        out.write(view[:got])
                        digest.update(view[:got])
                        length -= got
            out.flush()
            os.fsync(out.fileno())
            st = os.fstat(out.fileno())
            os.replace(tmp, dest)
        fsync_path(dest.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"bytes": st.st_size, "sha256": digest.hexdigest(), "stat": st}


class PackReader:
    """Samples of the packs in one hidden-states folder, as one loader worker reads them.

    The index (which pack holds sample i) is the folder's listing of packs, read on first use; up to `max_open`
    packs stay open (a worker reads from every shard in turn, and a run has thousands). Pickled (to a loader
    worker) it carries only its folder: each worker opens its own."""

    def __init__(self, hidden_dir: Path, max_open: int = 64):
        self.hidden_dir = Path(hidden_dir)
        self.max_open = max_open
        self._starts: list[int] | None = None
        self._packs: list[tuple[int, int, Path]] = []
        self._open: OrderedDict[Path, tuple[object, dict[int, list[str]]]] = OrderedDict()

    def __getstate__(self) -> dict:
        return {"hidden_dir": self.hidden_dir, "max_open": self.max_open}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["hidden_dir"], state["max_open"])  # type: ignore[misc]

    def pack_of(self, idx: int) -> Path | None:
        if self._starts is None:
            self._packs = pack_ranges(self.hidden_dir)
            for (_, stop, a), (start, _, b) in zip(self._packs, self._packs[1:]):
                if start < stop:
                    raise ValueError(f"packs {a.name} and {b.name} overlap: extract again (`eyrie run`)")
            self._starts = [start for start, _, _ in self._packs]
        i = bisect.bisect_right(self._starts, idx) - 1
        if i >= 0 and idx < self._packs[i][1]:
            return self._packs[i][2]
        return None

    def read(self, idx: int) -> dict[str, torch.Tensor] | None:
        """Sample `idx`'s tensors under their per-sample names, or None when no pack holds it."""
        path = self.pack_of(idx)
        if path is None:
            return None
        handle, names = self._handle(path)
        return {name: handle.get_tensor(f"{idx}/{name}") for name in names[idx]}  # type: ignore[attr-defined]

    def _handle(self, path: Path) -> tuple[object, dict[int, list[str]]]:
        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        from safetensors import safe_open

        handle = safe_open(str(path), framework="pt")
        names: dict[int, list[str]] = {}
        for key in handle.keys():
            idx, _, name = key.partition("/")
            names.setdefault(int(idx), []).append(name)
        self._open[path] = (handle, names)
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return self._open[path]
