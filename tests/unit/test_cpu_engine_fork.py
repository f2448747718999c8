"""EYRIE_CPU_ENGINE_FORK: the CPU platform's `spawn` is put back to `fork` after its config check, once; and vLLM's
kernel scan, which a forked process runs over its parent's modules, sees no namespace that is not a mapping."""

from __future__ import annotations

import os
import sys
import types

import vllm.triton_utils.dispatcher as dispatcher
from vllm.platforms import cpu

from eyrie.vllm.plugin.fork import fork_cpu_engine, preloads_not_mapped, scan_only_plain_namespaces, spawn_reason


def test_the_engine_core_is_forked_after_the_cpu_platform_chose_spawn(monkeypatch):
    calls = []

    def like_vllm(cls, vllm_config):  # what vLLM's CpuPlatform.check_and_update_config does to the start method
        calls.append(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(like_vllm))
    monkeypatch.setattr(dispatcher, "_rebind_kernels", dispatcher._rebind_kernels)  # put back after the test
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the tests' setting: vLLM binds no threads
    fork_cpu_engine()
    fork_cpu_engine()  # vLLM may load its plugins more than once in a process: one wrapper, not two
    cpu.CpuPlatform.check_and_update_config("config")
    assert calls == ["config"]  # the platform's own checks still run, once
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert getattr(dispatcher._rebind_kernels, "_eyrie_plain", False)


class _OddNamespace:
    """Like llvmlite's `ffi.lib`: `__dict__` answers with an object that is not a mapping."""

    @property
    def __dict__(self):  # type: ignore[override]
        return object()


def test_the_kernel_scan_runs_with_odd_namespaces_hidden_and_puts_them_back(monkeypatch):
    seen = []

    def like_vllm(overrides):  # vLLM's _rebind_kernels: `vars(value).get(...)` on every module attribute
        for module in list(sys.modules.values()):
            for value in list((getattr(module, "__dict__", None) or {}).values()):
                if hasattr(value, "__dict__"):
                    vars(value).get("kernel")
        seen.append(overrides)

    odd_module = _OddNamespace()
    holder = types.ModuleType("eyrie_test_holder")
    holder.lib = _OddNamespace()
    monkeypatch.setitem(sys.modules, "eyrie_test_odd", odd_module)
    monkeypatch.setitem(sys.modules, "eyrie_test_holder", holder)
    monkeypatch.setattr(dispatcher, "_rebind_kernels", like_vllm)
    scan_only_plain_namespaces()
    scan_only_plain_namespaces()  # idempotent
    dispatcher._rebind_kernels(["overrides"])
    assert seen == [["overrides"]]
    assert sys.modules["eyrie_test_odd"] is odd_module and isinstance(holder.lib, _OddNamespace)


def test_the_engine_core_is_spawned_when_a_fork_would_lack_what_vllm_preloads(monkeypatch, tmp_path, caplog):
    """vLLM's CPU platform preloads its OpenMP runtime (and tcmalloc) into a spawned engine core through LD_PRELOAD;
    a fork has only what its parent loaded, so a library the API server has not loaded keeps vLLM's spawn."""
    absent = str(tmp_path / "libgomp-not-loaded.so.1")

    def like_vllm(cls, vllm_config):
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        os.environ["LD_PRELOAD"] = absent

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(like_vllm))
    monkeypatch.setattr(dispatcher, "_rebind_kernels", dispatcher._rebind_kernels)
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    fork_cpu_engine()
    cpu.CpuPlatform.check_and_update_config("config")
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert absent in caplog.text


def test_the_engine_core_is_spawned_when_vllm_binds_its_threads(monkeypatch, caplog):
    """With vLLM's binding (`auto`, its default, or a core list) each worker gets its OpenMP thread count and
    affinity in its environment, read when the process starts: a forked worker would keep the parent's runtime,
    unbound, so vLLM's spawn stays."""

    def like_vllm(cls, vllm_config):
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(like_vllm))
    monkeypatch.setattr(dispatcher, "_rebind_kernels", dispatcher._rebind_kernels)
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # vLLM's default: auto
    fork_cpu_engine()
    cpu.CpuPlatform.check_and_update_config("config")
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "VLLM_CPU_OMP_THREADS_BIND=auto" in caplog.text and "nobind" in caplog.text


def test_a_fork_is_vouched_for_only_with_every_preload_mapped_and_no_binding(tmp_path):
    lib = tmp_path / "libgomp.so.1"
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f01 r-xp 00000000 08:01 42   {lib}\n")
    assert spawn_reason(str(lib), "nobind", maps) is None
    assert spawn_reason("", "nobind", maps) is None
    assert "not loaded" in (spawn_reason(str(tmp_path / "libtcmalloc.so"), "nobind", maps) or "")
    for binding in ("auto", "0-1", "0|1"):
        assert f"VLLM_CPU_OMP_THREADS_BIND={binding}" in (spawn_reason(str(lib), binding, maps) or "")


def test_preloads_are_checked_against_the_libraries_this_process_mapped(tmp_path):
    lib = tmp_path / "libfoo.so.1"
    lib.write_bytes(b"")
    link = tmp_path / "libfoo.so"
    link.symlink_to(lib)  # a preload may name a link to what is mapped
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f00-7f01 r-xp 00000000 08:01 42   {lib}\n7f02-7f03 rw-p 00000000 00:00 0 \n7f04-7f05 r--p 0 08:01 7 [heap]\n"
    )
    other = str(tmp_path / "libbar.so")
    assert preloads_not_mapped(f"{link}:{other}", maps) == [other]
    assert preloads_not_mapped(f" {lib} ", maps) == []
    assert preloads_not_mapped("", maps) == []
    assert preloads_not_mapped(other, tmp_path / "no-proc") == [other]  # nothing to check: nothing vouched for
