"""What a cancelled flow run leaves running on its node, and how it is stopped.

Prefect kills a cancelled flow run's own process and nothing else (PrefectHQ/prefect #20979, #17593): the vLLM
servers, which run in sessions of their own so that they survive a crash for the retry to reuse, and the trainer
(torchrun and its ranks) would hold the GPUs on. So a flow run that a worker started leads a process group of its
own (`lead_process_group`: every child that does not start a session of its own, the trainer included, is in it) and
records it in `<run>/flow-runs/<flow run id>.json`; its cancellation hook (flows/cancel.py) stops the run's servers
recorded on this host (`eyrie.vllm.process.VllmServer.stop`) and what is left of that group (`stop_process_group`).

A crash runs no hook: the servers stay up for the retry, as the run folder records them, and the trainer receives
SIGTERM when the flow's process dies (`PR_SET_PDEATHSIG`, eyrie/stages/train/command.py) and resumes from its newest
checkpoint on the retry.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

from eyrie.run.files import atomic_write_json, read_json
from eyrie.vllm.process import VllmServer, _group_members, _reap, boot_id, process_start_ticks

FLOW_RUNS = "flow-runs"


def record_path(run_root: Path, flow_run_id: str) -> Path:
    return Path(run_root) / FLOW_RUNS / f"{flow_run_id}.json"


def lead_process_group(run_root: Path, flow_run_id: str) -> Path:
    """Make this process (a flow run's, started by a worker) the leader of a process group of its own, so that
    everything it starts is found by that group after the process is killed, and record it. Returns the record."""
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    path = record_path(run_root, flow_run_id)
    atomic_write_json(
        path,
        {
            "flow_run_id": str(flow_run_id),
            "pid": os.getpid(),
            "pgid": os.getpgrp(),
            "start_ticks": process_start_ticks(os.getpid()),
            "boot_id": boot_id(),
            "hostname": socket.gethostname(),
        },
    )
    return path


def group_left(record: dict) -> list[int]:
    """The live processes of the recorded flow run's process group, other than this one: none when the record is
    from another host or boot, or when the group's number is now another group's (its leader a newer process)."""
    if (
        not record
        or record.get("hostname") != socket.gethostname()
        or record.get("boot_id") != boot_id()
        or not isinstance(record.get("pgid"), int)
        or record["pgid"] != record.get("pid")
    ):
        return []
    pgid, since = record["pgid"], record.get("start_ticks") or 0
    leader = process_start_ticks(pgid)
    if leader is not None and leader != since:
        return []  # the leader's pid is another process now: so is the group
    return [p for p in _group_members(pgid) if p != os.getpid() and (process_start_ticks(p) or -1) >= since]


def stop_process_group(run_root: Path, flow_run_id: str, log: Callable[[str], None] = print) -> list[int]:
    """SIGTERM what is left of the flow run's recorded process group (the trainer, its ranks), then SIGKILL what
    did not exit within 10 s; the record is removed. Returns the pids signalled."""
    path = record_path(run_root, flow_run_id)
    record = read_json(path) or {}
    left = group_left(record)
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and group_left(record):
            for pid in left:
                _reap(pid)
            time.sleep(0.2)
    signalled = sorted(set(left))
    if signalled:
        log(f"stopped {len(signalled)} process(es) of the flow run's group {record['pgid']}: {signalled}")
    if record.get("hostname") in (None, socket.gethostname()):
        path.unlink(missing_ok=True)
    return signalled


def stop_servers(folders: list[Path], log: Callable[[str], None] = print) -> list[Path]:
    """Stop the servers recorded in `folders` that run on this host (others are never signalled)."""
    return [f for f in folders if VllmServer(f).stop(log=log)]
