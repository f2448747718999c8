"""extract: one shard's hidden states through the vLLM extraction server, each file validated, then a manifest.

Files follow speculators' format (`hs_<i>.safetensors` with `hidden_states` [T, n_layers, H] and `token_ids` [T],
i the row index in the prepared dataset), all in one folder, so speculators' own loader reads them. The shard's
manifest, written last and atomically, records every file's checksum: it is the proof the shard is complete. It also
records each file's stat (size, mtime_ns, inode), so a later run trusts an unchanged file without reading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

from eyrie.errors import DiskFullError, ExtractionError
from eyrie.hidden_states.check import check_shard, record_context
from eyrie.hidden_states.encoding import BFLOAT16, FP8, check_encoding
from eyrie.hidden_states.packs import FILES, PACKED, pack_name, remove_overlapping, shard_entries, write_pack
from eyrie.hidden_states.staging import staging_dir
from eyrie.run.faults import fault_point
from eyrie.run.folder import (
    answered_file,
    atomic_write_json,
    fsync_path,
    read_json,
    sample_path,
    sha256_file,
)
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.prepare import Shard, load_dataset_rows, load_shards


def content_key(config, captured_ids: list[int], shard: Shard) -> str:
    """A shard's hidden states by content (`eyrie.run.identity.STAGES["extract"]`): what the target computes
    (weights, dtype, output-shaping server arguments), what is captured, which rows, how values are encoded. What
    training keys on: the same hidden states laid out another way train the same drafter."""
    from eyrie.target.metadata import stage_key as keyed

    return keyed(
        "extract",
        config,
        captured=list(captured_ids),
        shard={"fingerprint": shard.fingerprint, "rows": [shard.start, shard.stop]},
    )


def shard_key(content: str, config) -> str:
    """The shard's manifest key: its content key and the storage layout (`STAGES["extract.layout"]`)."""
    from eyrie.target.metadata import stage_key as keyed

    return keyed("extract.layout", config, content=content)


def check_sample(
    data: dict, token_ids: list[int], num_layers: int, hidden_size: int, hidden_states_dtype: str = BFLOAT16
) -> None:
    """Raise ValueError unless `data` is one whole, finite sample for exactly these tokens, stored in
    `hidden_states_dtype`'s encoding (eyrie.hidden_states.encoding)."""
    if set(data) < {"hidden_states", "token_ids"}:
        raise ValueError(f"keys {sorted(data)}; expected hidden_states and token_ids")
    if data["token_ids"].tolist() != token_ids:
        raise ValueError("token ids differ from the prepared sample")
    hs = data["hidden_states"]
    want = (len(token_ids), num_layers, hidden_size)
    if tuple(hs.shape) != want:
        raise ValueError(f"hidden_states shape {tuple(hs.shape)}, expected {want} [T, n_layers, H]")
    check_encoding(data, hidden_states_dtype)  # fp8: its scales, and no NaN (e4m3fn has no infinity)
    if hidden_states_dtype != FP8 and not all_finite(hs):
        raise ValueError("hidden_states hold NaN or infinite values")


def all_finite(t: torch.Tensor) -> bool:
    """Every value finite, in one float32 sum: a NaN or an infinity anywhere makes the sum NaN or infinite, so a
    finite sum proves it (13x cheaper than `isfinite` element by element on bf16, on the cores the server needs); a
    sum that overflows from finite values falls back to the element-wise check."""
    return bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def load_checked(
    path: Path, token_ids: list[int], num_layers: int, hidden_size: int, hidden_states_dtype: str = BFLOAT16
) -> None:
    try:
        data = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for truncated or garbled files
        raise ValueError(f"unreadable: {err}") from None
    check_sample(data, token_ids, num_layers, hidden_size, hidden_states_dtype)


