"""The vLLM servers: target + drafter, which export (its proof) and evaluation start in their stage folders, and the
extraction server (tasks that start and stop it, for the sharded stages and online training)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact

from eyrie.run.folder import run_server_folders
from eyrie.vllm import phases
from eyrie.vllm.client import ServerClient, watch_first_answer
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec
from tasks.caching import eyrie_task


def _start_artifact(folder: Path, state: dict) -> None:
    measured = state["phases"]
    create_table_artifact(
        key="server-start",
        table=[{"phase": k, "seconds": round(v, 1)} for k, v in measured.items()],
        description=f"Start-up of the vLLM server in {folder} ({state.get('kind')}): {phases.summary(measured)}",
    )


def serve(spec: ServerSpec, folder: Path, timeout_s: float) -> ServerClient:
    """Start (or reuse) the server recorded in `folder`, logging to the task's run log; a server this call started
    leaves where its start-up went (weights, compile, CUDA graphs...) as a table artifact. Its first answer once
    ready, to any client of this process, is recorded beside those phases (`watch_first_answer`); the table with it
    is left again when the server is stopped."""
    server = VllmServer(folder)
    asked = time.time()
    client = server.ensure(spec, timeout_s, log=get_run_logger().info)
    watch_first_answer(client.base_url, server.state_path)
    state = server.state or {}
    if state.get("phases") and state.get("ready_at", 0) >= asked:
        _start_artifact(folder, state)
    return client


def _stopping(folder: Path) -> VllmServer:
    """Before a stop: the start's table again, now with its first request, if this server answered one."""
    server = VllmServer(folder)
    state = server.state
    if state and phases.first_answer_recorded(state) and server.owns(state):
        _start_artifact(folder, state)
    return server


def stop(folder: Path) -> None:
    _stopping(folder).stop(log=get_run_logger().info)


@eyrie_task("start-server", retries=1, retry_delay_seconds=5)
def start_server_task(spec: ServerSpec, folder: str, startup_timeout_s: float) -> str:
    """Start (or reuse) the extraction server; returns its base URL."""
    return serve(spec, Path(folder), startup_timeout_s).base_url


@eyrie_task("stop-server")
def stop_server_task(folder: str) -> bool:
    return _stopping(Path(folder)).stop(log=get_run_logger().info)


def unused_servers(run_root: Path, keep: list[Path]) -> list[Path]:
    """The run's server folders outside `keep` (each kept folder with everything below it)."""
    kept = [Path(k).resolve() for k in keep]
    return [
        f for f in run_server_folders(run_root) if not any(f.resolve() == k or k in f.resolve().parents for k in kept)
    ]


@eyrie_task("stop-unused-servers")
def stop_unused_servers_task(run_dir: str, keep: list[str], stage: str) -> list[str]:
    """Before a GPU stage with work to do: stop the run's servers on this host that `stage` does not use (`keep`:
    the folders of those it does), so their GPU memory is free when it starts. An extraction server that outlived its
    flow, an export server of a run that died: each holds its share of the GPUs until someone stops it. Servers of
    other hosts are never signalled (`VllmServer.stop`). Returns the folders whose server was stopped."""
    log = get_run_logger()
    stopped = [
        str(f) for f in unused_servers(Path(run_dir), [Path(k) for k in keep]) if _stopping(f).stop(log=log.info)
    ]
    if stopped:
        log.warning(f"before {stage}: stopped {len(stopped)} server(s) of this run that it does not use: {stopped}")
    return stopped
