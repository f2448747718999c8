"""Preflight's advice on the load: a checkpoint on a network filesystem with no loading strategy, a compile cache
that a restart cannot reuse, and a Python that compiles vLLM again at every start, are warnings naming the fix;
the same settings on local disk say nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from eyrie.vllm import loading


@pytest.fixture
def on_nfs(monkeypatch, tmp_path):
    """Paths under tmp_path/nfs read as an NFS mount, the rest as local ext4."""
    nfs = tmp_path / "nfs"
    (nfs / "kimi").mkdir(parents=True)
    monkeypatch.setattr(loading, "filesystem_type", lambda p: "nfs4" if str(Path(p)).startswith(str(nfs)) else "ext4")
    return nfs


def test_weights_on_nfs_with_no_loading_strategy_are_a_warning_naming_prefetch(on_nfs, tmp_path):
    (warning,) = loading.load_warnings(str(on_nfs / "kimi"), [], True, {}, env={})
    assert "nfs4 filesystem" in warning and "--safetensors-load-strategy=prefetch" in warning
    for args in (["--safetensors-load-strategy=prefetch"], ["--load-format", "runai_streamer"]):
        assert loading.load_warnings(str(on_nfs / "kimi"), args, True, {}, env={}) == []
    local = tmp_path / "local"
    local.mkdir()
    assert loading.load_warnings(str(local), [], True, {}, env={}) == []


def test_a_compile_cache_on_nfs_is_a_warning_only_when_the_model_is_compiled(on_nfs, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    env = {"VLLM_CACHE_ROOT": str(on_nfs / "vllm-cache")}
    (warning,) = loading.load_warnings(str(local), [], False, {}, env=env)
    assert "compile cache" in warning and "VLLM_CACHE_ROOT" in warning
    assert loading.load_warnings(str(local), [], True, {}, env=env) == []  # eager: nothing is compiled
    # The server's own environment (extraction.server_env) wins over the worker's.
    assert loading.load_warnings(str(local), [], False, {"VLLM_CACHE_ROOT": str(local / "c")}, env=env) == []
    assert loading.compile_cache_root({"XDG_CACHE_HOME": "/x"}) == Path("/x/vllm")


def test_a_server_that_would_compile_vllm_at_every_start_is_warned_of(tmp_path, monkeypatch):
    """PYTHONDONTWRITEBYTECODE set and no bytecode installed: each vLLM process compiles vLLM again; a package with
    its bytecode, or Python free to write it, is not warned of."""
    package = tmp_path / "fakevllm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    (warning,) = loading.bytecode_warnings({"PYTHONDONTWRITEBYTECODE": "1"}, "fakevllm")
    assert "compiles its modules again" in warning and "--compile-bytecode" in warning
    assert (
        loading.bytecode_warnings({}, "fakevllm")
        == []
        == loading.bytecode_warnings({"PYTHONDONTWRITEBYTECODE": ""}, "fakevllm")
    )
    import py_compile

    py_compile.compile(str(package / "__init__.py"))  # what an install with bytecode leaves
    assert loading.bytecode_warnings({"PYTHONDONTWRITEBYTECODE": "1"}, "fakevllm") == []
    assert loading.bytecode_warnings({"PYTHONDONTWRITEBYTECODE": "1"}, "no_such_package_here") == []
