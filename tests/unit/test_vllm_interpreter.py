"""The interpreter that runs vLLM servers (`EYRIE_VLLM_PYTHON`, eyrie/run/vllm_python.py): unset, this one (one
environment, the demo's); set, another environment's, which runs the servers and answers preflight's and export's
questions through a probe process while the flow never imports vLLM.

The other environment is a wrapper script at another path that runs this venv's Python (`wrapper`; preflight and
export through it, with the flow's vLLM import blocked: tests/integration/test_two_environments.py). Each refusal is
checked on a real interpreter where one can show it (a missing path, a fresh venv without vLLM), on fake metadata
where it is pure logic (an unsupported version)."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest
from vllm_environments import wrapper

from eyrie.run import vllm_python
from eyrie.run.vllm_python import (
    SUPPORTED_VLLM,
    VLLM_PYTHON_ENV,
    check_vllm_environment,
    is_flow_interpreter,
    one_environment,
)
from eyrie.vllm.spec import ServerSpec

REPO = Path(__file__).resolve().parents[2]
ENVIRONMENT_OF = vllm_python._environment_of  # kept per interpreter in each process (an lru_cache)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("EYRIE_DIGEST_STORE", str(tmp_path / "store"))
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    ENVIRONMENT_OF.cache_clear()
    yield
    ENVIRONMENT_OF.cache_clear()


def _spec() -> ServerSpec:
    return ServerSpec(model="m", drafter="d")


def test_unset_runs_vllm_with_this_interpreter():
    assert vllm_python.vllm_python() == sys.executable and one_environment()
    assert _spec().command(1)[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert check_vllm_environment() == []  # the test venv: vLLM 0.32.0 (CPU build) with Eyrie's plugin
    assert vllm_python.vllm_version() == vllm_python.vllm_environment()["vllm"] is not None


def test_setting_names_the_servers_interpreter(monkeypatch, tmp_path):
    script = wrapper(tmp_path)
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(script))
    assert not one_environment()
    assert _spec().command(1)[0] == str(script)
    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)  # this interpreter named explicitly: one environment
    assert one_environment()
    # a venv's python3 beside its python (a link to the same file, in the same folder) is the same environment
    link = Path(sys.executable).with_name("python3")
    if link.exists():
        assert is_flow_interpreter(str(link))


def test_missing_interpreter_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    [failure] = check_vllm_environment()
    assert VLLM_PYTHON_ENV in failure and "does not exist" in failure and "unset it" in failure
    not_executable = tmp_path / "python"
    not_executable.write_text("")
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(not_executable))
    [failure] = check_vllm_environment()
    assert "not an executable file" in failure


def test_environment_without_vllm_refused(monkeypatch, tmp_path):
    """A real environment without vLLM or Eyrie: a fresh venv (no pip, no packages)."""
    venv.create(tmp_path / "env", with_pip=False, symlinks=True)
    python = tmp_path / "env" / "bin" / "python"
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(python))
    monkeypatch.chdir(tmp_path)  # no checkout of Eyrie in the working folder either
    failures = check_vllm_environment()
    assert len(failures) == 2, failures
    assert "has no vLLM" in failures[0] and SUPPORTED_VLLM in failures[0]
    assert "does not register Eyrie's vLLM plugin" in failures[1] and "pip install --no-deps" in failures[1]
    assert str(python) in failures[1]


def _facts(**kw) -> dict:
    return {
        "python": "/opt/vllm/bin/python",
        "vllm": "0.32.0",
        "vllm_distribution": "vllm",
        "cpu_build": False,
        "plugin": "eyrie = eyrie.vllm.plugin:register",
        "eyrie": "/opt/vllm/lib/site-packages/eyrie",
        "eyrie_source": vllm_python.flow_eyrie_source(),
        **kw,
    }


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "0.34.0rc1", "1.0.0", "not-a-version"])
def test_unsupported_vllm_version_refused_naming_the_supported_ones(monkeypatch, version):
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/opt/vllm/bin/python")
    monkeypatch.setattr(vllm_python, "_environment_of", lambda python: _facts(vllm=version))
    [failure] = check_vllm_environment()
    assert f"vLLM {version}" in failure and SUPPORTED_VLLM in failure and "0.26" in failure and "0.32" in failure


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1.dev4+g1234"])
def test_supported_vllm_versions_pass(monkeypatch, version):
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/opt/vllm/bin/python")
    monkeypatch.setattr(vllm_python, "_environment_of", lambda python: _facts(vllm=version))
    assert check_vllm_environment() == []


def test_plugin_missing_or_another_eyrie_refused(monkeypatch):
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/opt/vllm/bin/python")
    monkeypatch.setattr(vllm_python, "_environment_of", lambda python: _facts(plugin=None))
    [failure] = check_vllm_environment()
    assert "does not register Eyrie's vLLM plugin" in failure and "/opt/vllm/bin/python -m pip install" in failure
    monkeypatch.setattr(vllm_python, "_environment_of", lambda python: _facts(eyrie_source="0" * 16))
    [failure] = check_vllm_environment()
    assert "another Eyrie than this flow's" in failure and "--no-deps" in failure


def test_facts_kept_per_interpreter_until_a_file_changes(monkeypatch, tmp_path):
    script = wrapper(tmp_path)
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(script))
    first = vllm_python.vllm_environment()
    assert first["vllm"] and first["plugin"] and first["libraries"]["torch"]
    assert first["eyrie_source"] == vllm_python.flow_eyrie_source.__wrapped__()  # this checkout, read now
    ENVIRONMENT_OF.cache_clear()  # another process: read from the store, no process started

    def no_process(*a, **k):
        raise AssertionError("the kept facts should have been reused")

    monkeypatch.setattr(subprocess, "run", no_process)
    assert vllm_python.vllm_environment() == first
    monkeypatch.undo()
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(script))
    monkeypatch.setenv("EYRIE_DIGEST_STORE", str(tmp_path / "store"))
    ENVIRONMENT_OF.cache_clear()
    script.write_text(script.read_text() + "# changed\n")  # the interpreter changed: read again
    calls = []
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert vllm_python.vllm_environment()["vllm"] == first["vllm"] and len(calls) == 1
