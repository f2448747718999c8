"""A flow run cancelled in the Prefect UI stops what it started on its node: its vLLM servers and its trainer
(eyrie/ops/processes.py says why Prefect does not, and how). A crash stops nothing: the servers stay up for the
retry to reuse.

`on_cancellation=[stop_on_cancellation]` on every flow a GPU deployment runs. Prefect 3.7's worker kills the flow
run's process, then runs this hook in its own process on the same node (a flow run without a worker runs it in the
flow's process); either way the hook finds what to stop in the run folder named by the run's `run_dir` parameter.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect.context import FlowRunContext
from prefect.logging.loggers import flow_run_logger

from eyrie.ops.processes import lead_process_group, stop_process_group, stop_servers
from eyrie.run.folder import RunFolder, node_name, run_server_folders, server_folder


@contextmanager
def own_process_group(run: RunFolder) -> Iterator[None]:
    """Within a flow run that a worker started (its process is the run's own: $PREFECT__FLOW_RUN_ID), lead a process
    group of its own and record it for `stop_on_cancellation`, so the trainer it starts is found after the flow's
    process is killed. Elsewhere (`eyrie run` in a terminal, a subflow) nothing changes: Ctrl-C reaches the whole
    foreground group as before."""
    ctx = FlowRunContext.get()
    flow_run = ctx.flow_run if ctx else None
    if flow_run is None or os.environ.get("PREFECT__FLOW_RUN_ID") != str(flow_run.id):
        yield
        return
    path = lead_process_group(run.root, str(flow_run.id))
    try:
        yield
    except Exception:
        path.unlink(missing_ok=True)  # failed: what it started has ended
        raise
    # Cancelled (Prefect's TerminationSignal, a BaseException) or killed: the record stays for the hook. A stale
    # one (a crash) is known by its start time (`eyrie.ops.processes.group_left`).
    path.unlink(missing_ok=True)


def run_folders(parameters: dict) -> tuple[RunFolder, list[Path]] | None:
    """The run folder of a flow run's parameters and the server folders it may have started on this host: a node's
    share, its node's extraction server alone (other nodes may run on this host); else every server of the run."""
    run_dir = parameters.get("run_dir")
    if not run_dir:
        return None
    run = RunFolder(run_dir)
    if parameters.get("shards") is not None:
        return run, [server_folder(run.extract, node_name(default=socket.gethostname()))]
    return run, run_server_folders(run.root)


def stop_on_cancellation(flow, flow_run, state) -> None:
    """The flow's on_cancellation hook: stop the run's servers on this host and what is left of its process group
    (the trainer and its ranks)."""
    log = flow_run_logger(flow_run, flow)
    found = run_folders(flow_run.parameters or {})
    if found is None:
        return
    run, folders = found
    stopped = stop_servers(folders, log=log.info)
    group = stop_process_group(run.root, str(flow_run.id), log=log.info)
    log.warning(
        f"cancelled: stopped {len(stopped)} vLLM server(s) of {run.root} ({', '.join(map(str, stopped)) or 'none'})"
        f" and {len(group)} process(es) of the flow run's group (the trainer's)"
    )
