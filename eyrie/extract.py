"""extract: one shard's hidden states through the vLLM extraction server, each file validated, then a manifest.

Files follow speculators' format (`hs_<i>.safetensors` with `hidden_states` [T, n_layers, H] and `token_ids` [T],
i the row index in the prepared dataset), all in one folder, so speculators' own loader reads them. The shard's
manifest, written last and atomically, records every file's checksum: it is the proof the shard is complete. It also
records each file's stat (size, mtime_ns, inode), so a later run trusts an unchanged file without reading it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyrie import FORMAT_VERSION
from eyrie.errors import DiskFullError, ExtractionError
from eyrie.faults import fault_point
from eyrie.prepare import Shard, load_dataset_rows
from eyrie.store import (
    atomic_write_json,
    fsync_path,
    read_json,
    sample_name,
    sample_path,
    sha256_file,
    sha256_json,
)
from eyrie.target import target_identity


def shard_key(target_id: str, captured_ids: list[int], shard: Shard) -> str:
    """The identity of a shard's output: what it ran on, what it captured, what it read."""
    return sha256_json(
        {
            "target": target_id,
            "layers": captured_ids,
            "shard": shard.fingerprint,
            "rows": [shard.start, shard.stop],
            "format": FORMAT_VERSION,
        }
    )[:16]


def check_sample(data: dict, token_ids: list[int], num_layers: int, hidden_size: int) -> None:
    """Raise ValueError unless `data` is one whole, finite sample for exactly these tokens."""
    if set(data) < {"hidden_states", "token_ids"}:
        raise ValueError(f"keys {sorted(data)}; expected hidden_states and token_ids")
    if data["token_ids"].tolist() != token_ids:
        raise ValueError("token ids differ from the prepared sample")
    hs = data["hidden_states"]
    want = (len(token_ids), num_layers, hidden_size)
    if tuple(hs.shape) != want:
        raise ValueError(f"hidden_states shape {tuple(hs.shape)}, expected {want} [T, n_layers, H]")
    if not bool(torch.isfinite(hs).all()):
        raise ValueError("hidden_states hold NaN or infinite values")


def load_checked(path: Path, token_ids: list[int], num_layers: int, hidden_size: int) -> None:
    try:
        data = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for truncated or garbled files
        raise ValueError(f"unreadable: {err}") from None
    check_sample(data, token_ids, num_layers, hidden_size)


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
    caught only by reading everything: `eyrie verify` (eyrie/verify.py)."""
    manifest_mtime = _mtime_ns(manifest_path)  # before reading: a manifest replaced meanwhile only costs re-hashes
    m = read_json(manifest_path)
    if manifest_mtime is None or not m or m.get("key") != key:
        return False
    fresh = {}
    folder = os.fspath(hidden_dir)
    for idx, rec in m["files"].items():
        p = os.path.join(folder, sample_name(int(idx)))  # a str, not a Path: this loop runs once per sample
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
) -> dict:
    """Make every sample of `shard` valid on disk and write its manifest; returns the manifest.

    Samples already on disk and valid (from an interrupted attempt) are kept; only missing or bad ones are sent.
    `rehash_changed`: see `shard_complete`. `client` None: the shard must be complete already (no server runs).
    """
    if shard_complete(manifest_path, key, hidden_dir, rehash_changed):
        return read_json(manifest_path) or {}
    if client is None:
        raise ExtractionError(
            f"{shard.name}: no complete manifest at {manifest_path} and no server was started for it (the shard was "
            "complete when the run began, so its files changed since): run again"
        )
    fault_point(f"extract.{shard.name}")
    old_mtime = _mtime_ns(manifest_path) or 0
    old = read_json(manifest_path) or {}
    recorded = old.get("files", {}) if old.get("key") == key else {}
    manifest_path.unlink(missing_ok=True)  # a stale manifest must not vouch for files about to change
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
                load_checked(p, ids, num_layers, hidden_size)
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

    def one(item: tuple[int, list[int]]) -> None:
        idx, ids = item
        if err := disk_full(idx, ids):  # before the server spends a forward pass on a file it cannot write
            raise err
        src = client.extract(ids, timeout_s)
        _wait_and_release(src)
        try:
            load_checked(Path(src), ids, num_layers, hidden_size)
        except ValueError as err:
            Path(src).unlink(missing_ok=True)
            # The server's writer fails silently (it only logs); a full disk is the usual reason for a bad file.
            raise disk_full(idx, ids) or ExtractionError(
                f"{shard.name}: sample {idx}: the server wrote a bad file ({err})"
            ) from None
        try:
            os.replace(src, sample_path(hidden_dir, idx))  # same filesystem: the connector writes under the run
        except OSError as err:
            if err.errno == errno.EXDEV:
                raise ExtractionError(
                    f"the server's storage path {src} is on another filesystem than {hidden_dir}"
                ) from None
            raise
        done[0] += 1
        if progress:
            progress(done[0], len(rows))

    try:
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"eyrie-{shard.name}") as pool:
            list(pool.map(one, todo))
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                f"{shard.name}: the disk is full ({err}); {done[0]} of {len(rows)} samples are "
                "saved and the shard is not marked done: free space and run again"
            ) from None
        raise
    # The files on disk before the manifest that vouches for them: a power cut must not leave a manifest listing
    # files whose data (or whose names in the folder) never reached the disk.
    for idx, _ in todo:
        fsync_path(sample_path(hidden_dir, idx))
    fsync_path(hidden_dir)
    files = {}
    for offset, ids in enumerate(rows):
        name = str(shard.start + offset)
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
        "files": files,
        "reused_samples": reused,
        "extracted_samples": len(todo),
        "extracted_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if todo and seconds > 0 else None,
    }
    write_manifest(manifest_path, manifest)
    return manifest


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
        from eyrie.server import ServerSpec, server_folder

        self.run = run
        self.shards = shards
        self.server_dir = server_folder(run.extract, node)
        self.captured_ids = report.captured_layer_ids
        self.hidden_size = report.hidden_size
        tid = target_identity(config.target)
        self.keys = {s.name: shard_key(tid, self.captured_ids, s) for s in shards}
        self.spec = ServerSpec.from_config(config, layer_ids=self.captured_ids, storage_path=str(self.staging))

    @property
    def staging(self) -> Path:
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
        return shard_complete(self.manifest_path(shard), self.keys[shard.name], self.run.hidden_states, rehash_changed)

    def pending(self, rehash_changed: bool = False) -> list[Shard]:
        return [s for s in self.shards if not self.is_complete(s, rehash_changed)]
