"""The run folder: layout, atomic writes, manifests, fingerprints and the run lock.

Every stage writes into its own folder and closes it with a manifest written last (atomic rename). The manifest on
disk is the truth; Prefect's cache is only the fast path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eyrie import FORMAT_VERSION, __version__
from eyrie.errors import ExtractionError, RunFolderError
from eyrie.run.lock import CLAIMS as CLAIMS
from eyrie.run.lock import LOCK as LOCK
from eyrie.run.lock import SHARES_LOCK as SHARES_LOCK
from eyrie.run.lock import RunFolderLocks
from eyrie.run.lock import RunLock as RunLock
from eyrie.run.lock import read_text as read_text

STAMP = "eyrie-run.json"


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


def sample_name(index: int) -> str:
    """Sample `index`'s hidden-state file name, as speculators' loader expects it."""
    return f"hs_{index}.safetensors"


def sample_path(hidden_dir: Path, index: int) -> Path:
    return hidden_dir / sample_name(index)


def remove_staging(folder: Path, skip: Iterable[Path] = ()) -> int:
    """Delete the temporary files Eyrie's atomic writes left at a crash (`.<name>.<random>.eyrie-tmp`, whose writer
    no longer holds them: `remove_abandoned`) in the run folder `folder`; returns how many. No other name is touched,
    no symlink followed, and no folder holding a run folder's stamp below `folder` (another run's) walked. Folders in
    `skip` are not walked: pass those no atomic write targets (`RunFolder.write_once_folders`), so a run folder with
    200,000 hidden-state files is not listed on every run."""
    root = os.path.abspath(folder)
    if not os.path.isfile(os.path.join(root, STAMP)):
        raise RunFolderError(f"{root} is not an Eyrie run folder ({STAMP} is missing): its files are not cleaned")
    skipped = {os.path.abspath(p) for p in skip}
    n = 0
    for parent, dirs, names in os.walk(root):
        dirs[:] = [
            d
            for d in dirs
            if os.path.join(parent, d) not in skipped and not os.path.lexists(os.path.join(parent, d, STAMP))
        ]
        for name in names:
            n += remove_abandoned(Path(parent, name))
    return n


def within(path: str | Path, folder: str | Path) -> bool:
    """Whether `path` names an entry inside `folder` (at any depth), with `..` and the symlinks of its parent folders
    resolved: the test every path read from a manifest or a server's answer passes before it is moved or deleted."""
    p = Path(os.path.abspath(path))
    if p.name in ("", ".", ".."):
        return False
    parent, root = Path(os.path.realpath(p.parent)), Path(os.path.realpath(folder))
    return parent == root or root in parent.parents


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


def server_file_name() -> str:
    """A name for one request's hidden-states file, chosen by Eyrie's connector: never the client's request id (nor
    its X-Request-Id, nor a path it asks for), which vLLM would otherwise put in the file's path unchanged."""
    return f"eyrie-{uuid.uuid4().hex}.safetensors"


def answered_file(path: str | Path, staging_root: Path, hidden_dir: Path, what: str, written: bool = True) -> Path:
    """The file a server's answer names (`kv_transfer_params.hidden_states_path`), if the run may read, move and
    delete it: a `*.safetensors` name inside `staging_root` (the stage folder holding the servers' staging folders),
    not in `hidden_dir` (the files already extracted), and, once `written`, a regular file (not a symlink). Else an
    ExtractionError: the answer is not from this run's server, or that server is not Eyrie's."""
    p = Path(path)
    ok = p.name.endswith(".safetensors") and within(p, staging_root) and not within(p, hidden_dir)
    if ok and written:
        try:
            ok = stat.S_ISREG(os.lstat(p).st_mode)
        except OSError:
            ok = False
    if not ok:
        raise ExtractionError(
            f"{what}: the server answered with the file {path}, which is not a hidden-states file in this run's "
            f"staging folders (under {staging_root}): left alone. Is another process serving on the extraction "
            "server's port? Stop it (`eyrie stop-server`) and run again"
        )
    return p


class RunFolder(RunFolderLocks):
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
        """Create the folder, or adopt an existing one: an empty folder, or a run folder a compatible Eyrie made.

        Refused: a folder that holds anything else (a parent of run folders, a checkout: a run cleans and writes
        below its root), one inside another run folder, and a run folder holding another one."""
        for parent in self.root.parents:
            if (parent / STAMP).exists():
                raise RunFolderError(
                    f"{self.root} is inside the run folder {parent}: a run folder holds one run. Pass a --run-dir "
                    "outside it (e.g. a sibling folder)"
                )
        self.root.mkdir(parents=True, exist_ok=True)
        stamp_path = self.root / STAMP
        stamp = read_json(stamp_path)
        if stamp is None:
            if stamp_path.exists():
                raise RunFolderError(f"{stamp_path} is unreadable: the run folder is damaged; use a new --run-dir")
            # The lock file, and the temporary file of a stamp another process is writing now, are a new run's own.
            foreign = []
            for entry in os.scandir(self.root):
                if entry.name not in (LOCK, SHARES_LOCK) and not entry.name.startswith(f".{STAMP}."):
                    foreign.append(entry.name)
                    if len(foreign) == 3:
                        break
            if foreign:
                raise RunFolderError(
                    f"{self.root} is not empty and is not an Eyrie run folder (it holds {', '.join(sorted(foreign))}"
                    f"{', ...' if len(foreign) == 3 else ''}; no {STAMP}): Eyrie adopts only an empty folder or one "
                    "it made, because a run cleans and writes below its root. Pass a new --run-dir (e.g. "
                    "runs/<name>)"
                )
            atomic_write_json(stamp_path, {"format_version": FORMAT_VERSION, "eyrie_version": __version__})
        elif stamp.get("format_version") != FORMAT_VERSION:
            raise RunFolderError(
                f"run folder {self.root} was made by Eyrie {stamp.get('eyrie_version')} (format "
                f"{stamp.get('format_version')}); this Eyrie {__version__} writes format {FORMAT_VERSION}. Use a new "
                "--run-dir, or run the Eyrie version that made it."
            )
        else:
            nested = sorted(e.name for e in os.scandir(self.root) if os.path.lexists(os.path.join(e.path, STAMP)))
            if nested:
                raise RunFolderError(
                    f"run folder {self.root} holds other run folders ({', '.join(nested)}): move them out of it "
                    "first, so that cleaning this run cannot touch theirs"
                )


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
