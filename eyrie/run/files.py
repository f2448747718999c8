"""Files written so that a crash never leaves half of one: atomic writes (a temporary file beside the target,
fsynced, renamed, the folder fsynced), the temporary files' writer locks and their clean-up, fsyncs of whole trees,
JSON read back, content fingerprints, and the path checks (`within`, `private_dir`) every move or delete passes."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eyrie.errors import RunFolderError


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (the names renamed into it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """`fsync_path` on every file under `folder`, then on every folder, deepest first (each folder's names, once its
    files are on disk): for a tree written by a library that does not fsync (`datasets.save_to_disk`) before a
    manifest vouches for it."""
    dirs = []
    for root, _, files in os.walk(folder):
        dirs.append(root)
        for name in files:
            fsync_path(Path(root, name))
    for d in reversed(dirs):
        fsync_path(Path(d))


TMP_SUFFIX = ".eyrie-tmp"  # every temporary file Eyrie's own writers make is `.<name>.<...>.eyrie-tmp`


def _claimed(fd: int, path: str | Path) -> bool:
    """Take the writer's lock on a temporary file just created at `path`, and check that `path` still names it: a
    clean-up (`remove_abandoned`) that raced its creation may have removed it. Held until the file is closed, so no
    clean-up removes a temporary file whose writer is alive."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename (and fsync the folder, so the rename survives a
    power cut): readers see the old or the new, never half. The temporary file is `.<name>.<random>.eyrie-tmp`,
    locked by its writer (see `remove_abandoned`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
        if _claimed(fd, tmp):
            break
        os.close(fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # before the close: the writer's lock is held until the name is gone
        fsync_path(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def temporary_file(tmp: Path) -> Iterator[Any]:
    """Open the writer's temporary file `tmp` (a fixed name ending in TMP_SUFFIX: one writer at a time per name),
    truncated, with the writer's lock held until it is closed; removed if the block raises. Refuses a name another
    live writer holds, and never follows a symlink planted at the name."""
    if not tmp.name.endswith(TMP_SUFFIX):
        raise ValueError(f"{tmp}: a temporary file's name ends in {TMP_SUFFIX}")
    while True:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderError(f"{tmp} is being written by another process: two writers of one file") from None
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass  # a clean-up removed it between the open and the lock: open it again
        os.close(fd)
    os.ftruncate(fd, 0)
    f = os.fdopen(fd, "wb")
    try:
        yield f
    except BaseException:
        tmp.unlink(missing_ok=True)
        f.close()
        raise
    f.close()


def remove_abandoned(path: Path) -> bool:
    """Remove the temporary file `path` if it is one of Eyrie's (`.<...>.eyrie-tmp`, a regular file) and its writer
    is gone (no process holds its lock: a killed writer's lock went with it). True if it was removed."""
    if not (path.name.startswith(".") and path.name.endswith(TMP_SUFFIX)):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone, or a symlink (ELOOP): not a file of ours
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its writer is alive
        try:
            if os.lstat(path).st_ino != st.st_ino:
                return False  # renamed into place, and another file took the name meanwhile
        except FileNotFoundError:
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any | None:
    """The JSON at `path`, or None when it is missing or unreadable (a manifest that is not whole is no manifest)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def replace_dir(src: Path, dst: Path) -> None:
    """Move a finished staging folder into place, replacing an older one."""
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(src, dst)


def within(path: str | Path, folder: str | Path) -> bool:
    """Whether `path` names an entry inside `folder` (at any depth), with `..` and the symlinks of its parent folders
    resolved: the test every path read from a manifest or a server's answer passes before it is moved or deleted."""
    p = Path(os.path.abspath(path))
    if p.name in ("", ".", ".."):
        return False
    parent, root = Path(os.path.realpath(p.parent)), Path(os.path.realpath(folder))
    return parent == root or root in parent.parents


def portable(path: str | Path, folder: str | Path) -> str:
    """`path` as a manifest in `folder` records it: relative to `folder` when it lies in the run folder around it
    (`folder`'s parent; `..` allowed), so the run folder can move; absolute when it lies elsewhere (a promotion
    folder, the target)."""
    p, base = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    if p == base.parent or base.parent in p.parents:
        return Path(os.path.relpath(p, base)).as_posix()
    return str(p)


def located(value: str | None, folder: str | Path) -> str | None:
    """A path a manifest in `folder` recorded (`portable`), under `folder`'s current place; an absolute one (from
    a manifest written before paths were kept relative, or naming something outside the run) as it is."""
    if value is None or os.path.isabs(value):
        return value
    return os.path.normpath(os.path.join(os.path.abspath(folder), value))


def private_dir(path: Path, create: bool = True) -> bool:
    """Make `path` a folder only this user may enter (mode 0700), creating it if missing (`create`); True if it
    exists. Refused (RunFolderError): a symlink or anything but a folder at that name, or a folder of another user's
    (planted at a predictable name in a shared place such as /dev/shm, to read what is written there or to have a
    clean-up delete files elsewhere). One of this user's with a wider mode (an older Eyrie's) is narrowed."""
    path = Path(path)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode) else None
        raise RunFolderError(
            f"{path} is {kind or f'a folder of another user (uid {st.st_uid})'}, where Eyrie keeps files of its own: "
            "it is not used. Remove it (or ask its owner to), or point the run elsewhere (for online training's "
            "tmpfs folder, $EYRIE_ONLINE_TMPFS)"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return True
