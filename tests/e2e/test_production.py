"""Eyrie on a production-like Prefect: PostgreSQL, `prefect server start` with authentication, `python -m
deployments.setup`, real process workers on the GPU nodes' queues, and flow runs of the deployments (tiny-llama on
vLLM's CPU build).

- A pipeline run (until extract) fails on one shard by injected fault. After the operator's fix, the same flow run
  is retried as the UI's Retry button does it: only the failed shard runs again (the others are not submitted),
  nothing finished is rewritten, and neither the database password nor the Prefect credential is in any log, artifact or
  file of the run.
- The operator hears of the failure: setup's "Eyrie GPU run failed" automation sends the notification block given
  with `--notify-block` (here a custom webhook block pointed at a receiver in this process) a message naming the run.
- The GPU nodes of deployments/prefect.yaml plus one (a test copy of the file, set up as production's is: three
  workers for today's two-node file, three queues of the pool `eyrie-gpu`, whose limit lets them run side by side,
  one shared run folder): the fan-out parent, from the pool `eyrie-control`, splits the regeneration shards, then
  the extraction shards, over the nodes its deployment lists; each node loads its vLLM server once for both stages.
  The second node's worker dies mid-share (its process group and its flow-run process, SIGKILL): its run stays
  Running until the zombie automation marks it Crashed (the copy's heartbeat window: 120 s), which
  fails the parent. The worker comes back (as systemd restarts it); the parent's retry sends out only the shards
  that node left, and the Prefect server is stopped and started again on its database while a node's extraction
  share runs: the share, the parent and the workers carry on. Then the parent runs the pipeline deployment on the
  first node, which finds regeneration and extraction done (no server for them) and trains, exports and evaluates.
- A flow run cancelled through the API stops its server and its trainer; a crashed one keeps its server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, register_server_folder, stop_server, write_config
from prefect_server import running_prefect_server, server_env

from deployments.setup import PREFECT_FILE, gpu_nodes
from eyrie.run.folder import RunFolder
from eyrie.stages.extract import load_checked, sample_path
from eyrie.stages.prepare import load_dataset_rows, load_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PIPELINE = "eyrie-pipeline/production"
FANOUT = "eyrie-extract-fanout/production"
NODE = "eyrie-extract/node"
CONTROL_POOL = "eyrie-control"  # the fan-out parent's pool; the GPU nodes' queues are in `eyrie-gpu`
FAULTY = "shard-00001"
LAYERS, NUM_LAYERS, HIDDEN = [2, 4, 5], 4, 64  # 3 aux layers + the last layer's output
START = "eyrie: starting vLLM"  # one line in a server log per vLLM start
# The test's copy of prefect.yaml: the declared nodes plus this one, and a short heartbeat window
# (heartbeats every 30 s, its minimum; a run is a zombie after four missed: the restart of the Prefect server below,
# about 40 s, must not crash the runs it interrupts).
EXTRA_NODE = f"test-node-{len(gpu_nodes()) + 1}"
HEARTBEAT_S, ZOMBIE_S = 30, 120
LEASE_STORAGE = "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"


OUTAGE_S = 20  # the Prefect server stopped and down this long (its own start-up, ~10-20 s here, comes on top)


def production_file(root: Path) -> Path:
    """deployments/prefect.yaml with EXTRA_NODE added to `definitions.gpu_nodes` (one line, as an operator adds a
    node) and the heartbeat window above; every node-derived thing (queues, pool limit, the fan-out's `queues`)
    follows from the list."""
    import re

    text, nodes = PREFECT_FILE.read_text(), gpu_nodes()
    last = f"    - {nodes[-1]}\n"
    assert text.count(last) == 1
    text = text.replace(last, last + f"    - {EXTRA_NODE}\n")
    text, n_freq = re.subn(r'(PREFECT_FLOWS_HEARTBEAT_FREQUENCY: )"\d+"', rf'\g<1>"{HEARTBEAT_S}"', text)
    text, n_window = re.subn(r"^(  zombie_after_s: )\d+$", rf"\g<1>{ZOMBIE_S}", text, flags=re.M)
    assert n_freq == n_window == 1, (n_freq, n_window)
    path = root / "prefect.yaml"
    path.write_text(text)
    assert gpu_nodes(path) == [*nodes, EXTRA_NODE]
    return path


class Production:
    """The server, setup done, and the workers started so far (one per queue)."""

    def __init__(self, server, postgres, root: Path, prefect_file: Path):
        import yaml

        self.server, self.postgres, self.root = server, postgres, root
        self.nodes = gpu_nodes(prefect_file)
        # What the flow runs get from the deployments (heartbeats, client retries); the worker's unit sets the same.
        definitions = yaml.safe_load(prefect_file.read_text())["definitions"]
        self.job_env = {k: str(v) for k, v in definitions["work_pool"]["job_variables"]["env"].items()}
        self.workers: dict[str, subprocess.Popen] = {}
        self.server_folders: list[Path] = []

    def worker(self, queue: str, node: str | None, **env: str) -> subprocess.Popen:
        """A process worker on `queue` as infra/eyrie-worker.service runs it (EYRIE_NODE_NAME=`node`); the one
        already running on that queue, if any, whatever its `env`. `control` is in the pool `eyrie-control`, the
        GPU nodes' queues in `eyrie-gpu`."""
        if queue in self.workers:
            return self.workers[queue]
        extra = {"EYRIE_HOME": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "2", **self.job_env, **env}
        if node:
            extra["EYRIE_NODE_NAME"] = node
        home = self.root / f"worker-{queue}"
        home.mkdir(exist_ok=True)  # a worker started again after `kill_node` keeps its home and its log
        log = open(self.root / f"worker-{queue}.log", "ab")
        # Started elsewhere than the checkout: the deployment's pull step must change into $EYRIE_HOME. Its own
        # session, so that stopping it also stops its flow-run processes (vLLM servers have sessions of their own).
        pool = CONTROL_POOL if queue == "control" else "eyrie-gpu"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefect",
                "worker",
                "start",
                "--pool",
                pool,
                "--work-queue",
                queue,
                "--limit",
                "1",
                "--type",
                "process",
                "--name",
                queue,
                "--no-create-pool-if-not-found",
                "--install-policy",
                "never",
            ],
            cwd=home,
            env=self.server.client_env(home, **extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.workers[queue] = proc
        return proc

    def kill_node(self, queue: str) -> list[int]:
        """The node's worker dies as a node going down takes it: SIGKILL to its process group (the worker and the
        flow-run processes it started) and to each flow-run process's own group, if it leads one. Nothing reports
        the runs' end: they stay Running until the zombie automation marks them Crashed. The node's vLLM server,
        in a session of its own, stays up (as under the unit's KillMode=process). Returns the flow-run pids."""
        import psutil

        proc = self.workers.pop(queue)
        runs = psutil.Process(proc.pid).children()
        for pgid in {proc.pid, *(r.pid for r in runs if os.getpgid(r.pid) == r.pid)}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(runs, timeout=30)  # a SIGKILLed process is gone once the kernel has reaped it
        assert not alive, alive
        return [r.pid for r in runs]

    def restart_server(self, down_s: float) -> float:
        """The Prefect server stopped (SIGTERM to its group, SIGKILL after 15 s) and, `down_s` after the stop began,
        started again on the same port and PostgreSQL database; returns how long the API was away."""
        server, t0 = self.server, time.monotonic()
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, sig)
            try:
                server.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                pass
        (self.root / "server-before-restart.log").write_bytes(server.log.read_bytes())
        time.sleep(max(0.0, down_s - (time.monotonic() - t0)))
        server.start()
        return time.monotonic() - t0

    def wait_idle(self, queue: str, timeout_s: float = 120) -> None:
        """Until the worker on `queue` has reaped its flow-run process. A run retried before that comes back to the
        worker while it still holds the run's slot: Prefect 3.7.7's worker then dies ("this borrower is already
        holding one of this CapacityLimiter's tokens"), and the Crashed state it proposes for a non-zero exit could
        land on the retried run."""
        import psutil

        worker = psutil.Process(self.workers[queue].pid)
        deadline = time.monotonic() + timeout_s
        while worker.children():
            assert time.monotonic() < deadline, f"the worker on {queue} still runs a flow run\n{self.logs()}"
            time.sleep(0.5)
        time.sleep(3)  # then it proposes that state (refused: the run is final) and frees the slot

    def node_folder(self, run: Path, node: str) -> Path:
        folder = run / "extract" / "nodes" / node
        self.server_folders.append(register_server_folder(folder))
        return folder

    def logs(self) -> str:
        return "\n".join(
            f"--- worker {q}:\n" + (self.root / f"worker-{q}.log").read_text(errors="replace")[-3000:]
            for q in self.workers
        )

    def stop(self) -> None:
        import psutil

        # Flow-run processes that lead process groups of their own (flows/cancel.py) are not in their worker's group.
        for proc in self.workers.values():
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
        # Every worker is asked at once and given 20 s together (one after another, three took a minute).
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, None)):
            for proc in self.workers.values():
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = None if wait_s is None else time.monotonic() + wait_s
            for proc in self.workers.values():
                try:
                    proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for folder in self.server_folders:
            stop_server(folder)


