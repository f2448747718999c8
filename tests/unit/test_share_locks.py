"""A fan-out node's share holds its own locks (issue 22 item 3): the run folder's lock is its parent's, and dies with
the parent's process while the share writes on. So a share holds the shares lock shared (no run of the whole folder
starts beside it) and its shards and node exclusively (no other share writes them), and starts only while its parent
flow run is Running, asked of the Prefect API. Locks are flocks of separate processes where it matters (a killed
holder frees them)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from conftest import REPO

from eyrie.errors import RunFolderError
from eyrie.run.folder import RunFolder

# A node share in a process of its own, holding its locks until its stdin closes (or it is killed).
SHARE = """
import sys
from eyrie.run.folder import RunFolder
run, node, shards = RunFolder(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
with run.share_lock("extract", shards, node, "flow run share-of-" + node):
    print("held", flush=True)
    sys.stdin.readline()
"""


def share(run: RunFolder, node: str, shards: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SHARE, str(run.root), node, ",".join(shards)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    line = proc.stdout.readline().strip()
    if line != "held":
        proc.wait(timeout=30)
        raise AssertionError(proc.stderr.read())
    return proc


def test_a_share_whose_parent_died_keeps_every_run_of_the_folder_out(tmp_path):
    run = RunFolder(tmp_path / "run")
    run.ensure()
    with run.lock() as parent:  # the fan-out parent: opens the run, then admits its nodes
        with pytest.raises(RunFolderError, match="has not admitted node shares"):
            with run.share_lock("extract", ["shard-00000"], "gpu-node-1", "early share"):
                pass
        parent.admit_shares()
        node = share(run, "gpu-node-1", ["shard-00000", "shard-00002"])
    # The parent is gone (its lock with it); the node writes on. A pipeline run, an extraction, a retried fan-out,
    # `eyrie verify`: each takes the run folder's lock, and is refused while the share holds its shards.
    try:
        with pytest.raises(RunFolderError) as info:
            with run.lock():
                pytest.fail("a run of the whole folder started beside a node's share")
        msg = str(info.value)
        assert "node shares still writing" in msg and "extract shard-00000: flow run share-of-gpu-node-1" in msg, msg
        # Another share may not write its shards, nor use its node's server folder; a disjoint share of another
        # node may.
        with pytest.raises(
            RunFolderError, match="extract shard shard-00002 .* is held by flow run share-of-gpu-node-1"
        ):
            with run.share_lock("extract", ["shard-00001", "shard-00002"], "gpu-node-2", "overlapping share"):
                pass
        with pytest.raises(RunFolderError, match="node gpu-node-1's server folder"):
            with run.share_lock("extract", ["shard-00003"], "gpu-node-1", "same node"):
                pass
        with run.share_lock("extract", ["shard-00001", "shard-00003"], "gpu-node-2", "disjoint share"):
            pass
    finally:
        node.kill()  # the node dies too: its locks go with its process
        node.wait(timeout=30)
    with run.lock():
        pass


def test_a_share_refuses_names_that_are_not_names(tmp_path):
    run = RunFolder(tmp_path / "run")
    for bad in ("../x", "a/b", ""):
        with pytest.raises(RunFolderError, match="letters, digits"):
            with run.share_lock("extract", [bad], "n1", "share"):
                pass
    assert not (run.root / "extract").exists()


def _flow_runs(parent_state):
    """A parent flow run in `parent_state`, a task run of it, and a child flow run started from that task run (as
    run_deployment links a node's run to the fan-out), through the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import TaskRun  # noqa: F401

    async def go():
        from prefect import flow

        @flow(name="share-parent-probe")
        def probe():
            pass

        async with get_client() as c:
            parent = await c.create_flow_run(probe, state=parent_state)
            task = await c.create_task_run(
                task=_stub_task(), flow_run_id=parent.id, dynamic_key="0", state=parent_state
            )
            child = await c.create_flow_run(probe, parent_task_run_id=task.id)
            return parent, child

    return asyncio.run(go())


def _stub_task():
    from prefect import task

    @task(name="run-deployment-link")
    def link():
        pass

    return link


def test_a_share_starts_only_while_its_parent_runs():
    from prefect.states import Crashed, Running

    from flows.shares import refuse_unless_parent_runs

    parent, child = _flow_runs(Running())
    refuse_unless_parent_runs(child.id, "share")  # parent Running: started
    parent, child = _flow_runs(Crashed(message="its process died"))
    with pytest.raises(RunFolderError, match=rf"parent flow run {parent.name} \({parent.id}\) is Crashed, not Running"):
        refuse_unless_parent_runs(child.id, "share")
    alone, _ = _flow_runs(Running())
    refuse_unless_parent_runs(alone.id, "share")  # no parent (the node deployment run by hand): the locks alone


def test_the_node_flow_takes_its_locks_before_anything(tmp_path, tiny_llama):
    """The node's flow itself, given a share while a run holds the whole folder: refused before it reads or writes
    anything there (before this, a share ran under its parent's lock alone and took none)."""
    from conftest import config_dict

    from eyrie.config import parse_config
    from flows.extract import extract_flow

    config = parse_config(config_dict(tiny_llama, max_samples=16, shard_size=8))
    run = RunFolder(tmp_path / "run")
    run.ensure()
    with run.lock():
        with pytest.raises(RunFolderError, match="has not admitted node shares"):
            extract_flow(config, str(run.root), report={}, shards=["shard-00000"])
    assert not (run.root / "extract" / "nodes").exists()
