"""The run folder's layout: its stamp and the folder it adopts, the stages' folders, the hidden-state file names, the
servers' folders (per node), the files a server's answer may name, and the clean-up of interrupted writes.

Every stage writes into its own folder and closes it with a manifest written last (atomic rename,
`eyrie.run.files`). The manifest on disk is the truth; Prefect's cache is only the fast path. The run lock and the
share locks are `eyrie.run.lock`'s (mixed into `RunFolder`).

Whatever holds a run folder (the pipeline, an extraction, a fan-out node's share) is a run: while it holds the
folder, its children (vLLM servers, the trainer) get the environment as it was when it took it
(`eyrie.run.environment.started`). Every flow a deployment runs takes its folder's lock or its share's first thing,
before anything imports torch or vLLM, whose imports write into the process's environment.
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from eyrie import FORMAT_VERSION, __version__
from eyrie.errors import ExtractionError, RunFolderError
from eyrie.run.environment import started
from eyrie.run.files import atomic_write_json, read_json, remove_abandoned, within
from eyrie.run.lock import LOCK, SHARES_LOCK, RunFolderLocks, RunLock

STAMP = "eyrie-run.json"


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

    @contextmanager
    def lock(self, wait_s: float = 0.0) -> Iterator[RunLock]:
        """`RunFolderLocks.lock`, the children of the code inside getting the environment of this moment (or of an
        enclosing run's start: `started`)."""
        with started(), super().lock(wait_s) as held:
            yield held

    @contextmanager
    def share_lock(self, stage: str, shards: list[str], node: str | None, holder: str) -> Iterator[None]:
        """`RunFolderLocks.share_lock`, under the environment of this moment, as `lock`."""
        with started(), super().share_lock(stage, shards, node, holder):
            yield

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
        staging folder, which `eyrie.stages.extract.answered.clean_staging` cleans."""
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

    @property
    def fingerprints(self) -> Path:
        """The costly fingerprints (the data source's, the tokenizer's) remembered under what determines them."""
        return self.root / "fingerprints.json"

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
