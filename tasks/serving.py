"""The vLLM servers: target + drafter, which export (its proof) and evaluation start in their stage folders, and the
extraction server (tasks that start and stop it, for the sharded stages and online training)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from eyrie.vllm.client import ServerClient
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec
from tasks.caching import eyrie_task


def serve(spec: ServerSpec, folder: Path, timeout_s: float) -> ServerClient:
    """Start (or reuse) the server recorded in `folder`, logging to the task's run log."""
    return VllmServer(folder).ensure(spec, timeout_s, log=get_run_logger().info)


def stop(folder: Path) -> None:
    VllmServer(folder).stop(log=get_run_logger().info)


@eyrie_task("start-server", retries=1, retry_delay_seconds=5)
def start_server_task(spec: ServerSpec, folder: str, startup_timeout_s: float) -> str:
    """Start (or reuse) the extraction server; returns its base URL."""
    return VllmServer(Path(folder)).ensure(spec, startup_timeout_s, log=get_run_logger().info).base_url


@eyrie_task("stop-server")
def stop_server_task(folder: str) -> bool:
    return VllmServer(Path(folder)).stop(log=get_run_logger().info)
