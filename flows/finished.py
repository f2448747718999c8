"""The "nothing to do" fast path of `eyrie run`: a run folder whose last run finished, with nothing changed since,
gets that run's outputs printed, without Prefect's temporary server, Prefect, torch or vLLM (seconds instead of
tens of seconds).

It does not re-derive the stages' keys (that would be a second copy of the flow that could disagree with it). It
proves that nothing any key could read changed at all, a superset of every key's inputs, each part kept by its
sha256 (`record`) and compared before the next run (`finished_outputs`):

- the config as loaded (every field) and `--until`;
- every file and folder a config value names (the target folder, the data, prompt files, the promotion folder...),
  each file by path, size, mtime, ctime and inode (a rewrite in place changes mtime and ctime, a replacement the
  inode); links are followed once (a link loop is walked once), and a folder that is or holds a cache root (HF_HOME,
  VLLM_CACHE_ROOT, ~/.cache...) is not walked: what a cache holds is keyed by what the rest names;
- a hub target or hub dataset (`org/name`, or a bare id such as `squad`) by the commit its revision points at now,
  asked of the hub (or its local cache offline) as the flow pins it: a moved `main` makes the flow run;
- every file of the run folder (manifests, checkpoints, hidden states, pins, preflight's verdict...), the same way;
- Eyrie's own files (eyrie/, tasks/, flows/), the installed distributions (each site-packages metadata entry's name,
  which carries its version), the Python interpreter, the working directory and the environment variables that reach
  Eyrie's libraries and children (`eyrie.run.environment`'s allow-list).

The inputs are taken before the flow starts (`begin`, in `eyrie run` before anything imports torch or vLLM, with the
environment the run's children get: `eyrie.run.environment.started`), and taken again when it returns: an input
that changed while the run went on (data appended after prepare read it, a re-downloaded target, a `git pull`)
means no record, and a line that names it. A path the run itself made (the demo's tiny target, a first promotion
folder) and the promotion folder (the run writes it) are taken at the end, as the run folder is.

The outputs are kept relative to the run folder where they lie in it and printed under the folder's current place:
a moved run folder is reused whole. A record written before (absolute paths) whose folder moved goes through the
flow once, with a line saying so.

A config value that names a URL or a path not there (a string with a `/` that is no existing path) turns the fast
path off; so does a hub revision that cannot be resolved now, and a record written while another run held the folder
in between (the run lock names its last holder). When the fast path does not fire, the flow runs as always; its
stages decide, by their keys, what is reused."""

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


# Variables naming a cache: a config value naming such a folder (or one holding it) is not walked.
_CACHE_ENV = (
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_DATASETS_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "VLLM_CACHE_ROOT",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "XDG_CACHE_HOME",
)
# Config fields whose folder the run writes (an output, taken at the end as the run folder is).
_WRITTEN = (("promotion", "dir"),)
FORMAT = 2  # the outputs under the run folder recorded relative to it


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
    """`root` and, for a folder, everything under it (links followed, each real folder once: a link loop or a
    second link to a folder already walked is listed, not walked again), by relative path and stat."""
    out = [[".", *_stat(root)]]
    if not root.is_dir():
        return out
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            dirnames[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
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


# What says a distribution is installed (its name carries its version) or adds to the import path, in the
# site-packages folders themselves. Not every entry: Python writes site-packages/__pycache__ the first time a run
# imports a top-level module of a fresh install (uv installs no bytecode); nor folders inside them: importing
# setuptools (torch's first compile does) appends site-packages/setuptools/_vendor to sys.path. Either made every
# fresh clone's first run look changed, so its second went through the flow.
DIST_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".pth")


def _installed() -> list:
    seen = []
    for entry in sys.path:
        if entry and Path(entry).name in ("site-packages", "dist-packages") and os.path.isdir(entry):
            try:
                seen.append([entry, sorted(e for e in os.listdir(entry) if e.endswith(DIST_SUFFIXES))])
            except OSError:
                continue
    return seen


