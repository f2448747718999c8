"""Extraction's per-file cost on the client: where the time goes once the server answers, at GPU file sizes.

Writes `--files` hidden-state files of `--tokens` x `--layers` x `--hidden` (bfloat16 by default: 16 KiB a token at
the defaults' 4 x 2048) into a staging folder with the server's own writer (Eyrie's connector's `_write_tensors`,
under the lock file the connector takes, named as its scheduler names them, the sample key in the name), then:

1. **steps, one thread**: each step of what extraction does with an answered file, timed per file on fresh files:
   the writer's lock (`answered_file`, `_wait_and_release`), the read, the safetensors parse, the checks (token ids,
   shape and encoding, finiteness), the checksum, the rename, the writeback's start; then the batched fsync of every
   file and of the folder. Also the whole of `checked_record` as extraction calls it (the read, parse, checks and
   checksum in one), and a few alternatives for comparison (blake3, a mapped read).
2. **extract_shard**: the real `extract_shard` over shards of those files, two shards at a time as the flow runs
   them, with a client that answers at once with a file already written (a server infinitely fast): the client's
   own throughput, its file threads and batched fsyncs included (and the per-shard capture check, checks 1-2).

Each pass starts after a `sync` (no pass pays for the writeback of the one before) on files written just before it
(dirty in the page cache, as the server leaves them). Run from the repository root:

    .venv/bin/python benchmarks/extract_client_cost.py
    .venv/bin/python benchmarks/extract_client_cost.py --files 96 --tokens 1536 --hidden 2048 --layers 4

Prints a table of milliseconds per file (median and total) and MB/s; `--json PATH` writes the figures.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY = "0123456789abcdef"


def _writer(dtype: str):
    """The connector's writer (`_write_tensors`, on an object with what it reads of itself: its dtype); where vLLM is
    not installed (a GPU host's bare Python), the calls that writer makes, in its order, with a note."""
    try:
        from eyrie.vllm.plugin.connector import EyrieHiddenStatesConnector
    except ImportError as err:
        from safetensors.torch import save_file

        from eyrie.hidden_states.encoding import encode
        from eyrie.hidden_states.keyed import key_from_name, key_metadata

        print(f"(no vLLM here: {err}; files written by the connector writer's own calls)", flush=True)

        def write(tensors, event, filename, lock_fd) -> None:
            try:
                save_file(encode(tensors, dtype), filename, metadata=key_metadata(key_from_name(filename)))
            finally:
                os.close(lock_fd)

        return write
    stub = object.__new__(EyrieHiddenStatesConnector)
    stub._hidden_states_dtype = dtype
    return stub._write_tensors


class _Done:  # as the connector's: the copy already happened
    def synchronize(self) -> None:
        pass


def write_files(staging: Path, rows: list[list[int]], layers: int, hidden: int, dtype: str) -> list[str]:
    """One file per row, written as the server's connector writes it: its lock file held (LOCK_EX) until the
    writer's `save_file` is done, its name from the scheduler's naming, the key recorded by the writer."""
    import torch

    from eyrie.hidden_states.keyed import name_with_key
    from eyrie.run.folder import server_file_name

    write = _writer(dtype)
    staging.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    paths = []
    for ids in rows:
        filename = os.path.join(staging, name_with_key(server_file_name(), KEY))
        lock_fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        hs = torch.randn(len(ids), layers, hidden, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        tensors = {"hidden_states": hs, "token_ids": torch.tensor(ids, dtype=torch.long)}
        write(tensors, _Done(), filename, lock_fd)
        paths.append(filename)
    return paths


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


class Steps:
    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def timed(self, name: str, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self.add(name, time.perf_counter() - t)
        return out


def steps_one_thread(work: Path, rows, layers: int, hidden: int, dtype: str) -> Steps:
    """Each step of the per-file work on fresh files, in the order extraction runs them, one thread."""
    import torch
    from safetensors.torch import load as load_bytes

    from eyrie.hidden_states.encoding import check_encoding
    from eyrie.run.files import fsync_path
    from eyrie.run.folder import answered_file, sample_path
    from eyrie.stages.extract import checks
    from eyrie.stages.extract.answered import _wait_and_release, start_writeback

    torch.set_num_threads(1)  # as extraction's file threads run
    s = Steps()
    staging, hidden_dir = work / "staging", work / "hidden_states"
    hidden_dir.mkdir(parents=True)
    os.sync()
    paths = write_files(staging, rows, layers, hidden, dtype)
    for i, (src, ids) in enumerate(zip(paths, rows, strict=True)):

        def wait(src=src) -> None:
            answered_file(src, work, hidden_dir, "x", written=False)
            _wait_and_release(src)
            answered_file(src, work, hidden_dir, "x")

        s.timed("writer lock + path checks", wait)

        def read(src=src) -> bytes:
            os.stat(src)
            with open(src, "rb") as f:
                return f.read()

        data = s.timed("read (stat + read)", read)
        tensors = s.timed("parse (safetensors load)", load_bytes, data)
        s.timed("check token ids", lambda t=tensors, ids=ids: t["token_ids"].tolist() == ids)
        s.timed("check shape + encoding", check_encoding, tensors, dtype)
        s.timed("check finite (all_finite)", checks.all_finite, tensors["hidden_states"])
        s.timed("sha256", lambda d=data: hashlib.sha256(d).hexdigest())
        dest = sample_path(hidden_dir, i)
        s.timed("rename", os.replace, src, dest)
        s.timed("start writeback", start_writeback, os.fspath(dest))
    t = time.perf_counter()
    for i in range(len(rows)):
        fsync_path(sample_path(hidden_dir, i))
    fsync_path(hidden_dir)
    s.add("fsync batch (all files + folder)", time.perf_counter() - t)
    return s


def whole_record(work: Path, rows, layers: int, hidden: int, dtype: str) -> Steps:
    """The extraction's own per-file calls, whole: `checked_record` (read, parse, checks, checksum in one), and
    alternatives measured on the same files for comparison."""
    import torch

    try:
        import blake3
    except ImportError:
        blake3 = None

    from safetensors.torch import load as load_bytes

    from eyrie.stages.extract import shard as shard_module

    torch.set_num_threads(1)
    s = Steps()
    os.sync()
    paths = write_files(work / "staging-whole", rows, layers, hidden, dtype)
    for src, ids in zip(paths, rows, strict=True):
        s.timed(
            "checked_record (as extraction calls it)",
            shard_module.checked_record,
            Path(src),
            ids,
            layers,
            hidden,
            dtype,
            KEY,
        )
        with open(src, "rb") as f:
            data = f.read()
        if blake3 is not None:
            s.timed("alt: blake3 (1 thread)", lambda d=data: blake3.blake3(d).hexdigest())
            s.timed(
                "alt: blake3 (max threads)", lambda d=data: blake3.blake3(d, max_threads=blake3.blake3.AUTO).hexdigest()
            )

        def mapped(src=src) -> str:
            with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return hashlib.sha256(m).hexdigest()

        s.timed("alt: sha256 of a mapped file", mapped)

        def into(src=src) -> int:
            size = os.stat(src).st_size
            buf = bytearray(size)
            with open(src, "rb", buffering=0) as f:
                return f.readinto(buf)

        s.timed("alt: readinto a bytearray", into)
        hs = load_bytes(data)["hidden_states"]
        s.timed("alt: finite by exponent bits", lambda h=hs: not bool(((h.view(torch.int16) & 0x7F80) == 0x7F80).any()))
    return s


def scheduled(work: Path, rows, layers: int, hidden: int, dtype: str, shard_size: int, concurrency: int) -> dict:
    """The real extract_shard over the files, two shards at a time, from a client answering at once."""
    import threading

    from eyrie.stages.extract.shard import extract_shard
    from eyrie.stages.prepare.dataset import _save_dataset
    from eyrie.stages.prepare.plan import plan_shards

    prepare_dir = work / "prepare"
    _save_dataset(prepare_dir / "dataset", rows, [[1] * len(r) for r in rows])
    shards = plan_shards(rows, shard_size)
    os.sync()
    paths = write_files(work / "extract" / "staging", rows, layers, hidden, dtype)
    answers = {tuple(ids): p for ids, p in zip(rows, paths, strict=True)}

    class Client:
        lock = threading.Lock()

        def extract(self, token_ids, timeout_s):
            return answers[tuple(token_ids)]

    hidden_dir = work / "extract" / "hidden_states"
    client = Client()
    # What extract_shard spends in each call it makes, summed over its threads (seconds), by wrapping its names.
    from eyrie.stages.extract import shard as shard_module

    spent: dict[str, float] = {}
    spent_lock = threading.Lock()

    def timing(name: str, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with spent_lock:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    wrapped = [
        "checked_record",
        "_wait_and_release",
        "start_writeback",
        "fsync_path",
        "check_shard",
        "load_dataset_rows",
        "write_manifest",
        "answered_file",
    ]
    saved = {n: getattr(shard_module, n) for n in wrapped}
    for n in wrapped:
        setattr(shard_module, n, timing(n, saved[n]))

    def one(shard) -> None:
        extract_shard(
            client,
            prepare_dir,
            shard,
            KEY,
            hidden_dir,
            work / "extract" / "shards" / f"{shard.name}.json",
            layers,
            hidden,
            concurrency=concurrency,
            log=lambda *_: None,
            hidden_states_dtype=dtype,
        )

    t = time.perf_counter()
    try:
        with ThreadPoolExecutor(2) as pool:  # two shard tasks at a time, as the extraction flow runs them
            for f in [pool.submit(one, sh) for sh in shards]:
                f.result()
    finally:
        for n, fn in saved.items():
            setattr(shard_module, n, fn)
    return {"seconds": time.perf_counter() - t, "shards": len(shards), "spent_s": spent}


def table(steps: Steps, mb: float) -> list[dict]:
    out = []
    for name, ts in steps.times.items():
        per = len(ts) > 1
        out.append(
            {
                "step": name,
                "median_ms": _ms(statistics.median(ts)) if per else None,
                "total_ms": _ms(sum(ts)),
                "MB_per_s": round(mb * len(ts) / sum(ts)) if per and sum(ts) > 0 else None,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16"])
    ap.add_argument("--shard-size", type=int, default=0, help="rows per shard in the extract_shard pass (files/4)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--work-dir", default=None, help="a folder on the disk the run uses (default: a new one in runs/)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import random

    rnd = random.Random(0)
    rows = [[rnd.randrange(1, 32000) for _ in range(args.tokens)] for _ in range(args.files)]
    mb = (args.tokens * (args.layers * args.hidden * 2 + 8)) / 1e6
    root = Path(args.work_dir or "runs")
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="extract-client-cost-", dir=root))
    try:
        print(
            f"{args.files} files of {args.tokens} tokens x {args.layers} layers x {args.hidden} ({mb:.1f} MB each) "
            f"in {work}, {os.cpu_count()} CPUs",
            flush=True,
        )
        one = steps_one_thread(work / "one", rows, args.layers, args.hidden, args.dtype)
        whole = whole_record(work / "whole", rows, args.layers, args.hidden, args.dtype)
        shard_size = args.shard_size or max(1, args.files // 4)
        try:
            sched = scheduled(work / "sched", rows, args.layers, args.hidden, args.dtype, shard_size, args.concurrency)
        except ImportError as err:  # no `datasets` for the prepared rows: the step tables alone
            print(f"(no extract_shard pass: {err})")
            sched = None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows_out = table(one, mb)
    per_file = sum(r["total_ms"] for r in rows_out) / args.files
    rows_out += table(whole, mb)
    print(f"\n{'step':44} {'median ms/file':>15} {'total ms':>10} {'MB/s':>8}")
    for r in rows_out:
        med = "" if r["median_ms"] is None else f"{r['median_ms']:.2f}"
        rate = "" if r["MB_per_s"] is None else str(r["MB_per_s"])
        print(f"{r['step']:44} {med:>15} {r['total_ms']:>10.1f} {rate:>8}")
    print(f"{'sum of the steps, one thread (per file)':44} {per_file:>15.2f} {per_file * args.files:>10.1f}")
    if sched is not None:
        tokens = args.files * args.tokens
        print(
            f"\nextract_shard, {sched['shards']} shards two at a time, client answering at once: "
            f"{sched['seconds']:.3f} s "
            f"= {tokens / sched['seconds']:,.0f} tokens/s, {mb * args.files / sched['seconds']:,.0f} MB/s, "
            f"{sched['seconds'] / args.files * 1000:.2f} ms/file"
        )
        for name, sec in sorted(sched["spent_s"].items(), key=lambda kv: -kv[1]):
            print(f"  in {name:28} {sec * 1000:10.1f} ms summed over threads")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "steps": rows_out, "extract_shard": sched}, indent=2)
        )


if __name__ == "__main__":
    main()
