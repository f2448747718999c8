"""One shard's extraction: its kept files checked, its missing samples requested, each answered file checked and
moved, then the manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from eyrie.errors import DiskFullError, ExtractionError
from eyrie.hidden_states.check import check_shard
from eyrie.hidden_states.encoding import BFLOAT16
from eyrie.hidden_states.keyed import file_key
from eyrie.hidden_states.packs import FILES, PACKED, pack_name, remove_overlapping, write_pack
from eyrie.run.faults import fault_point
from eyrie.run.files import fsync_path, read_json, sha256_file
from eyrie.run.folder import answered_file, sample_path
from eyrie.stages.extract.answered import _wait_and_release, start_writeback
from eyrie.stages.extract.checks import load_checked
from eyrie.stages.extract.manifest import (
    _mtime_ns,
    checked_record,
    drop_unpacked,
    file_record,
    shard_complete,
    stat_record,
    stat_trusted,
    write_manifest,
)
from eyrie.stages.extract.window import _shared_window, _Window
from eyrie.stages.prepare import Shard, load_dataset_rows


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
    sample_key: str | None = None,
) -> dict:
    """Make every sample of `shard` valid on disk and write its manifest; returns the manifest.

    Samples already on disk and valid (from an interrupted attempt) are kept; only missing or bad ones are sent.
    `rehash_changed`: see `shard_complete`. `client` None: no request is sent, so every sample must be on disk and
    whole already (a kill before the manifest, a switch of storage): the manifest (and pack) is written from them,
    else ExtractionError. `hidden_states_dtype`: the encoding every file must have (the server's connector writes
    it); a file in the other one is redone. `storage` packed: the checked files are then copied into one pack
    (eyrie.hidden_states.packs), which the manifest lists, and removed after it.

    `sample_key`: the key every sample's file is made under (`eyrie.stages.extract.plan.sample_key`: what its values
    are a function of besides its token ids; `key` when not given). Each file written here records it
    (`eyrie.hidden_states.keyed`), and a file an interrupted attempt left is kept only when it records it: one made
    under another key (another target, other layers, another dtype...) or written before files recorded their key
    is redone, with one line per shard saying why. Files an earlier manifest of this shard's `key` vouched for are
    kept by their checksum, as that manifest records the key they were made under.
    """
    made_under = sample_key or key
    if shard_complete(manifest_path, key, hidden_dir, rehash_changed):
        manifest = read_json(manifest_path) or {}
        if manifest.get("storage") == PACKED:
            drop_unpacked(hidden_dir, shard)
        return manifest
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
    stale: dict[str | None, list[int]] = {}  # files on disk made under another key (None: no key), by that key
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
                elif (made := file_key(p)) != made_under:  # vouched for by its name alone: by its key, not here
                    stale.setdefault(made, []).append(idx)
                    p.unlink()
                    todo.append((idx, ids))
                    continue
                load_checked(p, ids, num_layers, hidden_size, hidden_states_dtype)
                if rec:
                    known[str(idx)] = rec
                continue
            except ValueError as err:
                log(f"{shard.name}: redoing sample {idx} ({err})")
                p.unlink()
        todo.append((idx, ids))
    for made, redone in stale.items():
        why = (
            "written before hidden-state files recorded the key they were made under"
            if made is None
            else f"made under another key ({made}; this shard's files are made under {made_under})"
        )
        log(f"{shard.name}: redoing {len(redone)} sample(s) on disk (rows {min(redone)}-{max(redone)}): {why}")
    if todo and client is None:
        if stale:
            raise ExtractionError(
                f"{shard.name}: {sum(map(len, stale.values()))} of {len(rows)} samples in {hidden_dir} were not made "
                f"under this shard's key, and no server was started for it: extract it again"
            )
        raise ExtractionError(
            f"{shard.name}: {len(todo)} of {len(rows)} samples are missing or bad in {hidden_dir} and no server was "
            "started for it (the shard looked whole when the run began, so its files changed since): run again"
        )
    reused = len(rows) - len(todo)
    done = [reused]
    if progress:
        progress(done[0], len(rows))
    t0 = time.perf_counter()
    # Where the shard's time went, for its manifest: the request pass (to the last answer), what the file threads did
    # with the answered files (summed over threads), the tail after the last answer, the fsync batch, the capture
    # check beside it. A throughput shortfall then names its cause (benchmarks/extract_throughput.py prints them).
    phases: dict[str, float] = {}
    phases_lock = threading.Lock()

    def spent(name: str, since: float) -> float:
        now = time.perf_counter()
        with phases_lock:
            phases[name] = phases.get(name, 0.0) + now - since
        return now

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

    def finish(idx: int, ids: list[int], src: str, queued: float) -> None:
        # Moved and deleted below: only a file in this run's staging folders (eyrie.run.folder.answered_file).
        what = f"{shard.name}: sample {idx}"
        answered_file(src, hidden_dir.parent, hidden_dir, what, written=False)
        t = spent("files_queued", queued)
        _wait_and_release(src)
        t = spent("files_writer_wait", t)
        answered_file(src, hidden_dir.parent, hidden_dir, what)
        try:
            rec = checked_record(Path(src), ids, num_layers, hidden_size, hidden_states_dtype, made_under)
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
        spent("files_checked_hashed_moved", t)
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
                    src = await window.extract(ids, timeout_s, made_under)
                finishing.append((idx, window.files.submit(finish, idx, ids, src, time.perf_counter())))
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
                    answered = spent("requests", t0)
                    wait([f for _, f in finishing])
                    spent("files_after_last_answer", answered)
            for idx, f in finishing:
                if (exc := f.exception()) is not None:
                    failed[idx] = exc
            if failed:  # the first failure in row order
                raise failed[min(failed)]
    # The files on disk before the manifest that vouches for them: a power cut must not leave a manifest listing
    # files whose data (or whose names in the folder) never reached the disk.
    # Kept files no manifest vouched for (an interrupted attempt's, or ones a switch of storage repacks) are fsynced
    # too: the attempt that wrote them was killed before its own fsync. Those a manifest vouched for were fsynced
    # before it.
    # The capture proof (`check_shard`, before the manifest) reads a few of the shard's files again, from the page
    # cache: it runs in a thread of its own while the fsyncs wait for the disk, neither needing the other (25 MB
    # files: ~170 ms of CPU each for the proof on 2 cores, benchmarks/extract_client_cost.py). Its verdict comes
    # first: a shard it proves wrong has its files removed, which the fsyncs may then miss.
    with full_disk_explained():  # the check records its figures: a disk filled since may have no room for them

        def checked_shard() -> None:
            t = time.perf_counter()
            check_shard(hidden_dir, manifest_path, prepare_dir, shard, log=log)
            spent("capture_check", t)

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="eyrie-proof") as proof_thread:
            proof = proof_thread.submit(checked_shard)
            synced: BaseException | None = None
            t = time.perf_counter()
            try:
                for offset in range(len(rows)):
                    idx = shard.start + offset
                    if str(idx) not in known:
                        fsync_path(sample_path(hidden_dir, idx))
                fsync_path(hidden_dir)
            except BaseException as err:  # noqa: BLE001 - raised below, after the proof's own verdict
                synced = err
            t = spent("fsync", t)
            proof.result()
            spent("capture_check_after_fsync", t)
            if synced is not None:
                raise synced
    files = {}
    if storage == PACKED:
        # Every sample's file is checked (kept ones above, new ones as they arrived) and on disk: copied into one pack
        # that the manifest lists instead. They are removed only once the manifest is written, so a kill before it
        # leaves them to be packed again, and the pack it may leave is removed above.
        name = pack_name(shard.start, shard.stop)
        samples = [(i, sample_path(hidden_dir, i)) for i in range(shard.start, shard.stop)]
        t = time.perf_counter()
        with full_disk_explained():
            pack = write_pack(samples, hidden_dir / name, key)
        spent("pack", t)
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
        "sample_key": made_under,  # what each sample's file records (eyrie.hidden_states.keyed)
        "files": files,
        "reused_samples": reused,
        "extracted_samples": len(todo),
        "extracted_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if todo and seconds > 0 else None,
        "phases_s": {name: round(v, 3) for name, v in phases.items()},
    }
    if storage != FILES:  # absent for files, as the key's
        manifest["storage"] = storage
    with full_disk_explained():  # every sample is saved, and a disk filled since may have no room for the manifest
        write_manifest(manifest_path, manifest)
    if storage == PACKED:
        drop_unpacked(hidden_dir, shard)
    return manifest
