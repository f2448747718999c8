"""A fan-out node's share (flows/extract.py with `shards=`): it locks what it writes and starts only while its parent
runs.

A share runs in a flow-run process of its own on its node, and writes its shards and its node's server folder in the
one shared run folder. Its parent (the fan-out, flows/fanout.py) holds the run folder's lock, but that lock dies with
the parent's process while the share writes on: so the share holds locks of its own (`RunFolder.share_lock`: the
shares lock shared, which keeps every run of the whole folder out, and its shards and its node exclusively, which
keeps other shares off them). It also refuses to start when its parent flow run is not running (cancelled, crashed,
failed while the share waited in its node's queue): nobody would collect its work. A share triggered on its own (no
parent: the node deployment run by hand) runs under the same locks.

A share that ran through a Prefect server outage (a restart) keeps running: its API requests are retried
(PREFECT_CLIENT_MAX_RETRIES, deployments/prefect.yaml). Its events are not: Prefect's events client keeps the ones the
server did not confirm (the task runs' states, heartbeats) and sends them again only when it next connects, for the
next event. A share ends by waiting for the API and emitting `eyrie.share.finished`, so that what it did during the
outage reaches the server instead of dying with its process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.events import emit_event

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


API_WAIT_S = 300.0  # how long a finished share waits for an unreachable API (the client's retries last ~4 min)


def wait_for_api(wait_s: float = API_WAIT_S, poll_s: float = 2.0) -> bool:
    """Until the Prefect API answers its health check (True), or `wait_s` passed (False). In a flow run the probe is
    the run's own client, whose requests Prefect retries (PREFECT_CLIENT_MAX_RETRIES); a fresh client elsewhere is
    not retried on a refused connection, hence the loop."""
    deadline = time.monotonic() + wait_s
    while True:
        with get_client(sync_client=True) as client:
            if client.api_healthcheck() is None:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def share_finished(flow_run, stage: str, shards: list[str], node: str | None) -> None:
    """The share's last event, once the API answers: it makes Prefect's events client reconnect and send again the
    events the server did not confirm (see the module's docstring)."""
    wait_for_api()
    emit_event(
        event="eyrie.share.finished",
        resource={"prefect.resource.id": f"eyrie.share.{flow_run.id}", "prefect.resource.name": flow_run.name},
        related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.role": "flow-run"}],
        payload={"stage": stage, "shards": shards, "node": node},
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
        try:
            yield
        finally:
            if flow_run is not None:
                with suppress(Exception):  # never in the way of the share's own outcome
                    share_finished(flow_run, stage, shards, node)
