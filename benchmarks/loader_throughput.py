"""Hidden-state loader throughput from cold files: bf16 against fp8 (`extraction.hidden_states_dtype`), side by side
in one run, against what the trainer consumes.

It writes synthetic samples in Eyrie's format (`hs_<i>.safetensors`: `hidden_states` [T, layers, hidden] and
`token_ids`, fp8 ones with speculators' `hidden_states_scales`; eyrie/hidden_states/encoding.py) at chosen dimensions
(default
Kimi-K2.5's: 4 captured layers x 7168, 2047-token samples packed 4096), plus a prepared dataset beside them. Then it
reads them the way the trainer does: speculators' `ArrowDataset`, its packing batch sampler, `CollateFn` and
`shift_batch`, through a `DataLoader` with spawned workers (speculators' `_setup_dataloader`), each batch then copied
to the trainer's device (`--device`, the GPU when there is one). Three readers:

- `bf16`: bf16 files, speculators' `file` backend.
- `fp8`: fp8 files, speculators' `fp8` backend (FP8Transfer): dequantized to bf16 on the CPU, in the loader workers.
- `fp8-dev`: fp8 files as Eyrie's GPU trainer reads them (eyrie/hidden_states/gpu_decode.py, train_entry's FP8_ON_GPU):
the
  workers pass the file's bytes on, and the batch is decoded on `--device` after the copy (on a CPU-only machine
  that is the main process: not the trainer's path, marked as such).

Before every pass the page cache is dropped for those files (fsync, then posix_fadvise DONTNEED), so each pass reads
from the disk. Passes alternate between the readers.

Reported per reader: loader tokens/s over cold passes with the workers already up (median; the first pass, which
also starts the workers, beside it), the file bytes read per second, a bare cold read of the same files (plain reads,
nothing decoded: the disk's ceiling), bytes per token, and the ratio to `--trainer-tokens-per-s` (default 32,000:
issue 13's target for one H200), whose bytes per second at Kimi dimensions are printed too. A last pass per reader
reads the files from the page cache ("warm": the loader's CPU ceiling, decoding included).

Needs torch, safetensors and speculators (with `datasets`), no vLLM: `.venv/bin/python benchmarks/loader_throughput.py`
here, or on a GPU machine with the wheels beside the code. Without speculators, `--reader eyrie` reads the files with
safetensors and the same dequantization (not the trainer's path: marked as such).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from eyrie.hidden_states.encoding import BFLOAT16, FP8, bytes_per_token, encode  # noqa: E402

KIMI_LAYERS, KIMI_HIDDEN = 4, 7168


def drop_cache(paths: list[Path]) -> None:
    """Evict these files from the page cache (they must be clean: written files are fsynced first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_samples(folder: Path, dtype: str, n: int, seq_len: int, layers: int, hidden: int, seed: int) -> list[Path]:
    """n files of seq_len tokens in `dtype`'s encoding: states like a big model's (per-layer scales, a massive
    activation channel), the same values for both dtypes."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-0.5, 1.5, layers).reshape(1, layers, 1)
    paths = []
    for i in range(n):
        x = torch.randn(seq_len, layers, hidden, generator=g) * scale
        x[:, -1, 7] = 1000.0
        ids = torch.randint(0, 32000, (seq_len,), generator=g)
        p = folder / f"hs_{i}.safetensors"
        save_file(encode({"hidden_states": x.to(torch.bfloat16), "token_ids": ids}, dtype), str(p))
        paths.append(p)
    drop_cache(paths)
    return paths


def write_dataset(folder: Path, paths: list[Path]) -> None:
    """speculators' prepared dataset for these files (input_ids, loss_mask, seq_len), as Eyrie's prepare writes it."""
    from datasets import Dataset, disable_progress_bars
    from safetensors import safe_open

    disable_progress_bars()
    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for p in paths:
        with safe_open(str(p), "pt") as f:
            ids = f.get_tensor("token_ids").tolist()
        cols["input_ids"].append(ids)
        cols["loss_mask"].append([1] * len(ids))
        cols["seq_len"].append(len(ids))
    Dataset.from_dict(cols).with_format("torch").save_to_disk(str(folder))


# reader -> the files it reads
READERS = {BFLOAT16: BFLOAT16, FP8: FP8, "fp8-dev": FP8}


def speculators_loader(
    data: Path, hidden_dir: Path, reader: str, total_seq_len: int, hidden: int, layers: int, workers: int
):
    from hs_connectors import FileTransfer, FP8Transfer
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import dataloader
    from speculators.train.data import ArrowDataset

    dataloader._limit_worker_threads()
    transfer = {BFLOAT16: FileTransfer, FP8: FP8Transfer}.get(reader)
    collate = dataloader.CollateFn
    if transfer is None:  # fp8-dev: as train_entry's FP8_ON_GPU installs it
        from eyrie.hidden_states import gpu_decode

        transfer, dataloader.CollateFn = gpu_decode.CarriedFP8Transfer, gpu_decode.CarryingCollate
    dataset = ArrowDataset(total_seq_len, data, transfer=transfer(hidden_dir), on_missing="raise")
    try:
        return dataloader._setup_dataloader(
            dataset,
            total_seq_len,
            hidden,
            num_workers=workers,
            num_target_layers=layers - 1,
            prefetch_factor=4 if workers else None,
            preprocess=shift_batch,
        )
    finally:
        dataloader.CollateFn = collate


def on_device(batches, device: torch.device):
    """Each batch copied to `device` as the trainer's feed copies it, carried fp8 decoded there, the copy waited for."""
    from eyrie.hidden_states.gpu_decode import decode_batch

    for batch in batches:
        moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        moved = decode_batch(moved)  # batches not carried pass through
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        yield moved


def eyrie_reader(hidden_dir: Path, n: int):
    """Without speculators: the files read and decoded as its readers do, one at a time (not the trainer's path)."""
    from safetensors.torch import load_file

    from eyrie.hidden_states.encoding import decode

    for i in range(n):
        d = decode(load_file(str(hidden_dir / f"hs_{i}.safetensors")))
        yield {"input_ids": d["token_ids"], "hidden_states": d["hidden_states"]}


def _tokens(batch: dict) -> int:
    """The sample tokens in a batch (a packed batch's padding left out)."""
    if "lengths" in batch:
        return int(batch["lengths"].sum())
    return int(batch["input_ids"].numel())


def timed_pass(make_batches, paths: list[Path], cold: bool = True) -> dict:
    """One pass over every file: the page cache dropped (`cold`), then the loader iterated to its end (workers already
    running: persistent, started by the warm-up pass)."""
    if cold:
        drop_cache(paths)
    t0 = time.perf_counter()
    tokens = sum(_tokens(batch) for batch in make_batches())
    seconds = time.perf_counter() - t0
    real = sum(int(p.stat().st_size) for p in paths)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "file_bytes": real,
        "file_gb_per_s": real / seconds / 1e9,
    }