class Webhook:
    """An HTTP receiver on a loopback port: the operator's chat channel, as a notification block reaches it."""

    def __init__(self):
        import http.server
        import threading

        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                received.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait_for(self, text: str, timeout_s: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not any(text in m for m in self.received):
            time.sleep(1)
        return [m for m in self.received if text in m]


NOTIFY_BLOCK = "custom-webhook/eyrie-oncall"


def _save_webhook_block(env: dict, url: str) -> None:
    """The operator's block, saved on the server as an operator saves one (a client process of its own)."""
    code = (
        "import sys; from prefect.blocks.notifications import CustomWebhookNotificationBlock as B; "
        "B(name='eyrie-oncall', url=sys.argv[1], json_data={'subject': '{{subject}}', 'body': '{{body}}'})"
        ".save('eyrie-oncall', overwrite=True)"
    )
    proc = subprocess.run([sys.executable, "-c", code, url], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def webhook():
    hook = Webhook()
    yield hook
    hook.httpd.shutdown()


@pytest.fixture(scope="module")
def prod(postgres, tmp_path_factory, webhook):
    root = tmp_path_factory.mktemp("production")
    prefect_file = production_file(root)
    # The server as infra/docker-compose.yml runs it: leases of deployment concurrency limits on disk, so that they
    # survive the server's restart (in memory, the restart ends every running run of a limited deployment).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LEASE_STORAGE, server_env(LEASE_STORAGE))  # the server's environment comes from this process's
        with running_prefect_server(postgres, root / "server", "eyrie_production") as server:
            t0 = time.monotonic()
            _save_webhook_block(server.client_env(root / "setup-home"), webhook.url)
            setup = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "deployments.setup",
                    "--notify-block",
                    NOTIFY_BLOCK,
                    "--prefect-file",
                    str(prefect_file),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                env=server.client_env(root / "setup-home"),
                timeout=300,
            )
            assert setup.returncode == 0, f"deployments.setup failed:\n{setup.stdout}\n{setup.stderr}"
            print(f"\nserver + setup ready; setup took {time.monotonic() - t0:.0f}s")
            p = Production(server, postgres, root, prefect_file)
            try:
                yield p
            finally:
                p.stop()


def _api(prod: Production, coro_fn):
    async def go():
        async with prod.server.client() as client:
            return await coro_fn(client)

    return asyncio.run(go())


def create_run(prod: Production, deployment: str, parameters: dict):
    async def go(c):
        d = await c.read_deployment_by_name(deployment)
        return await c.create_flow_run_from_deployment(d.id, parameters=parameters)

    return _api(prod, go)


def wait_final(prod: Production, flow_run_id, timeout_s: float = 600):
    from prefect.exceptions import PrefectHTTPStatusError

    async def go(c):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                fr = await c.read_flow_run(flow_run_id)
            except PrefectHTTPStatusError as e:  # a busy server's 5xx: the test's poll asks again, as a UI would
                if e.response.status_code < 500:
                    raise
                print(f"poll of {flow_run_id}: {e.response.status_code}\n{prod.server.errors()}")
                await asyncio.sleep(2)
                continue
            if fr.state and fr.state.is_final():
                return fr
            await asyncio.sleep(2)
        return None

    fr = _api(prod, go)
    assert fr is not None, f"flow run {flow_run_id} not final after {timeout_s:.0f}s\n{prod.logs()}"
    return fr


def wait_heartbeat(prod: Production, flow_run_id, timeout_s: float = 300) -> None:
    """Until the server has recorded a heartbeat of `flow_run_id` (its events, as the automations see them)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    wanted = EventFilter(
        event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
    )

    async def go(c):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (await c.read_events(wanted, limit=1)).events:
                return True
            await asyncio.sleep(1)
        return False

    assert _api(prod, go), f"no heartbeat of flow run {flow_run_id} within {timeout_s:.0f}s\n{prod.logs()}"


def children(prod: Production, flow_run_id) -> list:
    """Subflow runs and deployment runs started from `flow_run_id`, oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    return _api(
        prod,
        lambda c: c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])),
            sort=FlowRunSort.START_TIME_ASC,
        ),
    )


