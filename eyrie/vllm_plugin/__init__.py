"""What every vLLM process must load for Eyrie: the CPU/GPU hidden-states connector and the EAGLE-3 compatibility
layer for target classes that lack vLLM's interface (set EYRIE_EAGLE3_COMPAT=0 to leave vLLM untouched).

Shipped as the `vllm.general_plugins` entry point `eyrie`, so vLLM runs `register()` in its API server, engine core
and every tensor-parallel worker. It must be cheap and idempotent (vLLM may call it more than once per process) and
harmless to vLLM processes that do not use Eyrie: it only registers names, lazily.
"""

import os

CONNECTOR_NAME = "EyrieHiddenStatesConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "eyrie.vllm_plugin.connector", CONNECTOR_NAME)
    if os.environ.get("EYRIE_EAGLE3_COMPAT", "1") != "0":
        from eyrie.vllm_plugin.compat import install

        install()
