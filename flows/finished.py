"""The "nothing to do" fast path of `eyrie run`: a run folder whose last run finished, with nothing changed since,
gets that run's outputs printed, without Prefect's temporary server, Prefect, torch or vLLM (seconds instead of
tens of seconds).

It does not re-derive the stages' keys (that would be a second copy of the flow that could disagree with it). It
proves that nothing any key could read changed at all, a superset of every key's inputs, taken when the run
finished (`record`, each part by its sha256) and compared before the next one (`finished_outputs`):

- the config as loaded (every field) and `--until`;
- every file and folder a config value names (the target folder, the data, prompt files, the promotion folder...),
  each file by path, size, mtime, ctime and inode (a rewrite in place changes mtime and ctime, a replacement the
  inode);
- every file of the run folder (manifests, checkpoints, hidden states, pins, preflight's verdict...), the same way;
- Eyrie's own files (eyrie/, tasks/, flows/), the installed distributions (each site-packages entry's name, which
  carries its version), the Python interpreter, the working directory and the environment variables that reach
  Eyrie's libraries and children (`eyrie.run.environment`'s allow-list).

A config value that names something on the hub, a URL or any other non-local thing (a string with a `/` that is no
existing path) turns the fast path off: a moving revision must be pinned again by the flow. So does a record written
while another run held the folder in between (the run lock names its last holder). When the fast path does not
fire, the flow runs as always; its stages decide, by their keys, what is reused."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RECORD = "finished.json"
_VOLATILE_ENV = frozenset(
    {
        "_",
        "OLDPWD",
        "SHLVL",
        "PS1",
        "PS2",
        "PROMPT_COMMAND",
        "COLUMNS",
        "LINES",
        "TERM_SESSION_ID",
        "PYTEST_CURRENT_TEST",
        "EYRIE_ALWAYS_FLOW",  # whether to take the fast path, not what a run computes
    }
)
_CODE = ("eyrie", "tasks", "flows")


def _stat(path: Path) -> list:
    """A file by size, mtime, ctime and inode, of what it points at (a link: also where it points; a weight file
    linked from elsewhere is rewritten there)."""
    link = [os.readlink(path)] if path.is_symlink() else []
    try:
        st = path.stat()
    except OSError:
        return ["unreadable", *link]
    if path.is_dir():
        return [st.st_mode, *link]  # a folder is what it holds, each entry listed (its mtime moves with a lock file)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_mode, *link]


def _tree(root: Path, skip: frozenset[str] = frozenset()) -> list:
    """`root` and, for a folder, everything under it (links followed), by relative path and stat."""
    out = [[".", *_stat(root)]]
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(dirnames + filenames):
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            if rel in skip or p.suffix == ".pyc":
                continue
            out.append([rel, *_stat(p)])
    return out


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _installed() -> list:
    seen = []
    for entry in sys.path:
        if entry and ("site-packages" in entry or "dist-packages" in entry) and os.path.isdir(entry):
            try:
                seen.append([entry, sorted(os.listdir(entry))])
            except OSError:
                continue
    return seen


def state(config, run_dir: str, until: str) -> dict | None:
    """Everything the run's outputs could depend on (see the module's docstring); None when the fast path cannot
    vouch for it (a value naming something not local)."""
    from eyrie.run.environment import child_environment
    from eyrie.run.lock import LOCK, SHARES_LOCK

    dump = config.model_dump(mode="json")
    paths = {}
    for s in sorted(set(_strings(dump))):
        if os.path.exists(s):
            paths[s] = [str(Path(s).resolve()), _tree(Path(s))]
        elif "/" in s or ":" in s:
            return None  # a hub id, a URL, a path not there yet: the flow decides
    code_root = Path(__file__).resolve().parents[1]
    run = Path(run_dir)
    return {
        "config": dump,
        "until": until,
        "paths": paths,
        "run": _tree(run, skip=frozenset({RECORD, LOCK, SHARES_LOCK})) if run.is_dir() else None,
        "code": {d: _tree(code_root / d) for d in _CODE},
        "installed": _installed(),
        "python": [sys.executable, sys.version],
        "cwd": os.getcwd(),
        # What reaches Eyrie's libraries and its children (the allow-list of eyrie/run/environment.py, secrets
        # left out): a new shell's SSH_CLIENT or DISPLAY changes no output, so it does not turn the fast path off.
        "env": {k: v for k, v in sorted(child_environment().items()) if k not in _VOLATILE_ENV},
    }


def digest(now: dict) -> dict:
    """Each part of a state by its sha256: what the record keeps (a run folder of a million hidden-state files lists
    in a small file, and no environment variable's value, a token say, is written to disk)."""
    from eyrie.run.files import sha256_json

    return {part: sha256_json(value) for part, value in now.items()}


def _lock_holder(run: Path) -> str:
    from eyrie.run.lock import LOCK

    try:
        return (run / LOCK).read_text().strip()
    except OSError:
        return ""


def _me() -> str:
    return f"pid {os.getpid()} on {os.uname().nodename}"


def record(config, run_dir: str, until: str, outputs: dict) -> bool:
    """After a finished flow (in the process that ran it): write the state and the outputs. Not written when
    another process held the run folder since (the lock's holder is someone else) or it is in use now."""
    from eyrie.errors import RunFolderError
    from eyrie.run.files import atomic_write_json
    from eyrie.run.folder import RunFolder

    run = RunFolder(run_dir)
    (run.root / RECORD).unlink(missing_ok=True)
    if _lock_holder(run.root) != _me():
        return False  # someone ran on this folder after our flow released it
    try:
        with run.lock():
            now = state(config, run_dir, until)
            if now is None:
                return False
            atomic_write_json(
                run.root / RECORD, {"state": digest(now), "outputs": json.loads(json.dumps(outputs, default=str))}
            )
    except RunFolderError:
        return False
    return True


def finished_outputs(config, run_dir: str, until: str) -> dict | None:
    """The recorded outputs when nothing changed since the run that finished this folder; else None."""
    from eyrie.errors import RunFolderError
    from eyrie.run.files import read_json
    from eyrie.run.folder import RunFolder

    run = RunFolder(run_dir)
    if not (run.root / RECORD).is_file():
        return None
    try:
        with run.lock():
            try:
                recorded = read_json(run.root / RECORD)
            except (OSError, ValueError):
                return None
            now = state(config, run_dir, until)
            if now is None or not isinstance(recorded, dict) or recorded.get("state") != digest(now):
                return None
            return recorded.get("outputs")
    except RunFolderError:
        return None  # in use: the flow gives the usual message