def shard_task_states(
    prod: Production, flow_run_id, stage: str, expected: set[str], wait_s: float = 60
) -> dict[str, str]:
    """{shard: state name} of the `<stage>-shard-*` task runs (stage: "extract", "regenerate") of one flow run.
    Task-run states reach the database through the server's event pipeline, so they may lag the flow run's end a
    little: wait until the expected shards are there and each is final."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + wait_s
    while True:
        runs = _api(
            prod, lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        )
        states = {t.name.removeprefix(f"{stage}-"): t.state for t in runs if t.name.startswith(f"{stage}-shard-")}
        if (
            set(states) == expected and all(st and st.is_final() for st in states.values())
        ) or time.monotonic() > deadline:
            return {k: (st.name if st else None) for k, st in states.items()}
        time.sleep(1)


def file_ids(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def check_samples(run: Path, data: str = "prepare") -> int:
    """Exactly one valid file per sample of the stage folder `data` (what extraction read); returns the number of
    samples."""
    rf = RunFolder(run)
    source = rf.stage(data)
    shards = load_shards(source)
    assert sorted(p.name for p in rf.hidden_states.iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(shards[-1].stop)
    )
    for shard in shards:
        for offset, ids in enumerate(load_dataset_rows(source, shard.start, shard.stop)):
            load_checked(sample_path(rf.hidden_states, shard.start + offset), ids, NUM_LAYERS, HIDDEN)
    return shards[-1].stop


def starts(folder: Path) -> int:
    log = folder / "server.log"
    return log.read_text(errors="replace").count(START) if log.exists() else 0


def test_a_failed_shard_is_retried_alone_by_retrying_the_flow_run(prod, webhook, tiny_llama, tmp_path):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import State

    t0 = time.monotonic()
    armed = prod.root / "fault-armed"
    armed.touch()
    # The fault is in the worker's environment, so in every flow-run process it starts; the file arms it.
    first_node = prod.nodes[0]
    prod.worker(first_node, first_node, EYRIE_FAULTS=f"extract.{FAULTY}=raise", EYRIE_FAULTS_WHILE=str(armed))
    run = prod.root / "runs" / "retry"
    node_dir = prod.node_folder(run, first_node)
    _, config = write_config(
        tmp_path / "config.yaml", tiny_llama, max_samples=32, shard_size=8, layer_ids=LAYERS, name="retry"
    )
    created = create_run(
        prod, PIPELINE, {"config": config.model_dump(mode="json"), "run_dir": str(run), "until": "extract"}
    )

    first = wait_final(prod, created.id)
    t_first = time.monotonic() - t0
    assert first.state.type == StateType.FAILED, f"{first.state}\n{prod.logs()}"
    assert f"shard-00001: fault injected at extract.{FAULTY}" in first.state.message, first.state.message
    rf = RunFolder(run)
    shard_names = [s.name for s in load_shards(rf.prepare)]
    assert len(shard_names) == 4 and FAULTY in shard_names
    done = {p.stem: file_ids(p) for p in rf.shard_manifests.glob("*.json")}
    assert sorted(done) == [s for s in shard_names if s != FAULTY]  # every other shard finished
    (sub1,) = children(prod, created.id)
    states1 = shard_task_states(prod, sub1.id, "extract", set(shard_names))
    assert states1 == {s: ("Failed" if s == FAULTY else "Completed") for s in shard_names}, states1
    assert (node_dir / "server.json").exists()  # kept up after the failure, for the retry
    # The operator heard of it, with the run's name and state, through the block setup was given.
    (message,) = webhook.wait_for(first.name)
    assert "Failed" in message and "fault injected" in message, message

    prod.wait_idle(first_node)  # an operator's retry comes minutes later; this one would come within seconds
    # The operator's fix, then the UI's Retry button: Prefect 3.7's UI (ui/ FlowRun page, `retryFlowRun`) posts
    # /flow_runs/{id}/set_state with {"state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message":
    # "Retry from the UI"}, "force": false}. The same flow run goes back to its queue and the worker runs it again.
    armed.unlink()
    result = _api(
        prod,
        lambda c: c.set_flow_run_state(
            created.id, State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI"), force=False
        ),
    )
    assert result.status == SetStateStatus.ACCEPT, result
    t1 = time.monotonic()
    retried = wait_final(prod, created.id)
    t_retry = time.monotonic() - t1
    assert retried.state.type == StateType.COMPLETED, f"{retried.state}\n{prod.logs()}"
    assert retried.id == created.id and retried.run_count == 2

    # Through the API: in the retried run's extraction, only the failed shard ran; the finished ones were not even
    # submitted (flows/sharded.py submits the pending shards only; their manifests on disk say they are done).
    sub1_again, sub2 = children(prod, created.id)
    assert sub1_again.id == sub1.id and sub2.state.type == StateType.COMPLETED
    states2 = shard_task_states(prod, sub2.id, "extract", {FAULTY})
    assert states2 == {FAULTY: "Completed"}, states2

    # On disk: the other shards' manifests were not rewritten; every sample is there and valid; the kept server
    # was reused (one vLLM start in all) and stopped at the end.
    for name, ids in done.items():
        assert file_ids(rf.shard_manifests / f"{name}.json") == ids, f"{name} was rewritten"
    assert (rf.shard_manifests / f"{FAULTY}.json").exists()
    n = check_samples(run)
    assert starts(node_dir) == 1 and not (node_dir / "server.json").exists()

    # Secrets: the database password and the Prefect credential (also as the Basic header's base64) are in no
    # flow-run log, no artifact and no file of the run folder.
    secrets = [prod.postgres.password, prod.server.auth, base64.b64encode(prod.server.auth.encode()).decode()]
    run_ids = [created.id, sub1.id, sub2.id]

    async def logs_and_artifacts(c):
        logs, offset = [], 0
        while batch := await c.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=run_ids)), limit=200, offset=offset
        ):
            logs += batch
            offset += len(batch)
        arts = await c.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=run_ids)))
        return logs, arts

    logs, artifacts = _api(prod, logs_and_artifacts)
    # Read what there is: logs, and artifacts (each run's preflight card or its stage's one progress artifact).
    assert len(logs) > 20 and len(artifacts) >= len(run_ids)
    texts = [log.message for log in logs] + [a.model_dump_json() for a in artifacts]
    files = [p for p in run.rglob("*") if p.is_file()]
    for secret in secrets:
        assert not [t for t in texts if secret in t], "a secret is in a flow-run log or an artifact"
        assert not [p for p in files if secret.encode() in p.read_bytes()], "a secret is in a file of the run"
    print(
        f"\nfailed run {t_first:.0f}s (incl. worker start and the one vLLM start); retry {t_retry:.0f}s; "
        f"{n} samples; {len(logs)} logs, {len(artifacts)} artifacts, {len(files)} files scanned"
    )


def _shares_in_flight(prod: Production, flow_run_id, prefix: str, n: int, timeout_s: float = 600) -> list:
    """Once all `n` children of `flow_run_id` named `<prefix>...` have started (none Scheduled or Pending: each
    process is past its first contact with the API) and some still run: those Running. A flow-run process whose
    first request finds no server fails at once (Prefect retries a refused connection only on a client that has
    connected before), so a server restart is tested on runs already going."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = [k for k in children(prod, flow_run_id) if k.name.startswith(prefix)]
        started = len(kids) == n and all(k.state.is_running() or k.state.is_final() for k in kids)
        if started and (running := [k for k in kids if k.state.is_running()]):
            return running
        assert not started, f"every {prefix}* run of {flow_run_id} ended before the restart: {kids}"
        parent = _api(prod, lambda c: c.read_flow_run(flow_run_id))
        assert not parent.state.is_final(), f"{parent.state}: {parent.state.message}\n{prod.logs()}"
        time.sleep(0.5)
    raise AssertionError(
        f"the {prefix}* runs of {flow_run_id} did not all start within {timeout_s:.0f}s\n{prod.logs()}"
    )


