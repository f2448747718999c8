"""The run folder's locks: the run lock, held exclusively by a run of the whole folder, and the shares lock and
claims that fan-out node shares hold (mixed into `eyrie.run.folder.RunFolder`).
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyrie.errors import RunFolderError

LOCK = ".eyrie.lock"
SHARES_LOCK = ".eyrie.shares"  # held shared by fan-out node shares, exclusively by a run of the whole folder
CLAIMS = ".claims"  # <run>/<stage>/.claims/<shard or node.NAME>: what one node share writes, locked by it


class RunFolderLocks:
    """`RunFolder`'s locks (its `root` and `stage`)."""

    root: Path

    if TYPE_CHECKING:

        def stage(self, name: str) -> Path: ...

    @contextmanager
    def lock(self, wait_s: float = 0.0) -> Iterator[RunLock]:
        """Hold the run folder's exclusive lock: two runs on one folder would interleave their writes. It also holds
        the shares lock exclusively, so no fan-out node writes beside this run (refused while a node's share, whose
        parent may be dead, still writes: `share_lock`). A fan-out parent lets its own nodes in with
        `RunLock.admit_shares()` once it has opened the run.

        Both are flocks, so a SIGKILLed holder releases them with its process; there is no stale lock to clean.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        f = open(self.root / LOCK, "a+")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    f.seek(0)
                    holder = f.read().strip() or "another process"
                    f.close()
                    raise RunFolderError(
                        f"run folder {self.root} is in use by {holder}: wait for that run to finish, or pass a "
                        "different --run-dir"
                    ) from None
                time.sleep(0.5)
        shares = open(self.root / SHARES_LOCK, "a+")
        try:
            fcntl.flock(shares, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            shares.close()
            f.close()
            held = self.held_claims()
            raise RunFolderError(
                f"run folder {self.root} has fan-out node shares still writing "
                f"({'; '.join(held[:5]) or 'their holders are not named'}): their parent run is gone, but they "
                "hold their shards. Wait for them to finish (or cancel those node flow runs), then run again"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        f.flush()
        try:
            yield RunLock(shares)
        finally:
            shares.close()
            f.close()

    def claims(self, stage: str) -> Path:
        """Where a stage's node shares lock what they write: one file per shard, and one per node (its server
        folder)."""
        return self.stage(stage) / CLAIMS

    def held_claims(self) -> list[str]:
        """'<stage> <name>: <holder>' for every claim a live process holds now (a claim whose holder died is free)."""
        out = []
        for path in sorted(self.root.glob(f"*/{CLAIMS}/*")):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                holder = os.pread(fd, 500, 0).decode(errors="replace").strip() or "a live process"
                out.append(f"{path.parent.parent.name} {path.name}: {holder}")
            finally:
                os.close(fd)
        return out

    @contextmanager
    def share_lock(self, stage: str, shards: list[str], node: str | None, holder: str) -> Iterator[None]:
        """Hold what one fan-out node's share writes in `stage`: the shares lock shared (no run of the whole folder
        starts beside it, nor is one running: `lock`), and each of `shards` and the node's server folder
        exclusively (no other share writes them). `holder` names the share in the refusals others get. Refused
        (RunFolderError) when any of them is held; nothing is written then."""
        for name in [*shards, *([node] if node else [])]:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", name):
                raise RunFolderError(f"{name!r}: a shard or node name is letters, digits, '.', '_' or '-'")
        held: list[Any] = []
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shares = open(self.root / SHARES_LOCK, "a+")
            held.append(shares)
            try:
                fcntl.flock(shares, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = (read_text(self.root / LOCK) or "another run").strip()
                raise RunFolderError(
                    f"run folder {self.root} is held by a run of the whole folder ({owner}) that has not admitted "
                    f"node shares: {holder} does not write beside it. Run node shares from their fan-out "
                    "(eyrie-extract-fanout), or wait for that run to finish"
                ) from None
            folder = self.claims(stage)
            folder.mkdir(parents=True, exist_ok=True)
            for name in [*([f"node.{node}"] if node else []), *shards]:
                fd = os.open(folder / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                claim = os.fdopen(fd, "r+")
                held.append(claim)
                try:
                    fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    other = os.pread(fd, 500, 0).decode(errors="replace").strip() or "another process"
                    what = f"node {node}'s server folder" if name == f"node.{node}" else f"{stage} shard {name}"
                    raise RunFolderError(
                        f"{what} in {self.root} is held by {other}: {holder} does not write it beside that. Wait "
                        "for it to finish, or send this share elsewhere"
                    ) from None
                claim.truncate(0)
                claim.write(f"{holder}, pid {os.getpid()} on {os.uname().nodename}\n")
                claim.flush()
            yield
        finally:
            for f in reversed(held):
                f.close()


class RunLock:
    """The run folder's lock, held (`RunFolder.lock`)."""

    def __init__(self, shares):
        self._shares = shares

    def admit_shares(self) -> None:
        """Let fan-out node shares take their locks (`RunFolder.share_lock`): the holder is their parent. The run
        folder's lock stays held, so no other run starts; a share that outlives its parent keeps every later run
        out until it ends."""
        fcntl.flock(self._shares, fcntl.LOCK_UN)


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None
