"""A shard's manifest: each file's record (checksum, stat), the manifest written after every mtime it records,
and the check that a shard is complete without reading its files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

from eyrie.hidden_states.encoding import BFLOAT16
from eyrie.hidden_states.keyed import header_of, key_in, with_key
from eyrie.hidden_states.packs import shard_entries
from eyrie.run.files import atomic_write_json, read_json, sha256_file
from eyrie.run.folder import sample_path
from eyrie.stages.extract.checks import check_sample
from eyrie.stages.prepare import Shard


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
    path: Path,
    token_ids: list[int],
    num_layers: int,
    hidden_size: int,
    hidden_states_dtype: str = BFLOAT16,
    key: str | None = None,
) -> dict:
    """`load_checked` and `file_record` in one read: the file's bytes are parsed and checked (`check_sample`) and
    hashed from memory (a mapped `load_file` and a second read for the hash cost twice the CPU, on the cores the
    server needs). The stat is taken before the read, as in `file_record`; a rename keeps it.

    `key`: the sample key the file must carry (`eyrie.hidden_states.keyed`). A checked file that does not carry it
    (a connector that records none) is written again from memory with it, the tensors' bytes unchanged, before it
    is hashed; its stat is then the one after that write."""
    try:
        st = path.stat()
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:  # as load_checked: a file the server never wrote (a full disk) is a bad file
        raise ValueError(f"unreadable: {err}") from None
    if len(data) != st.st_size:
        raise ValueError(f"{len(data)} bytes read, {st.st_size} when it was looked at: it changed meanwhile")
    from safetensors.torch import load as load_bytes  # torch: only once a file is read

    try:
        tensors = load_bytes(data)
    except Exception as err:  # safetensors raises its own error types for truncated or garbled files
        raise ValueError(f"unreadable: {err}") from None
    check_sample(tensors, token_ids, num_layers, hidden_size, hidden_states_dtype)
    if key is not None and key_in(header_of(data)[1]) != key:
        data = with_key(data, key)
        with open(path, "wb") as f:  # the server's file in its staging folder, whole: the writer let it go
            f.write(data)
            f.flush()
            st = os.fstat(f.fileno())
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
