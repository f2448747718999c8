"""The vLLM server of target + drafter that export (its proof) and evaluation start in their stage folders."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from eyrie.vllm.client import ServerClient
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec


def serve(spec: ServerSpec, folder: Path, timeout_s: float) -> ServerClient:
    """Start (or reuse) the server recorded in `folder`, logging to the task's run log."""
    return VllmServer(folder).ensure(spec, timeout_s, log=get_run_logger().info)


def stop(folder: Path) -> None:
    VllmServer(folder).stop(log=get_run_logger().info)
