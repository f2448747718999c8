"""Hidden-state storage at scale: one file per sample (`extraction.storage: files`) against one pack per shard
(`packed`, eyrie/hidden_states/packs.py), side by side in one run.

It writes N small synthetic samples in Eyrie's format (`hs_<i>.safetensors`, bf16 `hidden_states` [T, layers,
hidden] and `token_ids`; small, so that the run measures the filesystem's metadata work, not its bandwidth) and
times, for each storage:

- extraction's writes: files: the N files created; packed: the same files, then each shard's pack written from them
  (`write_pack`, fsynced as extraction does) and the files removed;
- what the run then leaves in the hidden-states folder (entries), and the metadata work every later pass does on it:
  list the folder, stat every entry (a cached run's check), open and close every entry (a reader's open);
- the trainer's loader read rate on the first `--read-samples` samples through speculators' own `ArrowDataset`,
  its packing sampler, `CollateFn` and `shift_batch` (speculators' `file` backend for the files, Eyrie's
  `PackedFileTransfer` for the packs), from the page cache: the CPU cost of a read, not the disk's;
- removing the hidden states (`shutil.rmtree`, as `rm -r`).

Local disk numbers; on NFS or Lustre each metadata operation (create, stat, open, unlink) is a round trip to a
server, so the files column scales with the entry count times that latency.

    .venv/bin/python benchmarks/packed_storage.py --samples 200000
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save  # noqa: E402

from eyrie.hidden_states.packs import pack_name, write_pack  # noqa: E402
from eyrie.run.folder import sample_path  # noqa: E402

DISTINCT = 1000  # distinct samples, cycled: sample i holds sample i % DISTINCT's bytes (the dataset agrees)


def blobs(seq_len: int, layers: int, hidden: int) -> tuple[list[bytes], list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    out, ids = [], []
    for _ in range(DISTINCT):
        t = torch.randint(0, 32000, (seq_len,), generator=g)
        x = torch.randn(seq_len, layers, hidden, generator=g).to(torch.bfloat16)
        out.append(save({"hidden_states": x, "token_ids": t}))
        ids.append(t.tolist())
    return out, ids


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def write_files(hidden: Path, data: list[bytes], n: int) -> None:
    hidden.mkdir(parents=True)
    for i in range(n):
        with open(sample_path(hidden, i), "wb") as f:
            f.write(data[i % DISTINCT])


def pack_all(hidden: Path, n: int, shard: int) -> None:
    for start in range(0, n, shard):
        stop = min(start + shard, n)
        write_pack([(i, sample_path(hidden, i)) for i in range(start, stop)], hidden / pack_name(start, stop), "k")
        for i in reversed(range(start, stop)):
            sample_path(hidden, i).unlink()


def entries(hidden: Path) -> list[str]:
    """Every path below the folder (files mode: its files; packed: `packs/` and the packs)."""
    out = []
    for parent, dirs, names in os.walk(hidden):
        out += [os.path.join(parent, d) for d in dirs] + [os.path.join(parent, n) for n in names]
    return out


def stat_all(paths: list[str]) -> None:
    for p in paths:
        os.stat(p)


def open_all(paths: list[str]) -> None:
    for p in paths:
        if not os.path.isdir(p):
            os.close(os.open(p, os.O_RDONLY))


def write_dataset(folder: Path, ids: list[list[int]], n: int) -> None:
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()
    rows = [ids[i % DISTINCT] for i in range(n)]
    Dataset.from_dict(
        {"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows], "seq_len": [len(r) for r in rows]}
    ).with_format("torch").save_to_disk(str(folder))


def read_rate(data: Path, hidden: Path, transfer_cls, total_seq_len: int, hidden_size: int, layers: int) -> dict:
    """Samples and tokens per second through speculators' loader (no workers: the main process's CPU per read)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import dataloader
    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset(total_seq_len, str(data), transfer=transfer_cls(hidden), on_missing="raise")
    loader = dataloader._setup_dataloader(
        dataset,
        total_seq_len,
        hidden_size,
        num_workers=0,
        num_target_layers=layers - 1,
        prefetch_factor=None,
        preprocess=shift_batch,
    )
    t0 = time.perf_counter()
    tokens = samples = 0
    for batch in loader:
        docs = batch["document_ids"]  # each position's sample in the packed batch, -1 for padding
        tokens += int((docs >= 0).sum())
        samples += int(docs.max()) + 1
    s = time.perf_counter() - t0
    return {"samples_per_s": samples / s, "tokens_per_s": tokens / s, "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--shard-size", type=int, default=512, help="samples per pack (the Kimi-K2.5 preset's shards)")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--read-samples", type=int, default=20_000, help="samples the loader reads per storage")
    ap.add_argument("--dir", help="where the files go (default: a temporary folder, removed after)")
    a = ap.parse_args()
    from hs_connectors import FileTransfer

    from eyrie.hidden_states.pack_reader import PackedFileTransfer

    root = Path(tempfile.mkdtemp(prefix="eyrie-packed-", dir=a.dir))
    try:
        data, ids = blobs(a.seq_len, a.layers, a.hidden)
        r: dict[str, dict] = {"files": {}, "packed": {}}
        for storage, row in r.items():
            hidden = root / storage / "hidden_states"
            row["create"] = timed(write_files, hidden, data, a.samples)
            if storage == "packed":
                row["pack"] = timed(pack_all, hidden, a.samples, a.shard_size)
            t0 = time.perf_counter()
            paths = entries(hidden)
            row["list"] = time.perf_counter() - t0
            row["entries"] = len(paths)
            row["bytes"] = sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
            row["stat"] = timed(stat_all, paths)
            row["open"] = timed(open_all, paths)
            n = min(a.read_samples, a.samples)
            write_dataset(root / storage / "dataset", ids, n)
            cls = FileTransfer if storage == "files" else PackedFileTransfer
            row.update(read_rate(root / storage / "dataset", hidden, cls, 4096, a.hidden, a.layers))
            row["delete"] = timed(shutil.rmtree, hidden)
        f, p = r["files"], r["packed"]
        print(
            f"{a.samples:,} samples of {a.seq_len} tokens x {a.layers} layers x {a.hidden} (bf16), packs of "
            f"{a.shard_size}; local disk {root}"
        )
        print(f"{'':34}{'files':>14}{'packed':>14}")
        lines = [
            ("entries in the hidden-states folder", f"{f['entries']:,}", f"{p['entries']:,}"),
            ("bytes", f"{f['bytes']:,}", f"{p['bytes']:,}"),
            ("create the per-sample files (s)", f"{f['create']:.1f}", f"{p['create']:.1f}"),
            ("+ pack and remove them (s)", "-", f"{p['pack']:.1f}"),
            ("list (s)", f"{f['list']:.2f}", f"{p['list']:.3f}"),
            ("stat every entry (s)", f"{f['stat']:.2f}", f"{p['stat']:.3f}"),
            ("open every entry (s)", f"{f['open']:.2f}", f"{p['open']:.3f}"),
            ("delete, rm -r (s)", f"{f['delete']:.1f}", f"{p['delete']:.2f}"),
            (
                f"loader samples/s ({f['samples']:,} read)",
                f"{f['samples_per_s']:,.0f}",
                f"{p['samples_per_s']:,.0f}",
            ),
            ("loader tokens/s", f"{f['tokens_per_s']:,.0f}", f"{p['tokens_per_s']:,.0f}"),
        ]
        for name, x, y in lines:
            print(f"{name:<34}{x:>14}{y:>14}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
