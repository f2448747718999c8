"""A fan-out node's share (flows/extract.py with `shards=`): it locks what it writes and starts only while its parent
runs.

A share runs in a flow-run process of its own on its node, and writes its shards and its node's server folder in the
one shared run folder. Its parent (the fan-out, flows/fanout.py) holds the run folder's lock, but that lock dies with
the parent's process while the share writes on: so the share holds locks of its own (`RunFolder.share_lock`: the
shares lock shared, which keeps every run of the whole folder out, and its shards and its node exclusively, which
keeps other shares off them). It also refuses to start when its parent flow run is not running (cancelled, crashed,
failed while the share waited in its node's queue): nobody would collect its work. A share triggered on its own (no
parent: the node deployment run by hand) runs under the same locks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext

from eyrie.errors import RunFolderError
from eyrie.run.folder import RunFolder


def parent_flow_run(flow_run_id) -> object | None:
    """The flow run that started `flow_run_id` (as a subflow, or through `run_deployment` from inside a flow), read
    from the Prefect API; None for a flow run started on its own."""
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        if run.parent_task_run_id is None:
            return None
        task_run = client.read_task_run(run.parent_task_run_id)
        return client.read_flow_run(task_run.flow_run_id) if task_run.flow_run_id else None


def refuse_unless_parent_runs(flow_run_id, what: str) -> None:
    """RunFolderError unless the parent of `flow_run_id` (if it has one) is Running now."""
    parent = parent_flow_run(flow_run_id)
    if parent is None:
        return
    state = parent.state
    if state is None or not state.is_running():
        raise RunFolderError(
            f"{what}: its parent flow run {parent.name} ({parent.id}) is "
            f"{state.name if state else 'without a state'}, not Running: nobody would collect this share's work. "
            "Not started; retry the parent (it sends out the shards still pending)"
        )


@contextmanager
def node_share(run: RunFolder, stage: str, shards: list[str], node: str | None) -> Iterator[None]:
    """Hold `shards` of `stage` and `node`'s server folder for this flow run, after checking its parent runs (checked
    with the locks held, so a parent that dies after the check leaves a share that still keeps others out)."""
    ctx = FlowRunContext.get()
    flow_run = ctx.flow_run if ctx else None
    holder = f"flow run {flow_run.name} ({flow_run.id})" if flow_run else "a node share"
    what = f"{holder}, {stage} share of node {node or 'this host'} ({len(shards)} shards)"
    with run.share_lock(stage, shards, node, holder):
        if flow_run is not None:
            refuse_unless_parent_runs(flow_run.id, what)
        yield