# Before the fan-out test: its Prefect server restart can leave a worker deaf to Cancel (Prefect 3.7's worker gives
# up its cancellation polling during an outage: docs/operations/prefect-server.md), and this test is of Cancel on a
# healthy pool.
def test_a_cancelled_run_stops_its_server_and_trainer_a_crashed_one_keeps_its_server(prod):
    """Cancelled from the UI (its state set to Cancelling through the API, as the UI's Cancel does): the worker kills
    the flow's process, and the flow's on_cancellation hook stops the server recorded in the run folder and the
    trainer's process group, ranks included. Crashed (its process killed): the server stays up for the retry."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    from eyrie.vllm.process import VllmServer, _alive

    queue = prod.nodes[0]
    prod.worker(queue, queue)
    deployment = _deploy_probe(prod, queue)
    for how in ("cancel", "crash"):
        run = prod.root / "runs" / f"probe-{how}"
        prod.server_folders.append(register_server_folder(run / "extract"))
        params = {"run_dir": str(run)}
        created = _api(prod, lambda c, p=params: c.create_flow_run_from_deployment(deployment, parameters=p))
        t0 = time.monotonic()
        pids = _wait_file(run / "probe.json", prod)
        try:
            assert all(_alive(p) for p in pids.values()), pids
            assert os.getpgid(pids["trainer"]) == os.getpgid(pids["rank"]) == pids["flow"]  # the flow's own group
            if how == "cancel":
                _api(prod, lambda c, i=created.id: c.set_flow_run_state(i, Cancelling(message="Cancel from the UI")))
                final = wait_final(prod, created.id, timeout_s=120)
                assert final.state.type == StateType.CANCELLED, f"{final.state}\n{prod.logs()}"
                assert _gone(list(pids.values())) == [], f"left running after the cancel: {pids}\n{prod.logs()}"
                assert not (run / "extract" / "server.json").exists()
                assert not (run / "flow-runs" / f"{created.id}.json").exists()
                print(
                    f"\ncancelled: server, trainer and rank gone {time.monotonic() - t0:.0f}s after the probe started"
                )
            else:
                os.kill(pids["flow"], signal.SIGKILL)  # the node's flow process dies: no hook runs
                final = wait_final(prod, created.id, timeout_s=120)
                assert final.state.type == StateType.CRASHED, f"{final.state}\n{prod.logs()}"
                assert _alive(pids["server"]) and VllmServer(run / "extract").state["pid"] == pids["server"]
                assert _gone([pids["trainer"]]) == []  # SIGTERM with its parent's death; the retry resumes it
        finally:  # what a failed check left: the probe's "rank" (torchrun's are sent the SIGTERM on), its server
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pids["flow"], signal.SIGKILL)
            VllmServer(run / "extract").stop(log=lambda *_: None)
        prod.wait_idle(queue)


def test_fanout_over_the_nodes_a_dead_worker_and_a_server_restart(prod, tiny_llama, tmp_path):
    """Regeneration and extraction spread over every node of the (test copy of the) node list, each node's target
    loaded once for both stages. The second node's worker is killed, with its flow-run process, while its share waits
    for its server: the run stays Running until the zombie automation marks it Crashed (missing heartbeats), and the
    parent fails naming its shards. The worker comes back; the UI's Retry of the parent sends out only the shards it
    left, and the nodes' servers (kept up, the dead node's outliving its worker) are reused. The Prefect server is
    restarted while a node's extraction share runs: that share, the parent and the workers carry on through the
    outage. Then the parent runs the pipeline deployment on the first node: it regenerates and extracts nothing (no
    server for them), trains (1 epoch), exports and evaluates; the parent reports its outcome."""
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import State

    t0 = time.monotonic()
    queues = prod.nodes
    dead = queues[1]
    for q in queues:
        prod.worker(q, q)  # the first node's is the previous tests', when they ran (its fault is disarmed by then)
    prod.worker("control", None)
    run = prod.root / "runs" / "fanout"
    nodes = {q: prod.node_folder(run, q) for q in queues}
    _, config = write_config(
        tmp_path / "config.yaml",
        tiny_llama,
        max_samples=16,  # 4 shards of 4, round robin over the nodes: the dead node's share is one or two of them
        shard_size=4,
        layer_ids=LAYERS,
        name="fanout",
        regenerate={"enabled": True, "concurrency": 4, "max_tokens": 16},
        data={"eval_fraction": 0.25},  # a few held-out prompts beside the 16 training rows
        train={"epochs": 1},
        evaluate={"num_prompts": 2, "max_tokens": 16},
    )
    # No `queues`: the deployment's default, the node list (`*gpu_nodes`).
    created = create_run(prod, FANOUT, {"config": config.model_dump(mode="json"), "run_dir": str(run)})
    # Mid-share: the dead node's share has launched its server, and the server has its run's first heartbeat (the
    # zombie automation's window opens at a heartbeat: a run killed before one arrived would stay Running).
    deadline = time.monotonic() + 600
    while starts(nodes[dead]) == 0:
        assert time.monotonic() < deadline, f"{dead} started no server\n{prod.logs()}"
        time.sleep(0.5)
    wait_heartbeat(prod, next(k.id for k in children(prod, created.id) if k.work_queue_name == dead))
    killed = prod.kill_node(dead)
    t_kill = time.monotonic()
    assert killed, f"{dead}'s worker ran no flow run"
    first = wait_final(prod, created.id)
    t_first, t_crashed = time.monotonic() - t0, time.monotonic() - t_kill
    assert first.state.type == StateType.FAILED, f"{first.state}\n{prod.logs()}"
    msg = first.state.message
    assert f"fanout-regenerate-{dead}" in msg and "Crashed" in msg and "missing heartbeats" in msg, first.state
    assert first.work_pool_name == CONTROL_POOL and first.work_queue_name == "control"
    rf = RunFolder(run)
    shard_names = {s.name for s in load_shards(rf.prepare)}
    kids1 = children(prod, created.id)
    by_queue = {k.work_queue_name: k for k in kids1}
    assert sorted(by_queue) == sorted(queues) and {k.work_pool_name for k in kids1} == {"eyrie-gpu"}
    assert {q: k.state.type for q, k in by_queue.items()} == {
        q: StateType.CRASHED if q == dead else StateType.COMPLETED for q in queues
    }
    # The GPU pool's limit (one run per node) let every node's run overlap the others: the fan-out was not serialised.
    assert max(k.start_time for k in kids1) < min(k.end_time for k in kids1), [
        (str(k.start_time), str(k.end_time)) for k in kids1
    ]
    shares1 = {q: set(k.parameters["shards"]) for q, k in by_queue.items()}
    assert sum(map(len, shares1.values())) == len(shard_names) and set().union(*shares1.values()) == shard_names
    done = {p.stem for p in (run / "regenerate" / "shards").glob("*.json")}
    left = shard_names - done
    assert left == shares1[dead], (done, shares1)  # killed before its first shard: all of its share is left
    for q in queues:
        if q != dead:
            assert shard_task_states(prod, by_queue[q].id, "regenerate", shares1[q]) == dict.fromkeys(
                shares1[q], "Completed"
            )
    # Every server is up: the live nodes' kept for their extraction shares, the dead node's outliving its worker.
    assert all((folder / "server.json").exists() for folder in nodes.values())

    # The node's worker comes back (systemd's Restart=always, 10 s later), then the UI's Retry of the parent.
    prod.worker(dead, dead)
    prod.wait_idle("control")
    result = _api(
        prod,
        lambda c: c.set_flow_run_state(
            created.id, State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI"), force=False
        ),
    )
    assert result.status == SetStateStatus.ACCEPT, result
    t1 = time.monotonic()
    # The Prefect server goes away while a node's extraction share runs, and comes back on the same database.
    in_flight = _shares_in_flight(prod, created.id, "fanout-extract-", len(queues))
    t_outage = prod.restart_server(OUTAGE_S)
    parent = wait_final(prod, created.id, timeout_s=900)  # the retry goes on through train and evaluate
    t_retry = time.monotonic() - t1
    assert parent.state.type == StateType.COMPLETED, f"{parent.state}\n{prod.logs()}"
    assert parent.run_count == 2  # the first run and the UI's retry: the outage cost no run
    assert all(w.poll() is None for w in prod.workers.values()), f"a worker died in the outage\n{prod.logs()}"
    kids2 = [k for k in children(prod, created.id) if k.id not in {k1.id for k1 in kids1}]
    regen2 = [k for k in kids2 if k.name.startswith("fanout-regenerate-")]
    extract = [k for k in kids2 if k.name.startswith("fanout-extract-")]
    (pipeline,) = [k for k in kids2 if k.name.startswith("fanout-pipeline-")]
    assert len(regen2) + len(extract) + 1 == len(kids2)
    # The shares that ran through the outage completed in their first run (their task states: below).
    through = [k for k in extract if k.id in {r.id for r in in_flight}]
    assert through and all(k.state.type == StateType.COMPLETED and k.run_count == 1 for k in through), through
    # The retry regenerated only what the dead node left unfinished.
    retried = [s for k in regen2 for s in k.parameters["shards"]]
    assert sorted(retried) == sorted(left), (retried, left)
    for kid in regen2:
        share = set(kid.parameters["shards"])
        assert kid.state.type == StateType.COMPLETED, kid.state
        assert shard_task_states(prod, kid.id, "regenerate", share) == dict.fromkeys(share, "Completed")
    # Extraction: every shard once, over every node (each node's run, its share possibly empty, stops its server).
    assert sorted(k.work_queue_name for k in extract) == sorted(queues)
    shares = {}
    for kid in extract:
        assert kid.state.type == StateType.COMPLETED, kid.state
        share = set(kid.parameters["shards"])
        assert shard_task_states(prod, kid.id, "extract", share) == dict.fromkeys(share, "Completed")
        shares[kid.work_queue_name] = share
    assert sum(map(len, shares.values())) == len(set().union(*shares.values()))  # no shard twice
    assert set().union(*shares.values()) == {s.name for s in load_shards(rf.stage("regenerate"))}, shares
    # Each node started its own server once, in its own folder, for both stages and the retry; stopped at the end.
    for queue, folder in nodes.items():
        assert starts(folder) == 1, f"{queue}: {starts(folder)} vLLM starts"
        assert not (folder / "server.json").exists()
    assert not (run / "extract" / "server.json").exists()  # no single-node server was involved
    assert (run / "regenerate" / "manifest.json").exists()
    assert sorted(p.stem for p in rf.shard_manifests.glob("*.json")) == sorted(set().union(*shares.values()))
    n = check_samples(run, "regenerate")
    # The rest of the pipeline: one run of the pipeline's deployment on the first node, after every share ended.
    assert pipeline.state.type == StateType.COMPLETED, pipeline.state
    assert pipeline.deployment_id == _api(prod, lambda c: c.read_deployment_by_name(PIPELINE)).id
    assert pipeline.work_queue_name == queues[0] and pipeline.parameters["until"] == "evaluate"
    assert pipeline.start_time >= max(k.end_time for k in regen2 + extract)
    assert parent.state.is_completed() and parent.end_time >= pipeline.end_time
    # It found regeneration and extraction done: it started no server for them (none in the single-node folder,
    # still one start per node), ran no shard and rewrote nothing they had written.
    assert not (run / "extract" / "server.log").exists()
    assert all(starts(folder) == 1 for folder in nodes.values())
    for sub in children(prod, pipeline.id):
        for stage in ("regenerate", "extract"):
            assert shard_task_states(prod, sub.id, stage, set()) == {}, (sub.name, stage)
    started = pipeline.start_time.timestamp()
    written = [*(run / "regenerate").glob("shards/*.json"), run / "regenerate" / "manifest.json"]
    written += [*rf.shard_manifests.glob("*.json"), *rf.hidden_states.iterdir()]
    assert [p.name for p in written if p.stat().st_mtime >= started] == []
    for done_file in ("train/manifest.json", "export/manifest.json", "evaluate/trained.json"):
        assert (run / done_file).stat().st_mtime >= started, done_file
    trained = json.loads((run / "evaluate" / "trained.json").read_text())
    t_pipeline = (pipeline.end_time - pipeline.start_time).total_seconds()
    print(
        f"\nfan-out over {len(queues)} nodes: failed run {t_first:.0f}s ({dead}'s worker killed, its run Crashed "
        f"{t_crashed:.0f}s later); retry {t_retry:.0f}s (of which the pipeline run on {queues[0]} {t_pipeline:.0f}s; "
        f"the API away {t_outage:.0f}s while {', '.join(k.name for k in in_flight)} ran); {dead} left {sorted(left)}; "
        f"extraction shares {dict((q, sorted(s)) for q, s in shares.items())}; {n} samples; "
        f"trained drafter's acceptance length {trained['acceptance_length']}"
    )


PROBE = "tests/cancel_probe.py:cancel_probe"  # starts a recorded "server" and a "trainer" with a rank, then waits


def _deploy_probe(prod: Production, queue: str):
    """The probe flow as a deployment of the GPU pool on `queue`, with the pull step Eyrie's deployments have."""

    async def go(c):
        flow_id = await c.create_flow_from_name("eyrie-cancel-probe")
        return await c.create_deployment(
            flow_id,
            "probe",
            work_pool_name="eyrie-gpu",
            work_queue_name=queue,
            entrypoint=PROBE,
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}],
        )

    return _api(prod, go)


def _wait_file(path: Path, prod: Production, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written within {timeout_s:.0f}s\n{prod.logs()}"
        time.sleep(0.5)
    return json.loads(path.read_text())


def _gone(pids: list[int], timeout_s: float = 30) -> list[int]:
    from eyrie.vllm.process import _alive

    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
