"""The files the server's connector writes: waiting for its writer, starting their writeback, cleaning what a
crash left in staging.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
from collections.abc import Callable
from pathlib import Path


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


def clean_staging(storage_path: Path) -> int:
    """Remove files the server wrote for requests in flight at a crash (and their lock files)."""
    n = 0
    if storage_path.exists():
        for p in storage_path.iterdir():
            if p.name.endswith((".safetensors", ".lock")):
                p.unlink(missing_ok=True)
                n += 1
    return n
