"""A flow that starts, cheaply, what Eyrie's GPU flows start, for the cancellation test of tests/e2e/test_production.py
(a vLLM start costs ~40 s on this machine; the trainer needs extracted data):

- a "server" started and recorded by `VllmServer.launch` itself, as every vLLM server of a run is (a session of its
  own, `server.json` in the run's extraction folder); only its command is `sleep`;
- a "trainer": a child of the flow's process started as the trainer is (`_die_with_parent`), that has a child of its
  own, as torchrun has its ranks (neither starts a session of its own, as the trainer does not).

Under the production code path: the flows' `on_cancellation` hook (flows/cancel.py) and `own_process_group`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from prefect import flow

from eyrie.run.files import atomic_write_json
from eyrie.run.folder import RunFolder
from eyrie.stages.train.command import _die_with_parent
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec
from flows.cancel import own_process_group, stop_on_cancellation

RANKS = (
    "import subprocess, time; r = subprocess.Popen(['sleep', '600'], stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL); print(r.pid, flush=True); time.sleep(600)"
)


@dataclass
class SleepingServer(ServerSpec):
    def command(self, port: int) -> list[str]:
        return ["sleep", "600"]


@flow(name="eyrie-cancel-probe", on_cancellation=[stop_on_cancellation])
def cancel_probe(run_dir: str) -> None:
    run = RunFolder(run_dir)
    run.ensure()
    with own_process_group(run):
        state, _ = VllmServer(run.extract).launch(SleepingServer(model="fake-target", layer_ids=[2]), log=print)
        # Started as the trainer is: SIGTERM when the flow's process dies.
        trainer = subprocess.Popen(
            [sys.executable, "-c", RANKS], stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent
        )
        rank = int(trainer.stdout.readline())
        atomic_write_json(
            run.root / "probe.json", {"flow": os.getpid(), "server": state["pid"], "trainer": trainer.pid, "rank": rank}
        )
        time.sleep(600)
