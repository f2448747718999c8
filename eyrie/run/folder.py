"""The run folder: layout, atomic writes, manifests, fingerprints and the run lock.

Every stage writes into its own folder and closes it with a manifest written last (atomic rename). The manifest on
disk is the truth; Prefect's cache is only the fast path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eyrie import FORMAT_VERSION, __version__
from eyrie.errors import ExtractionError, RunFolderError

STAMP = "eyrie-run.json"
LOCK = ".eyrie.lock"


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename (and fsync the folder, so the rename survives a
    power cut): readers see the old or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any | None:
    """The JSON at `path`, or None when it is missing or unreadable (a manifest that is not whole is no manifest)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sample_name(index: int) -> str:
    """Sample `index`'s hidden-state file name, as speculators' loader expects it."""
    return f"hs_{index}.safetensors"


def sample_path(hidden_dir: Path, index: int) -> Path:
    return hidden_dir / sample_name(index)


def remove_staging(folder: Path, skip: Iterable[Path] = ()) -> int:
    """Delete the temporary files (`.<name>.<random>.tmp`) left by atomic writes in flight at a crash; returns how
    many. Folders in `skip` are not walked: pass those no atomic write targets (`RunFolder.write_once_folders`), so
    a run folder with 200,000 hidden-state files is not listed on every run."""
    skipped = {os.path.abspath(p) for p in skip}
    n = 0
    for parent, dirs, names in os.walk(os.path.abspath(folder)):
        dirs[:] = [d for d in dirs if os.path.join(parent, d) not in skipped]
        for name in names:
            if name.startswith(".") and name.endswith(".tmp"):
                Path(parent, name).unlink(missing_ok=True)
                n += 1
    return n


class RunFolder:
    """Paths of one run's stages. Stage folders are named after the stages."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    def stage(self, name: str) -> Path:
        return self.root / name

    @property
    def prepare(self) -> Path:
        return self.stage("prepare")

    @property
    def extract(self) -> Path:
        return self.stage("extract")

    @property
    def hidden_states(self) -> Path:
        return self.extract / "hidden_states"

    @property
    def shard_manifests(self) -> Path:
        return self.extract / "shards"

    @property
    def write_once_folders(self) -> tuple[Path, ...]:
        """Folders whose files only ever arrive whole, by rename: no atomic write (no temporary file of ours) happens
        in them, so `remove_staging` need not walk them. Hidden states are renamed in from the extraction server's
        staging folder, which `eyrie.stages.extract.clean_staging` cleans."""
        return (self.hidden_states,)

    @property
    def vocab(self) -> Path:
        return self.stage("vocab")

    @property
    def train(self) -> Path:
        return self.stage("train")

    @property
    def export(self) -> Path:
        return self.stage("export")

    @property
    def evaluate(self) -> Path:
        return self.stage("evaluate")

    def manifest(self, stage: str) -> Path:
        return self.stage(stage) / "manifest.json"

    def ensure(self) -> None:
        """Create the folder, or check that an existing one was made by a compatible Eyrie."""
        self.root.mkdir(parents=True, exist_ok=True)
        stamp_path = self.root / STAMP
        stamp = read_json(stamp_path)
        if stamp is None:
            if stamp_path.exists():
                raise RunFolderError(f"{stamp_path} is unreadable: the run folder is damaged; use a new --run-dir")
            atomic_write_json(stamp_path, {"format_version": FORMAT_VERSION, "eyrie_version": __version__})
        elif stamp.get("format_version") != FORMAT_VERSION:
            raise RunFolderError(
                f"run folder {self.root} was made by Eyrie {stamp.get('eyrie_version')} (format "
                f"{stamp.get('format_version')}); this Eyrie {__version__} writes format {FORMAT_VERSION}. Use a new "
                "--run-dir, or run the Eyrie version that made it."
            )

    @contextmanager
    def lock(self, wait_s: float = 0.0) -> Iterator[None]:
        """Hold the run folder's exclusive lock: two runs on one folder would interleave their writes.

        The lock is an flock, so a SIGKILLed holder releases it with its process; there is no stale lock to clean.
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
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        f.flush()
        try:
            yield
        finally:
            f.close()


def replace_dir(src: Path, dst: Path) -> None:
    """Move a finished staging folder into place, replacing an older one."""
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(src, dst)


NODE_ENV = "EYRIE_NODE_NAME"


def node_name(default: str | None = None) -> str | None:
    """This node's name in a run folder shared by several nodes: $EYRIE_NODE_NAME, else `default`."""
    name = os.environ.get(NODE_ENV) or default
    if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name):
        raise ExtractionError(
            f"node name {name!r} (${NODE_ENV} or the host name) must be letters, digits, '.', '_' "
            "or '-': it names the node's folder in the run folder"
        )
    return name


def server_folder(extract_dir: Path, node: str | None) -> Path:
    """Where a node keeps its extraction server's state, log and staging: the stage folder itself on a single node,
    `nodes/<node>/` inside it when nodes share the run folder."""
    return Path(extract_dir) if node is None else Path(extract_dir) / "nodes" / node


def server_folders(extract_dir: Path) -> list[Path]:
    """Every extraction server folder a run may have: the single-node one, then each node's."""
    nodes = Path(extract_dir) / "nodes"
    return [Path(extract_dir)] + (sorted(p for p in nodes.iterdir() if p.is_dir()) if nodes.is_dir() else [])


def serving_server_folders(run_root: Path) -> list[Path]:
    """The folders of the servers that serve target plus drafter, under a run folder: `<stage>/server-*` (export's
    `export/server-trained`, evaluation's `evaluate/server-current` and `evaluate/server-untrained`)."""
    return sorted(p for p in Path(run_root).glob("*/server-*") if p.is_dir())


def run_server_folders(run_root: Path) -> list[Path]:
    """Every server folder under a run folder: extraction's (and each node's), then the serving ones."""
    return server_folders(Path(run_root) / "extract") + serving_server_folders(run_root)
