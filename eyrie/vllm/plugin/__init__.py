"""What every vLLM process must load for Eyrie: the CPU/GPU hidden-states connector and the EAGLE-3 compatibility
layer for target classes that lack vLLM's interface (set EYRIE_EAGLE3_COMPAT=0 to leave vLLM untouched).

Shipped as the `vllm.general_plugins` entry point `eyrie`, so vLLM runs `register()` in its API server, engine core
and every tensor-parallel worker. It must be cheap and idempotent (vLLM may call it more than once per process) and
harmless to vLLM processes that do not use Eyrie: it only registers names, lazily.
"""

import os

CONNECTOR_NAME = "EyrieHiddenStatesConnector"
# A request whose kv_transfer_params set this to true gets no hidden-states file (the regenerate stage's generation
# requests, sent to the extraction server): eyrie/vllm/plugin/connector.py.
SKIP_HIDDEN_STATES = "eyrie_skip_hidden_states"
# Test-only: comma-separated vLLM class names whose EAGLE-3 interface is hidden, in preflight and in every vLLM
# process, to reproduce vLLMs whose classes lack it (DeepseekV3 and Kimi-K2.5 before 0.18) on the installed one.
HIDE_EAGLE3 = "EYRIE_TEST_HIDE_EAGLE3"
# Set to 1: on vLLM's CPU platform the engine core is forked from the API server, as vLLM does on GPUs, instead of
# spawned (eyrie/vllm/plugin/fork.py).
CPU_ENGINE_FORK = "EYRIE_CPU_ENGINE_FORK"


def hidden_eagle3_classes() -> set[str]:
    return {name for name in os.environ.get(HIDE_EAGLE3, "").split(",") if name}


def _hide_eagle3(names: set[str]) -> None:
    """vLLM asks `supports_eagle3(model)` before it requests aux hidden states: answer no for the named classes
    (a subclass Eyrie's compatibility layer makes of them is answered as usual), in every module that asks."""
    from vllm.model_executor.models import interfaces

    original = interfaces.supports_eagle3
    if getattr(original, "_eyrie_hides", None) is not None:
        return

    def supports_eagle3(model):
        cls = model if isinstance(model, type) else type(model)
        return cls.__name__ not in names and original(model)

    supports_eagle3._eyrie_hides = names  # type: ignore[attr-defined]
    for module in (interfaces, *(_runner_module(name) for name in RUNNER_MODULES)):
        if module is not None:
            module.supports_eagle3 = supports_eagle3  # type: ignore[attr-defined]


# The modules that ask `supports_eagle3` by a name of their own: V1's runner (absent from 0.34, which has no V1)
# and V2's EAGLE-3 setup. One a vLLM lacks is skipped.
RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils")


def _runner_module(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and f"{name}.".startswith(f"{err.name}."):  # absent here, not a broken import
            return None
        raise


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "eyrie.vllm.plugin.connector", CONNECTOR_NAME)
    hidden = hidden_eagle3_classes()
    if hidden:
        _hide_eagle3(hidden)
    if os.environ.get(CPU_ENGINE_FORK) == "1":
        from eyrie.vllm.plugin.fork import fork_cpu_engine

        fork_cpu_engine()
    from eyrie.vllm.plugin.model_inspection import inspect_models_in_process

    inspect_models_in_process()
    if os.environ.get("EYRIE_EAGLE3_COMPAT", "1") != "0":
        from eyrie.vllm.plugin.compat import install

        install()
