"""What every vLLM process must load for Eyrie: the CPU/GPU hidden-states connector.

Shipped as the `vllm.general_plugins` entry point `eyrie`, so vLLM runs `register()` in its API server, engine core
and every tensor-parallel worker. It must be cheap and idempotent (vLLM may call it more than once per process) and
harmless to vLLM processes that do not use Eyrie: it only registers names, lazily.
"""

CONNECTOR_NAME = "EyrieHiddenStatesConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "eyrie.vllm_plugin.connector", CONNECTOR_NAME)