def stat_record(st: os.stat_result) -> dict:
    """What a manifest keeps of a file's stat. Not ctime: backup tools that restore access times change it, and every
    file would be re-hashed after each backup."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def stat_trusted(rec: dict, st: os.stat_result, manifest_mtime_ns: int) -> bool:
    """True when the file's stat is the one its manifest recorded, so its bytes are the ones hashed then.

    The recorded mtime must also be older than the manifest itself: a file rewritten in the same tick of the
    filesystem's clock as its stat was taken keeps that mtime (git's "racily clean" entries), so such a file is
    re-hashed instead. `write_manifest` makes that rare."""
    return rec.get("stat") == stat_record(st) and rec["stat"]["mtime_ns"] < manifest_mtime_ns


def file_record(path: Path, tokens: int) -> dict:
    """One file's manifest entry. The stat is taken before hashing, so a write that lands while it is hashed shows
    as a newer mtime and is re-hashed, not trusted (except a write within the same clock tick as the stat: nothing
    writes a hidden-state file once it is in place, under the run lock)."""
    st = path.stat()
    return {"bytes": st.st_size, "sha256": sha256_file(path), "tokens": tokens, "stat": stat_record(st)}


def checked_record(
    path: Path, token_ids: list[int], num_layers: int, hidden_size: int, hidden_states_dtype: str = BFLOAT16
) -> dict:
    """`load_checked` and `file_record` in one read: the file's bytes are parsed and checked (`check_sample`) and
    hashed from memory (a mapped `load_file` and a second read for the hash cost twice the CPU, on the cores the
    server needs). The stat is taken before the read, as in `file_record`; a rename keeps it."""
    try:
        st = path.stat()
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:  # as load_checked: a file the server never wrote (a full disk) is a bad file
        raise ValueError(f"unreadable: {err}") from None
    if len(data) != st.st_size:
        raise ValueError(f"{len(data)} bytes read, {st.st_size} when it was looked at: it changed meanwhile")
    try:
        tensors = load_bytes(data)
    except Exception as err:  # safetensors raises its own error types for truncated or garbled files
        raise ValueError(f"unreadable: {err}") from None
    check_sample(tensors, token_ids, num_layers, hidden_size, hidden_states_dtype)
    return {
        "bytes": st.st_size,
        "sha256": hashlib.sha256(data).hexdigest(),
        "tokens": len(token_ids),
        "stat": stat_record(st),
    }


def write_manifest(path: Path, manifest: dict, wait_s: float = 2.0) -> None:
    """Write a shard manifest whose own mtime is later than every mtime it records (see `stat_trusted`): on a
    filesystem with a coarse clock, wait for its next tick (milliseconds; 1-2 s on the coarsest) and write again.
    Past `wait_s` (a file stamped in the future by a skewed clock) the newest files are just re-hashed next time."""
    newest = max((r["stat"]["mtime_ns"] for r in manifest["files"].values() if r.get("stat")), default=0)
    deadline, delay = time.monotonic() + wait_s, 0.001
    while True:
        atomic_write_json(path, manifest)
        if path.stat().st_mtime_ns > newest or time.monotonic() >= deadline:
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def shard_complete(manifest_path: Path, key: str, hidden_dir: Path, rehash_changed: bool = True) -> bool:
    """True when the manifest matches `key` and every file it lists is there, of its recorded size and unchanged.

    A file whose stat is the recorded one is trusted without being read, so a cached run reads no hidden-state
    bytes. A file whose stat changed (copied, touched, rewritten, or listed by a manifest that kept no stat) is
    re-hashed against its recorded sha256 when `rehash_changed`, else trusted by its size; one found intact gets its
    new stat recorded, so the next run trusts it again. Bit rot and writes that keep size, mtime and inode are
    caught only by reading everything: `eyrie verify` (eyrie/ops/verify.py)."""
    manifest_mtime = _mtime_ns(manifest_path)  # before reading: a manifest replaced meanwhile only costs re-hashes
    m = read_json(manifest_path)
    if manifest_mtime is None or not m or m.get("key") != key:
        return False
    fresh = {}
    folder = os.fspath(hidden_dir)
    for idx, name in shard_entries(m):  # each sample's file, or the shard's pack (eyrie.hidden_states.packs)
        rec = m["files"][idx]
        p = os.path.join(folder, name)  # a str, not a Path: this loop runs once per sample
        try:
            st = os.stat(p)
        except OSError:
            return False
        if st.st_size != rec["bytes"]:
            return False
        if not rehash_changed or stat_trusted(rec, st, manifest_mtime):
            continue
        if sha256_file(Path(p)) != rec["sha256"]:
            return False
        fresh[idx] = stat_record(st)
    if fresh:
        for idx, s in fresh.items():
            m["files"][idx]["stat"] = s
        write_manifest(manifest_path, m)
    return True


# Threads that check, hash and move the files answered (extract_shard), beside the requests in flight. Two keep
# up with the server (0.3-0.5 ms of CPU a file); eight measured 5-9% slower (benchmarks/extract_throughput.py),
# holding the GIL away from the request loop and the cores away from the server.
FILE_THREADS = 2


def _one_thread() -> None:
    torch.set_num_threads(1)


@contextlib.asynccontextmanager
async def _extractor(client, concurrency: int) -> AsyncIterator[Callable[[list[int], float], Awaitable[str]]]:
    """`client.extract` as a coroutine: ServerClient's own (one aiohttp session), else the client's blocking call
    in a thread per request in flight (test doubles)."""
    if hasattr(client, "async_extractor"):
        async with client.async_extractor(concurrency) as extract:
            yield extract
        return
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eyrie-request") as pool:

        async def extract(ids: list[int], timeout_s: float) -> str:
            return await loop.run_in_executor(pool, client.extract, ids, timeout_s)

        yield extract


class _Window:
    """The requests of every shard this process extracts from one server: one asyncio loop (in a thread of its own),
    one session, at most `concurrency` requests in flight over all those shards, and the file threads.

    Shards extracting at the same time (the flow runs two shard tasks at once) share it, so a shard's last requests
    and its finalisation (fsyncs, manifest) overlap the next shard's requests instead of draining the server's queue
    at every shard boundary, and the server sees `concurrency` requests in flight, not `concurrency` per shard.
    Slots are taken in the order requests were queued: the shard that started first finishes first."""

    def __init__(self, client, concurrency: int):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="eyrie-requests", daemon=True)
        self.thread.start()
        self.files = ThreadPoolExecutor(
            max_workers=min(concurrency, FILE_THREADS), thread_name_prefix="eyrie-files", initializer=_one_thread
        )
        self.users = 0
        self._session = contextlib.AsyncExitStack()

        async def start() -> None:
            self.slots = asyncio.Semaphore(concurrency)
            self.extract = await self._session.enter_async_context(_extractor(client, concurrency))

        try:
            self.run(start())
        except BaseException:
            self.close()
            raise

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the window's loop and wait for it (cancelled if this thread stops waiting)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def close(self) -> None:
        try:
            self.run(self._session.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()
            self.files.shutdown()


_windows: dict[tuple, _Window] = {}
_windows_lock = threading.Lock()


@contextlib.contextmanager
def _shared_window(client, concurrency: int):
    """The window for `client`'s server, opened by its first user and closed by its last. Each shard task builds a
    ServerClient of its own: clients of one URL and API key share a window; any other client (a test double) has
    one of its own."""
    if hasattr(client, "async_extractor"):
        key: tuple = (client.base_url, client.session.headers.get("Authorization"), concurrency)
    else:
        key = (id(client), concurrency)
    with _windows_lock:
        window = _windows.get(key)
        if window is None:
            window = _windows[key] = _Window(client, concurrency)
        window.users += 1
    try:
        yield window
    finally:
        with _windows_lock:
            window.users -= 1
            last = window.users == 0
            if last:
                del _windows[key]
        if last:
            window.close()


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn


_sync_file_range = _libc_sync_file_range()
SYNC_FILE_RANGE_WRITE = 2


def start_writeback(path: str) -> None:
    """Have the kernel start writing the file's data to disk now, without waiting for it (Linux's sync_file_range),
    so that the fsync before the shard's manifest finds it mostly written instead of writing the whole shard then.
    Only a head start: the fsync is the guarantee. A no-op elsewhere."""
    if _sync_file_range is None:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        _sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)  # ctypes leaves the GIL meanwhile
    finally:
        os.close(fd)


def _wait_and_release(path: str) -> None:
    """Wait for the connector's writer (it holds LOCK_EX on `<path>.lock` until the file is whole), then drop it."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
        os.unlink(lock)