def _cache_roots(config, env) -> list[Path]:
    values = [env.get(k) for k in _CACHE_ENV] + [config.extraction.server_env.get(k) for k in _CACHE_ENV]
    roots = [Path(v).expanduser() for v in values if v] + [Path("~/.cache").expanduser()]
    return [r.resolve() for r in roots if r.exists()]


def _holds_a_cache(path: Path, roots: list[Path]) -> bool:
    real = path.resolve()
    return real.is_dir() and any(r == real or real in r.parents for r in roots)


def _hub(config) -> dict | None:
    """A hub target's and hub dataset's commits, resolved now as the flow pins them; None when one cannot be."""
    from eyrie.errors import ConfigError
    from eyrie.target.hub import hub_commit

    pins: dict = {}
    target, data = config.target, config.data
    try:
        if not os.path.exists(target.model):
            from eyrie.target.metadata import is_local_target

            if not is_local_target(target):
                pins["target"] = [target.model, hub_commit(target.model, "model", target.revision)]
        if not os.path.exists(data.source):
            from eyrie.stages.prepare.source import is_hub_source

            if is_hub_source(data):
                commit = hub_commit(data.source, "dataset", data.revision)
                pins["data"] = [data.source, data.subset, data.split, commit]
    except ConfigError:
        return None
    return pins


def _written(config) -> set[str]:
    """The paths of config fields the run writes (`_WRITTEN`)."""
    out = set()
    for section, field in _WRITTEN:
        value = getattr(getattr(config, section, None), field, None)
        if isinstance(value, str):
            out.add(value)
    return out


def begin(config, run_dir: str, until: str) -> dict | None:
    """The inputs (`state` without the run folder) before the flow starts; a path not there yet is recorded as
    missing (the run may make it). None when the fast path cannot vouch for them."""
    return state(config, run_dir, until, run=False, missing_ok=True)


def state(config, run_dir: str, until: str, *, run: bool = True, missing_ok: bool = False) -> dict | None:
    """Everything the run's outputs could depend on (see the module's docstring); None when the fast path cannot
    vouch for it (a value naming something not local and not a hub input, a hub revision that does not resolve)."""
    from eyrie.run.environment import child_environment, run_environment
    from eyrie.run.lock import LOCK, SHARES_LOCK

    env = run_environment()
    hub = _hub(config)
    if hub is None:
        return None
    # A hub input's id and revision (`main`, `refs/pr/1`) are pinned above, not paths.
    hub_values = {
        v
        for k, section, fields in (
            ("target", config.target, ("model", "revision")),
            ("data", config.data, ("source", "revision")),
        )
        if k in hub
        for v in (getattr(section, f) for f in fields)
        if v
    }
    roots = _cache_roots(config, env)
    dump = config.model_dump(mode="json")
    paths: dict = {}
    for s in sorted(set(_strings(dump)) - hub_values):
        if os.path.exists(s):
            p = Path(s)
            paths[s] = [str(p.resolve()), [[".", *_stat(p)], "a cache"] if _holds_a_cache(p, roots) else _tree(p)]
        elif "/" in s or ":" in s:
            if not missing_ok:
                return None  # a URL, a path not there yet: the flow decides
            paths[s] = ["missing"]
    code_root = Path(__file__).resolve().parents[1]
    out = {
        "config": dump,
        "until": until,
        "hub": hub,
        "paths": paths,
        "code": {d: _tree(code_root / d) for d in _CODE},
        "installed": _installed(),
        "python": [sys.executable, sys.version],
        "cwd": os.getcwd(),
        # What reaches Eyrie's libraries and its children (the allow-list of eyrie/run/environment.py, secrets
        # left out), as the run's children get it (its start snapshot): a new shell's SSH_CLIENT or DISPLAY changes
        # no output, so it does not turn the fast path off, nor does what an imported library wrote into this
        # process's own environment.
        "env": {k: v for k, v in sorted(child_environment(environ=env).items()) if k not in _VOLATILE_ENV},
    }
    if run:
        folder = Path(run_dir)
        out["run"] = _tree(folder, skip=frozenset({RECORD, LOCK, SHARES_LOCK})) if folder.is_dir() else None
    return out


