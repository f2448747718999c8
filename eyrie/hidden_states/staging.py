"""The online mode's staging folder on tmpfs: where the extraction server writes each request's file for the trainer
to read and delete (eyrie.stages.train.online), and the clean-up of what killed requests leave behind."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from eyrie.run.files import private_dir

TMPFS_ENV = "EYRIE_ONLINE_TMPFS"
DEFAULT_TMPFS = "/dev/shm"  # noqa: S108 - tmpfs, by design: the files live a few milliseconds
TMPFS_TYPES = ("tmpfs", "ramfs")


def staging_dir(run_root: Path, node: str | None = None, tmpfs: str | None = None) -> Path:
    """Where the extraction server writes each request's file in online mode: a folder on tmpfs named after the run
    folder (and node), so two runs on one machine never share it, and the same for every attempt of a run (the
    server's identity holds it). The name is predictable: the server's start makes it this user's alone (mode 0700)
    and refuses one planted there (`eyrie.run.files.private_dir`)."""
    base = Path(tmpfs or os.environ.get(TMPFS_ENV) or DEFAULT_TMPFS)
    tag = hashlib.sha256(f"{Path(run_root).resolve()}|{node or ''}".encode()).hexdigest()[:12]
    return base / f"eyrie-online-{tag}"


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path` (its nearest existing parent), from /proc/mounts."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    best, kind = "", None
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (str(p) == point or str(p).startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def on_tmpfs(path: Path) -> bool:
    return filesystem_type(path) in TMPFS_TYPES


def transient_files(staging: Path) -> list[Path]:
    """The server's files in the staging folder; none when it is missing. A staging folder that is not this user's
    private folder (a symlink or another user's folder planted at its name) is refused, never listed or cleaned
    (`eyrie.run.files.private_dir`)."""
    if not private_dir(staging, create=False):
        return []
    return [p for p in staging.iterdir() if p.name.endswith((".safetensors", ".lock"))]


def leftover_bytes(staging: Path) -> int:
    """Bytes of hidden-state files (and locks) the server wrote that nobody has read and deleted."""
    total = 0
    for p in transient_files(staging):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def clean(staging: Path) -> tuple[int, int]:
    """Remove the files of requests nobody will read (a killed trainer's requests in flight): (files, bytes)."""
    n = size = 0
    for p in transient_files(staging):
        try:
            size += p.stat().st_size
            p.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n, size