def raw_read_pass(paths: list[Path], chunk: int = 16 << 20) -> float:
    """GB/s of a bare cold read of the files, nothing decoded."""
    drop_cache(paths)
    buf = bytearray(chunk)
    t0 = time.perf_counter()
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where the files go (default: a temporary folder, removed after)")
    ap.add_argument("--samples", type=int, help="files per dtype (default: 8 per worker, at least 24)")
    ap.add_argument("--seq-len", type=int, default=2047, help="tokens per file")
    ap.add_argument("--layers", type=int, default=KIMI_LAYERS, help="captured layers (3 aux + the last)")
    ap.add_argument("--hidden", type=int, default=KIMI_HIDDEN)
    ap.add_argument("--total-seq-len", type=int, default=4096, help="the trainer's packed length")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="loader workers (trainer: 12)")
    ap.add_argument("--passes", type=int, default=2, help="cold passes per reader (alternating)")
    ap.add_argument("--trainer-tokens-per-s", type=float, default=32000.0)
    ap.add_argument("--reader", choices=["speculators", "eyrie"], default="speculators")
    ap.add_argument("--device", help="where batches are copied (and fp8-dev decoded): default cuda when available")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args()
    args.samples = args.samples or max(24, 8 * args.workers)
    batches_per_pass = args.samples * args.seq_len // args.total_seq_len
    if args.reader == "speculators" and batches_per_pass < 4 * max(args.workers, 1):
        print(
            f"warning: {batches_per_pass} batches a pass for {args.workers} workers: each pass measures one batch's "
            "latency, not the loader's throughput (use --samples >= 8 x workers)",
            file=sys.stderr,
        )

    readers = list(READERS) if args.reader == "speculators" else [BFLOAT16, FP8]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="eyrie-loader-bench-"))
    try:
        files, t_write = {}, {}
        for dtype in (BFLOAT16, FP8):
            t0 = time.perf_counter()
            files[dtype] = write_samples(
                root / dtype / "hidden_states", dtype, args.samples, args.seq_len, args.layers, args.hidden, seed=0
            )
            t_write[dtype] = time.perf_counter() - t0
            if args.reader == "speculators":
                write_dataset(root / dtype / "dataset", files[dtype])
        results: dict[str, list[dict]] = {r: [] for r in readers}
        raw: dict[str, list[float]] = {r: [] for r in readers}
        batches, startup, warm = {}, {}, {}
        for reader in readers:
            dtype = READERS[reader]
            hidden_dir = root / dtype / "hidden_states"
            if args.reader == "speculators":
                loader = speculators_loader(
                    root / dtype / "dataset",
                    hidden_dir,
                    reader,
                    args.total_seq_len,
                    args.hidden,
                    args.layers,
                    args.workers,
                )
                batches[reader] = lambda loader=loader: on_device(iter(loader), device)
            else:
                batches[reader] = lambda hidden_dir=hidden_dir: eyrie_reader(hidden_dir, args.samples)
            # Warm-up: a first cold pass that also starts the (persistent) workers; reported, not counted.
            startup[reader] = timed_pass(batches[reader], files[dtype])
        for _ in range(args.passes):
            for reader in readers:
                results[reader].append(timed_pass(batches[reader], files[READERS[reader]]))
                raw[reader].append(raw_read_pass(files[READERS[reader]]))
        for reader in readers:  # the files were just read: in the page cache if memory holds them
            warm[reader] = timed_pass(batches[reader], files[READERS[reader]], cold=False)

        need_bf16 = args.trainer_tokens_per_s * bytes_per_token(KIMI_LAYERS, KIMI_HIDDEN, BFLOAT16) / 1e9
        need_fp8 = args.trainer_tokens_per_s * bytes_per_token(KIMI_LAYERS, KIMI_HIDDEN, FP8) / 1e9
        print(
            f"loader throughput, cold files, {args.samples} x {args.seq_len} tokens per dtype at {args.layers} layers "
            f"x {args.hidden} (packed {args.total_seq_len}), {args.workers} workers, batches to {device}, "
            f"reader: {args.reader}" + ("" if args.reader == "speculators" else " (NOT the trainer's path)")
        )
        if device.type != "cuda" and "fp8-dev" in readers:
            print(
                "fp8-dev decodes on the CPU here, in the main process (NOT the trainer's path: it decodes on its GPU)"
            )
        print(
            f"trainer consumes {args.trainer_tokens_per_s:,.0f} tokens/s = {need_bf16:.2f} GB/s bf16, "
            f"{need_fp8:.2f} GB/s fp8 at Kimi dims ({KIMI_LAYERS} x {KIMI_HIDDEN})"
        )
        header = f"{'reader':<14}{'bytes/token':>12}{'tok/s cold':>12}{'1st pass':>10}{'file GB/s':>11}"
        print(header + f"{'raw read GB/s':>15}{'x trainer':>11}{'tok/s warm':>12}{'write s':>9}")
        out = {"args": vars(args), "device": str(device), "results": {}}
        for reader in readers:
            rs = results[reader]
            steady = statistics.median(r["tokens_per_s"] for r in rs)
            total = startup[reader]["tokens_per_s"]
            gbs = statistics.median(r["file_gb_per_s"] for r in rs)
            rawr = statistics.median(raw[reader])
            bpt = rs[0]["file_bytes"] / (args.samples * args.seq_len)
            print(
                f"{reader:<14}{bpt:>12,.0f}{steady:>12,.0f}{total:>10,.0f}{gbs:>11.2f}{rawr:>15.2f}"
                f"{steady / args.trainer_tokens_per_s:>11.2f}{warm[reader]['tokens_per_s']:>12,.0f}"
                f"{t_write[READERS[reader]]:>9.1f}"
            )
            out["results"][reader] = {
                "bytes_per_token": bpt,
                "tokens_per_s": steady,
                "first_pass_tokens_per_s": total,
                "file_gb_per_s": gbs,
                "raw_read_gb_per_s": rawr,
                "passes": rs,
                "raw_passes": raw[reader],
                "warm_pass": warm[reader],
            }
        out["trainer_gb_per_s_kimi"] = {BFLOAT16: need_bf16, FP8: need_fp8}
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(out) + "\n")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