def extract_shard(
    client,
    prepare_dir: Path,
    shard: Shard,
    key: str,
    hidden_dir: Path,
    manifest_path: Path,
    num_layers: int,
    hidden_size: int,
    concurrency: int = 8,
    timeout_s: float = 600,
    progress: Callable[[int, int], None] | None = None,
    log=print,
    rehash_changed: bool = True,
    hidden_states_dtype: str = BFLOAT16,
    storage: str = FILES,
) -> dict:
    """Make every sample of `shard` valid on disk and write its manifest; returns the manifest.

    Samples already on disk and valid (from an interrupted attempt) are kept; only missing or bad ones are sent.
    `rehash_changed`: see `shard_complete`. `client` None: the shard must be complete already (no server runs).
    `hidden_states_dtype`: the encoding every file must have (the server's connector writes it); a file in the
    other one is redone. `storage` packed: the checked files are then copied into one pack (eyrie.hidden_states.packs),
    which the
    manifest lists, and removed after it.
    """
    if shard_complete(manifest_path, key, hidden_dir, rehash_changed):
        manifest = read_json(manifest_path) or {}
        if manifest.get("storage") == PACKED:
            drop_unpacked(hidden_dir, shard)
        return manifest
    if client is None:
        raise ExtractionError(
            f"{shard.name}: no complete manifest at {manifest_path} and no server was started for it (the shard was "
            "complete when the run began, so its files changed since): run again"
        )
    fault_point(f"extract.{shard.name}")
    old_mtime = _mtime_ns(manifest_path) or 0
    old = read_json(manifest_path) or {}
    recorded = old.get("files", {}) if old.get("key") == key and old.get("storage", FILES) == FILES else {}
    manifest_path.unlink(missing_ok=True)  # a stale manifest must not vouch for files about to change
    # Readers take a sample from a pack before its file: no pack may keep an older copy of these rows (one written
    # before a kill, before its manifest; one of the other storage, or of another shard plan).
    if removed := remove_overlapping(hidden_dir, shard.start, shard.stop):
        log(f"{shard.name}: removed {removed} pack(s) of its rows that no current manifest vouches for")
    hidden_dir.mkdir(parents=True, exist_ok=True)
    rows = load_dataset_rows(prepare_dir, shard.start, shard.stop)
    todo = []
    known: dict[str, dict] = {}  # records of kept files whose checksum is known: not hashed again for the manifest
    for offset, ids in enumerate(rows):
        idx = shard.start + offset
        p = sample_path(hidden_dir, idx)
        if p.exists():
            try:
                # A file the manifest vouched for must be byte-identical (zeros or flipped bits pass the other
                # checks); a file from an interrupted attempt must be whole, finite and for these tokens.
                rec = recorded.get(str(idx))
                if rec:
                    st = p.stat()
                    if not stat_trusted(rec, st, old_mtime):
                        if sha256_file(p) != rec["sha256"]:
                            raise ValueError("changed since its shard completed (checksum differs)")
                        rec = {**rec, "stat": stat_record(st)}
                load_checked(p, ids, num_layers, hidden_size, hidden_states_dtype)
                if rec:
                    known[str(idx)] = rec
                continue
            except ValueError as err:
                log(f"{shard.name}: redoing sample {idx} ({err})")
                p.unlink()
        todo.append((idx, ids))
    reused = len(rows) - len(todo)
    done = [reused]
    if progress:
        progress(done[0], len(rows))
    t0 = time.perf_counter()

    def disk_full(idx: int, ids: list[int]) -> DiskFullError | None:
        need = len(ids) * num_layers * hidden_size * 4 + (1 << 16)  # float32 at most, plus header room
        free = shutil.disk_usage(hidden_dir).free
        if free >= need:
            return None
        return DiskFullError(
            f"{shard.name}: the disk holding {hidden_dir} is full ({free} bytes free, sample {idx} "
            f"needs about {need}); {done[0]} of {len(rows)} samples of this shard are saved, the "
            "shard is not marked done and earlier shards are intact: free space and run again"
        )

    # Requests and the work on their files are apart, so that a request's slot is free again as soon as the server
    # answers: the requests go through the window shared by the shards extracting at the same time (`_Window`) while
    # the files already answered are checked, hashed and moved in its file threads (the writer's lock, the load and
    # the checksum are off the request path; none is skipped). Their fsyncs come once the shard's requests are done,
    # in one batch (below): an fsync per file among the server's writes cost a journal commit each. Each file's
    # writeback is started as it is moved, so that batch mostly finds its data on disk.
    records: dict[str, dict] = {}  # manifest entries of the files extracted here, hashed as they arrive
    finishing: list[tuple[int, Future]] = []

    def finish(idx: int, ids: list[int], src: str) -> None:
        # Moved and deleted below: only a file in this run's staging folders (eyrie.run.folder.answered_file).
        what = f"{shard.name}: sample {idx}"
        answered_file(src, hidden_dir.parent, hidden_dir, what, written=False)
        _wait_and_release(src)
        answered_file(src, hidden_dir.parent, hidden_dir, what)
        try:
            rec = checked_record(Path(src), ids, num_layers, hidden_size, hidden_states_dtype)
        except ValueError as err:
            Path(src).unlink(missing_ok=True)
            # The server's writer fails silently (it only logs); a full disk is the usual reason for a bad file.
            raise disk_full(idx, ids) or ExtractionError(
                f"{shard.name}: sample {idx}: the server wrote a bad file ({err})"
            ) from None
        dest = sample_path(hidden_dir, idx)
        try:
            os.replace(src, dest)  # same filesystem: the connector writes under the run
        except OSError as err:
            if err.errno == errno.EXDEV:
                raise ExtractionError(
                    f"the server's storage path {src} is on another filesystem than {hidden_dir}"
                ) from None
            raise
        start_writeback(os.fspath(dest))
        records[str(idx)] = rec
        done[0] += 1
        if progress:
            progress(done[0], len(rows))

    async def send_all(window: _Window) -> dict[int, BaseException]:
        failed: dict[int, BaseException] = {}

        async def send(idx: int, ids: list[int]) -> None:
            # Every sample is tried and failures are raised after.
            try:
                async with window.slots:
                    # Before the server spends a forward pass on a file it cannot write.
                    if err := disk_full(idx, ids):
                        raise err
                    src = await window.extract(ids, timeout_s)
                finishing.append((idx, window.files.submit(finish, idx, ids, src)))
            except Exception as err:
                failed[idx] = err

        await asyncio.gather(*(send(idx, ids) for idx, ids in todo))
        return failed

    @contextlib.contextmanager
    def full_disk_explained():
        """A full disk (or quota) as a DiskFullError saying what is saved; any other OSError as it is."""
        try:
            yield
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"{shard.name}: the disk is full ({err}); {done[0]} of {len(rows)} samples are "
                    "saved and the shard is not marked done: free space and run again"
                ) from None
            raise

    with full_disk_explained():
        if todo:
            with _shared_window(client, concurrency) as window:
                try:
                    failed = window.run(send_all(window))
                finally:  # every file answered is checked and moved (or failed) before this shard goes on
                    wait([f for _, f in finishing])
            for idx, f in finishing:
                if (exc := f.exception()) is not None:
                    failed[idx] = exc
            if failed:  # the first failure in row order
                raise failed[min(failed)]
    # The files on disk before the manifest that vouches for them: a power cut must not leave a manifest listing
    # files whose data (or whose names in the folder) never reached the disk.
    with full_disk_explained():
        for idx, _ in todo:
            fsync_path(sample_path(hidden_dir, idx))
        fsync_path(hidden_dir)
    check_shard(hidden_dir, manifest_path, prepare_dir, shard, log=log)  # the capture proof, before the manifest
    files = {}
    if storage == PACKED:
        # Every sample's file is checked (kept ones above, new ones as they arrived) and on disk: copied into one pack
        # that the manifest lists instead. They are removed only once the manifest is written, so a kill before it
        # leaves them to be packed again, and the pack it may leave is removed above.
        name = pack_name(shard.start, shard.stop)
        samples = [(i, sample_path(hidden_dir, i)) for i in range(shard.start, shard.stop)]
        with full_disk_explained():
            pack = write_pack(samples, hidden_dir / name, key)
        tokens_in = sum(len(ids) for ids in rows)
        files[name] = {
            **{k: pack[k] for k in ("bytes", "sha256")},
            "tokens": tokens_in,
            "stat": stat_record(pack["stat"]),
        }
        fault_point(f"extract.{shard.name}.packed")
    else:
        for offset, ids in enumerate(rows):
            name = str(shard.start + offset)
            if name in records:
                files[name] = records[name]
                continue
            p = sample_path(hidden_dir, shard.start + offset)
            rec = known.get(name)
            files[name] = rec if rec and rec["stat"] == stat_record(p.stat()) else file_record(p, len(ids))
    seconds = time.perf_counter() - t0
    tokens = sum(len(ids) for _, ids in todo)
    manifest = {
        "stage": "extract",
        "shard": shard.name,
        "key": key,
        "fingerprint": shard.fingerprint,
        "rows": [shard.start, shard.stop],
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "hidden_states_dtype": hidden_states_dtype,
        "files": files,
        "reused_samples": reused,
        "extracted_samples": len(todo),
        "extracted_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if todo and seconds > 0 else None,
    }
    if storage != FILES:  # absent for files, as the key's
        manifest["storage"] = storage
    with full_disk_explained():  # every sample is saved, and a disk filled since may have no room for the manifest
        write_manifest(manifest_path, manifest)
    if storage == PACKED:
        drop_unpacked(hidden_dir, shard)
    return manifest


