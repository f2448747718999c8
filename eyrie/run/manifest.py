"""What "done" means, once, for every stage.

A stage closes its folder with a manifest written last (atomically): the key of what the output was made from, and
every file the stage made, by its path relative to the manifest's folder, with its size and sha256. A stage is done
when its manifest records the key asked for and every file it lists is there with its recorded size; `hashes=True`
also reads each file and compares its sha256 (what `eyrie verify` does on a schedule). The stages call `done` before
working, the Prefect cache policy (`tasks.caching`) before trusting a cached result, and `eyrie status` and
`eyrie verify` read the same lists.

Extraction's per-shard manifests list their files the same way ({"bytes", "sha256"} per file), with a faster
check on top for 200,000 files: a file whose stat matches the recorded one is trusted unread
(`eyrie.stages.extract.shard_complete`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from eyrie.run.files import read_json, sha256_file


def file_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def list_files(folder: Path, paths: Iterable[Path]) -> dict[str, dict]:
    """The manifest's `files`: each path (under `folder`) by its name relative to `folder`."""
    return {p.relative_to(folder).as_posix(): file_record(p) for p in sorted(paths)}


def files_under(folder: Path) -> list[Path]:
    """Every regular file below `folder` (a saved dataset, a drafter), for `list_files`."""
    return sorted(p for p in folder.rglob("*") if p.is_file())


def listed(folder: Path, manifest: dict) -> list[tuple[Path, int | None, str]]:
    """(path, recorded size, sha256) of every file the manifest in `folder` lists. A record that is not
    `{"bytes", "sha256"}` (a run folder of an older format, refused by `RunFolder.ensure`) lists a size of -1, so
    the file never counts as whole."""
    out: list[tuple[Path, int | None, str]] = []
    for name, rec in sorted((manifest.get("files") or {}).items()):
        if isinstance(rec, dict):
            out.append((folder / name, rec.get("bytes"), rec["sha256"]))
        else:
            out.append((folder / name, -1, ""))
    return out


def file_problem(path: Path, size: int | None, digest: str | None = None) -> str | None:
    """What is wrong with one listed file short of its content (missing, another size), or with `digest` its
    content too; None when it is as recorded."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return f"cannot stat it ({err.strerror})"
    if size is not None and st.st_size != size:
        return f"{st.st_size} bytes, its manifest records {size}"
    if digest is not None:
        try:
            if sha256_file(path) != digest:
                return "content differs from its manifest (sha256)"
        except OSError as err:
            return f"unreadable ({err.strerror})"
    return None


def problems(folder: Path, manifest: dict, hashes: bool = False) -> list[str]:
    """`<file> <what is wrong>` for each listed file that is not as its manifest records."""
    return [
        f"{path.relative_to(folder).as_posix()} {problem}"
        for path, size, digest in listed(folder, manifest)
        if (problem := file_problem(path, size, digest if hashes else None))
    ]


def finished_manifest(manifest_path: Path, key: str | None, hashes: bool = False) -> dict | None:
    """The manifest at `manifest_path` if it records `key` (any key with None) and every file it lists is whole;
    otherwise None: the stage has work to do."""
    manifest = read_json(manifest_path)
    if not isinstance(manifest, dict) or (key is not None and manifest.get("key") != key):
        return None
    return None if problems(manifest_path.parent, manifest, hashes) else manifest
