"""The engine core forked, not spawned, on vLLM's CPU platform (opt-in: EYRIE_CPU_ENGINE_FORK=1).

vLLM starts a server's engine core with the start method VLLM_WORKER_MULTIPROC_METHOD names, `fork` by default (so on
GPU nodes, unless CUDA is initialised in the API server). Its CPU platform sets `spawn` in `check_and_update_config`,
for the OpenMP settings it gives each process. A spawned engine core is a second interpreter that imports torch,
transformers and vLLM again: a tiny target's server took 81 s to ready with it and 44 s forked, on an idle 2-core
machine (benchmarks/RESULTS.md). The tests run vLLM with one OpenMP thread per process and no binding
(`OMP_NUM_THREADS=1`, `VLLM_CPU_OMP_THREADS_BIND=nobind`), where the API server has no OpenMP pool for a fork to lose.

A forked process also holds every module its parent imported, and vLLM 0.32's CPU platform rebinds its kernel
overrides by scanning every module's namespace and every object in it: llvmlite's `ffi.lib` (imported with numba
by Kimi-K2.5's vision processor) answers `__dict__` with an object of its own, and the scan raises in the engine
(a spawned one had not imported numba yet). `scan_only_plain_namespaces` runs that scan with such objects out of
sight, then puts them back; tests/engine_capture.py, which builds Kimi's engine in its own process, uses it too.

The CPU platform also sets LD_PRELOAD (torch's libgomp, and the tcmalloc vLLM bundles where it does) for the engine
core it spawns; exec reads it, a fork does not. So the fork is taken only when this process has already mapped every
library named there, and otherwise vLLM's spawn stays, with a warning that says which library was missing.

The same holds for vLLM's thread binding: unless VLLM_CPU_OMP_THREADS_BIND is `nobind`, each worker is started with
its own OpenMP settings in its environment (OMP_NUM_THREADS and the cores' affinity, vllm/utils/ompmultiprocessing.py),
which the OpenMP runtime reads when the process starts; a forked worker keeps its parent's runtime, unbound. That is
the likely cause (read from vLLM's code, not measured apart) of the demo's forked servers generating more slowly
(regeneration 22 s against 15 s, evaluation 56 s against 40 s, benchmarks/RESULTS.md). So a binding keeps the spawn.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def fork_cpu_engine() -> None:
    """Put `fork` back after the CPU platform's `check_and_update_config` set `spawn` (idempotent)."""
    from vllm.platforms import cpu

    from eyrie.vllm.plugin import CPU_ENGINE_FORK

    scan_only_plain_namespaces()
    platform: Any = cpu.CpuPlatform
    if getattr(platform.check_and_update_config, "_eyrie_forks", False):
        return
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        why = spawn_reason(os.environ.get("LD_PRELOAD", ""), thread_binding())
        if why:  # a fork would run without it: keep vLLM's spawn
            logger.warning("engine core spawned, not forked (%s=1): %s", CPU_ENGINE_FORK, why)
            return
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config._eyrie_forks = True  # type: ignore[attr-defined]
    platform.check_and_update_config = classmethod(check_and_update_config)


def thread_binding() -> str:
    from vllm import envs

    return envs.VLLM_CPU_OMP_THREADS_BIND


def spawn_reason(ld_preload: str, binding: str, maps: Path = Path("/proc/self/maps")) -> str | None:
    """Why a forked engine core (and its workers) would not run as vLLM set them up, or None when it would."""
    missing = preloads_not_mapped(ld_preload, maps)
    if missing:
        return f"this process has not loaded {', '.join(missing)}, which vLLM preloads"
    if binding != "nobind":
        return (
            f"VLLM_CPU_OMP_THREADS_BIND={binding} gives each worker OpenMP settings read when it starts, which a fork "
            "would lose; fork with VLLM_CPU_OMP_THREADS_BIND=nobind and OMP_NUM_THREADS set, or unset "
            "EYRIE_CPU_ENGINE_FORK"
        )
    return None


def preloads_not_mapped(ld_preload: str, maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The libraries of `ld_preload` this process has not loaded. vLLM's CPU platform preloads torch's OpenMP
    runtime and its own tcmalloc into the engine core it spawns (through LD_PRELOAD, read at exec); a forked engine
    core has only what its parent loaded, so it forks only when that includes them."""
    libs = ld_preload.replace(":", " ").split()
    try:  # a mapping's line: address, perms, offset, device, inode, then the file's path (if any)
        fields = [line.split(maxsplit=5) for line in maps.read_text().splitlines()]
    except OSError:  # no /proc: nothing can be checked, so nothing is vouched for
        return libs
    loaded = {os.path.realpath(f[5]) for f in fields if len(f) == 6}
    return [lib for lib in libs if os.path.realpath(lib) not in loaded]


def scan_only_plain_namespaces() -> None:
    """vLLM's kernel-override scan (`vllm.triton_utils.dispatcher._rebind_kernels`) with the modules and module
    attributes whose `__dict__` is not a mapping hidden for its length (idempotent). A vLLM without that scan is left
    as it is: 0.26 has no dispatcher, and 0.34 replaced the scan with `_rebind_impls`, which reads an object's
    namespace only when `vars()` gives a real dict (the guard this wrapper adds)."""
    try:
        import vllm.triton_utils.dispatcher as dispatcher
    except ModuleNotFoundError as err:
        if err.name not in ("vllm.triton_utils", "vllm.triton_utils.dispatcher"):
            raise
        return
    rebind = getattr(dispatcher, "_rebind_kernels", None)
    if rebind is None or getattr(rebind, "_eyrie_plain", False):
        return

    def plain(value) -> bool:
        try:
            return not hasattr(value, "__dict__") or isinstance(vars(value), Mapping)
        except TypeError:  # no __dict__ after all
            return True

    def scan(overrides):
        # Reading every module's attributes touches deprecated ones (torch.distributed.reduce_op), whose
        # FutureWarnings would fill the server's log without anyone having used them.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            scan_quietly(overrides)

    def scan_quietly(overrides):
        hidden_modules = {k: m for k, m in list(sys.modules.items()) if not plain(m)}
        for k in hidden_modules:
            del sys.modules[k]
        hidden = []
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None) or {}
            for attr, value in list(namespace.items()):
                if not plain(value):
                    hidden.append((namespace, attr, value))
                    del namespace[attr]
        try:
            rebind(overrides)
        finally:
            for namespace, attr, value in hidden:
                namespace[attr] = value
            sys.modules.update(hidden_modules)

    scan._eyrie_plain = True  # type: ignore[attr-defined]
    dispatcher._rebind_kernels = scan