def drop_unpacked(hidden_dir: Path, shard: Shard) -> int:
    """Remove the per-sample files of a shard whose pack its manifest vouches for, last first: a kill midway leaves
    a run of leading files, so one stat (of the first) tells whether any are left. Returns how many went."""
    if not sample_path(hidden_dir, shard.start).exists():
        return 0
    n = 0
    for i in reversed(range(shard.start, shard.stop)):
        with contextlib.suppress(FileNotFoundError):
            sample_path(hidden_dir, i).unlink()
            n += 1
    return n


def clean_staging(storage_path: Path) -> int:
    """Remove files the server wrote for requests in flight at a crash (and their lock files)."""
    n = 0
    if storage_path.exists():
        for p in storage_path.iterdir():
            if p.name.endswith((".safetensors", ".lock")):
                p.unlink(missing_ok=True)
                n += 1
    return n


# ---------------------------------------------------------------------------------------------------------------
# The stage's plan: everything the flow needs to know before deciding whether vLLM must start at all


class ExtractionPlan:
    """`node`: this node's name when several nodes share the run folder (its server lives in `extract/nodes/<node>/`);
    None on a single node (`extract/`)."""

    def __init__(self, config, run, report, shards: list[Shard], node: str | None = None):
        from eyrie.run.folder import server_folder
        from eyrie.vllm.spec import ServerSpec

        self.run = run
        self.shards = shards
        self.server_dir = server_folder(run.extract, node)
        self.captured_ids = report.captured_layer_ids
        self.hidden_size = report.hidden_size
        self.hidden_states_dtype = config.extraction.hidden_states_dtype
        self.storage = config.extraction.storage
        self.node = node
        self.online = config.train.hidden_states == "online"
        # What training keys on (content), and what a shard's manifest records (content and layout).
        self.data_keys = {s.name: content_key(config, self.captured_ids, s) for s in shards}
        self.keys = {name: shard_key(k, config) for name, k in self.data_keys.items()}
        self.spec = ServerSpec.for_extraction(config, self.captured_ids, str(self.staging))
        record_context(run.extract, config, report)  # what the capture proof reads (eyrie.hidden_states.check)

    @property
    def staging(self) -> Path:
        if (
            self.online
        ):  # train.hidden_states: online: the trainer reads each file once and deletes it (eyrie.stages.train.online)
            return staging_dir(self.run.root, self.node)
        # Inside the run folder: files are renamed from here into hidden_states, which needs one filesystem.
        return self.server_dir / "staging"

    def select(self, names: list[str]) -> None:
        """Narrow the plan to these shards (a node's share of a fanned-out extraction)."""
        wanted = set(names)
        unknown = sorted(wanted - set(self.keys))
        if unknown:
            raise ExtractionError(f"shards {unknown} are not in {self.run.prepare / 'shards.json'}")
        self.shards = [s for s in self.shards if s.name in wanted]

    def manifest_path(self, shard: Shard) -> Path:
        return self.run.shard_manifests / f"{shard.name}.json"

    def is_complete(self, shard: Shard, rehash_changed: bool = False) -> bool:
        """`shard_complete`; a complete packed shard also loses the per-sample files a kill left after its manifest
        (`drop_unpacked`: one stat when there are none)."""
        done = shard_complete(self.manifest_path(shard), self.keys[shard.name], self.run.hidden_states, rehash_changed)
        if done and self.storage == PACKED:
            drop_unpacked(self.run.hidden_states, shard)
        return done

    def pending(self, rehash_changed: bool = False) -> list[Shard]:
        return [s for s in self.shards if not self.is_complete(s, rehash_changed)]


def online_plan(config, run, report: dict, data_dir: Path):
    """What online training needs from extraction, with nothing extracted: the shard keys extraction would give
    (target identity, captured layers, shard fingerprint: the train key's data keys), the extraction server's spec
    (its storage path on tmpfs, see `ExtractionPlan.staging`) and its folder."""
    return ExtractionPlan(config, run, PreflightReport(**report), load_shards(data_dir))
