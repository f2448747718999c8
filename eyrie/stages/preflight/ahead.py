"""vLLM imported for preflight ahead of time, while the process would only wait.

Preflight's checks of the target import vLLM and its server parser: 10.5 s of a fresh preflight's 15.4 s on a 2-core
machine. Before preflight, a tiny target is taught in a child process with one OpenMP thread (34-44 s), during which
the flow's process only waits, and the second core idles. `import_ahead` imports those modules in a thread then;
`wait_for_imports_ahead` (preflight's first step, before its key reads anything) waits for that thread, so no module
is ever imported by two threads at once.
"""

from __future__ import annotations

import importlib
import threading

from eyrie.stages.preflight.installed_vllm import serve_parser

MODULES = (
    "vllm",
    "vllm.platforms",
    "vllm.config.speculative",
    "vllm.model_executor.models.registry",
    "transformers",
)
_STATE: dict = {}  # "thread": the importing thread, once started


def _import_all() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (preflight imports it again and reports what is wrong)
            return
    try:
        serve_parser()  # built and cached: preflight's checks of the server arguments take this one
    except Exception:  # noqa: BLE001
        return


def import_ahead() -> None:
    """Start importing preflight's modules in a daemon thread (once); nothing when vLLM runs in another environment
    ($EYRIE_VLLM_PYTHON: preflight asks it through a probe, and this process never imports vLLM)."""
    from eyrie.run.vllm_python import one_environment

    if "thread" not in _STATE and one_environment():
        _STATE["thread"] = thread = threading.Thread(target=_import_all, name="eyrie-preflight-imports", daemon=True)
        thread.start()


def wait_for_imports_ahead() -> None:
    thread = _STATE.get("thread")
    if thread is not None:
        thread.join()
