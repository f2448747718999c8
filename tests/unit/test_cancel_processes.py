"""What a cancelled flow run's hook stops besides its servers: what is left of the flow run's recorded process group
(the trainer, its ranks) once the flow's process is gone, and only that (eyrie/ops/processes.py). The real
cancellation, through a worker and the Prefect API, is in tests/e2e/test_production.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO

from eyrie.ops.processes import group_left, record_path, stop_process_group
from eyrie.vllm.process import _alive

# A flow run's process as a worker starts it: it leads its group (lead_process_group), starts a "trainer" with a
# "rank", and prints their pids.
FLOW = """
import subprocess, sys, time
from eyrie.ops.processes import lead_process_group
lead_process_group(sys.argv[1], "run-1")
ranks = "import subprocess, time; r = subprocess.Popen(['sleep', '300']); print(r.pid, flush=True); time.sleep(300)"
trainer = subprocess.Popen([sys.executable, "-c", ranks], stdout=subprocess.PIPE, text=True)
print(trainer.pid, trainer.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def _wait_gone(pids, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_the_group_of_a_killed_flow_is_stopped_and_nothing_else(tmp_path):
    flow = subprocess.Popen([sys.executable, "-c", FLOW, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    trainer, rank = (int(p) for p in flow.stdout.readline().split())
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)  # another group: never signalled
    try:
        record = json.loads(record_path(tmp_path, "run-1").read_text())
        assert record["pgid"] == record["pid"] == flow.pid and os.getpgid(rank) == flow.pid
        # From another host, or from before a reboot, the record names nothing here.
        assert group_left({**record, "hostname": "another-node"}) == []
        assert group_left({**record, "boot_id": "another-boot"}) == []
        flow.kill()  # as the worker kills a cancelled run's process: its trainer and rank live on
        flow.wait(timeout=30)
        assert _alive(trainer) and _alive(rank)
        assert sorted(stop_process_group(tmp_path, "run-1", log=lambda *_: None)) == sorted([trainer, rank])
        assert _wait_gone([trainer, rank]) == []
        assert _alive(bystander.pid) and not record_path(tmp_path, "run-1").exists()
        assert stop_process_group(tmp_path, "run-1", log=lambda *_: None) == []  # no record: nothing to stop
    finally:
        for pid in (trainer, rank):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        bystander.kill()
        bystander.wait()
        if flow.poll() is None:
            flow.kill()


def test_outside_a_worker_the_flow_keeps_its_group(tmp_path):
    """`eyrie run` in a terminal (no $PREFECT__FLOW_RUN_ID of its own): the flow stays in the terminal's foreground
    group, so Ctrl-C still reaches it and the trainer, and no record is written."""
    from prefect import flow

    from eyrie.run.folder import RunFolder
    from flows.cancel import own_process_group

    run = RunFolder(tmp_path / "run")

    @flow
    def in_terminal() -> int:
        with own_process_group(run):
            return os.getpgrp()

    assert in_terminal() == os.getpgrp()
    assert not (run.root / "flow-runs").exists()