def changed_during_run(begun: dict, now: dict, written: set[str] = frozenset()) -> list[str]:
    """The inputs of `begun` (taken before the flow) that `now` (taken after it) no longer matches: a path missing
    at the start (the run made it) and a path the run writes (`written`) are the run's own, not changes."""
    changed = []
    for part, value in begun.items():
        if part == "paths":
            for path, before in value.items():
                if before != ["missing"] and path not in written and now.get("paths", {}).get(path) != before:
                    changed.append(f"{path} (a file or folder the config names)")
        elif part == "code":
            changed += [f"{d}/ (Eyrie's code)" for d in value if now.get("code", {}).get(d) != value[d]]
        elif part != "run" and now.get(part) != value:
            changed.append({"hub": "a hub revision", "installed": "the installed distributions"}.get(part, part))
    return changed


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


def relative_outputs(outputs: dict, root: Path) -> tuple[dict, list[str]]:
    """`outputs` with each path under the run folder `root` made relative to it, and the names of those entries."""
    out, relative = {}, []
    for name, value in json.loads(json.dumps(outputs, default=str)).items():
        if isinstance(value, str) and os.path.isabs(value):
            p = Path(value)
            if p == root or root in p.parents:
                value, relative = p.relative_to(root).as_posix(), [*relative, name]
        out[name] = value
    return out, relative


def placed_outputs(recorded: dict, root: Path) -> dict | None:
    """The recorded outputs under the run folder's current place `root`; None for a record written before they
    were kept relative (absolute paths) whose folder has moved since."""
    outputs = recorded.get("outputs")
    if not isinstance(outputs, dict):
        return None
    if recorded.get("format") != FORMAT:
        old = outputs.get("run_dir")
        if isinstance(old, str) and Path(old) != root:
            print(
                f"eyrie: {root} was finished at {old} (a record of absolute paths, written before run folders "
                "could move): going through the flow once, which reuses every stage by its key"
            )
            return None
        return outputs
    return {k: str(root / v) if k in recorded.get("relative", []) else v for k, v in outputs.items()}


def record(config, run_dir: str, until: str, outputs: dict, begun: dict | None = None) -> bool:
    """After a finished flow (in the process that ran it): write the state and the outputs. Not written when
    another process held the run folder since (the lock's holder is someone else), it is in use now, or an input
    taken before the flow (`begun`, from `begin`) changed while it ran (a line names it)."""
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
            if begun is not None:
                if changed := changed_during_run(begun, now, _written(config)):
                    print(
                        f"eyrie: not recorded as finished: {', '.join(changed)} changed while the run went on; the "
                        "next run goes through the flow, which redoes what the change shapes"
                    )
                    return False
                now = {**begun, **{k: v for k, v in now.items() if k in ("paths", "run")}}
            kept, relative = relative_outputs(outputs, run.root)
            atomic_write_json(
                run.root / RECORD,
                {"format": FORMAT, "state": digest(now), "outputs": kept, "relative": relative},
            )
    except RunFolderError:
        return False
    return True


def forget(run_dir: str) -> None:
    """Remove the folder's record (a run whose inputs the fast path cannot vouch for leaves none behind)."""
    from eyrie.run.folder import RunFolder

    (RunFolder(run_dir).root / RECORD).unlink(missing_ok=True)


def finished_outputs(config, run_dir: str, until: str) -> dict | None:
    """The recorded outputs (under the folder's current place) when nothing changed since the run that finished
    this folder; else None."""
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
            return placed_outputs(recorded, run.root)
    except RunFolderError:
        return None  # in use: the flow gives the usual message
