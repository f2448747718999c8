"""Eyrie on a production-like Prefect: PostgreSQL, `prefect server start` with authentication, `python -m
deployments.setup`, real process workers on the GPU nodes' queues, and flow runs of the deployments (tiny-llama on
vLLM's CPU build).

- A pipeline run (until extract) fails on one shard by injected fault. After the operator's fix, the same flow run
  is retried as the UI's Retry button does it: only the failed shard runs again (the others are not submitted),
  nothing finished is rewritten, and neither the database password nor the Prefect credential is in any log, artifact or
  file of the run.
- The operator hears of the failure: setup's "Eyrie GPU run failed" automation sends the notification block given
  with `--notify-block` (here a custom webhook block pointed at a receiver in this process) a message naming the run.
- Two GPU nodes (two workers, two queues of the pool `eyrie-gpu`, whose limit of 2 lets them run side by side, one
  shared run folder): the fan-out parent, from the pool `eyrie-control`, splits the regeneration shards, then the
  extraction shards, over them; each node loads its vLLM server once for both stages. Node 2's process dies
  mid-share: the parent's retry sends out only the shards it left, then runs the pipeline deployment on node 1,
  which finds regeneration and extraction done (no server for them) and trains, exports and evaluates.
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
from prefect_server import running_prefect_server

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


class Production:
    """The server, setup done, and the workers started so far (one per queue)."""

    def __init__(self, server, postgres, root: Path):
        self.server, self.postgres, self.root = server, postgres, root
        self.workers: dict[str, subprocess.Popen] = {}
        self.server_folders: list[Path] = []

    def worker(self, queue: str, node: str | None, **env: str) -> subprocess.Popen:
        """A process worker on `queue` as infra/eyrie-worker.service runs it (EYRIE_NODE_NAME=`node`); the one
        already running on that queue, if any, whatever its `env`. `control` is in the pool `eyrie-control`, the
        GPU nodes' queues in `eyrie-gpu`."""
        if queue in self.workers:
            return self.workers[queue]
        extra = {"EYRIE_HOME": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "2", **env}
        if node:
            extra["EYRIE_NODE_NAME"] = node
        home = self.root / f"worker-{queue}"
        home.mkdir()
        log = open(self.root / f"worker-{queue}.log", "wb")
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
    with running_prefect_server(postgres, root / "server", "eyrie_production") as server:
        t0 = time.monotonic()
        _save_webhook_block(server.client_env(root / "setup-home"), webhook.url)
        setup = subprocess.run(
            [sys.executable, "-m", "deployments.setup", "--notify-block", NOTIFY_BLOCK],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=server.client_env(root / "setup-home"),
            timeout=300,
        )
        assert setup.returncode == 0, f"deployments.setup failed:\n{setup.stdout}\n{setup.stderr}"
        print(f"\nserver + setup ready; setup took {time.monotonic() - t0:.0f}s")
        p = Production(server, postgres, root)
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
    async def go(c):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fr = await c.read_flow_run(flow_run_id)
            if fr.state and fr.state.is_final():
                return fr
            await asyncio.sleep(2)
        return None

    fr = _api(prod, go)
    assert fr is not None, f"flow run {flow_run_id} not final after {timeout_s:.0f}s\n{prod.logs()}"
    return fr


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


def extract_task_states(prod: Production, flow_run_id, expected: set[str], wait_s: float = 60) -> dict[str, str]:
    """{shard: state name} of the extract task runs of one flow run. Task-run states reach the database through
    the server's event pipeline, so they may lag the flow run's end a little: wait until each is final."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + wait_s
    while True:
        runs = _api(
            prod, lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        )
        states = {t.name.removeprefix("extract-"): t.state for t in runs if t.name.startswith("extract-shard-")}
        if (
            set(states) == expected and all(s and s.is_final() for s in states.values())
        ) or time.monotonic() > deadline:
            return {k: (s.name if s else None) for k, s in states.items()}
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
    prod.worker("gpu-node-1", "node-1", EYRIE_FAULTS=f"extract.{FAULTY}=raise", EYRIE_FAULTS_WHILE=str(armed))
    run = prod.root / "runs" / "retry"
    node_dir = prod.node_folder(run, "node-1")
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
    states1 = extract_task_states(prod, sub1.id, set(shard_names))
    assert states1 == {s: ("Failed" if s == FAULTY else "Completed") for s in shard_names}, states1
    assert (node_dir / "server.json").exists()  # kept up after the failure, for the retry
    # The operator heard of it, with the run's name and state, through the block setup was given.
    (message,) = webhook.wait_for(first.name)
    assert "Failed" in message and "fault injected" in message, message

    prod.wait_idle("gpu-node-1")  # an operator's retry comes minutes later; this one would come within seconds
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
    states2 = extract_task_states(prod, sub2.id, {FAULTY})
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
    assert len(logs) > 20 and len(artifacts) >= len(shard_names)  # read what there is: logs and progress artifacts
    texts = [log.message for log in logs] + [a.model_dump_json() for a in artifacts]
    files = [p for p in run.rglob("*") if p.is_file()]
    for secret in secrets:
        assert not [t for t in texts if secret in t], "a secret is in a flow-run log or an artifact"
        assert not [p for p in files if secret.encode() in p.read_bytes()], "a secret is in a file of the run"
    print(
        f"\nfailed run {t_first:.0f}s (incl. worker start and the one vLLM start); retry {t_retry:.0f}s; "
        f"{n} samples; {len(logs)} logs, {len(artifacts)} artifacts, {len(files)} files scanned"
    )


def shard_task_states(prod: Production, flow_run_id, stage: str, expected: set[str]) -> dict[str, str]:
    if stage == "extract":
        return extract_task_states(prod, flow_run_id, expected)
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + 60
    while True:
        runs = _api(
            prod, lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        )
        states = {t.name.removeprefix("regenerate-"): t.state for t in runs if t.name.startswith("regenerate-shard-")}
        if (
            set(states) == expected and all(st and st.is_final() for st in states.values())
        ) or time.monotonic() > deadline:
            return {k: (st.name if st else None) for k, st in states.items()}
        time.sleep(1)


def test_fanout_runs_the_pipeline_over_two_nodes_a_dead_nodes_shards_retried_alone(prod, tiny_llama, tmp_path):
    """Regeneration and extraction spread over two nodes, each node's target loaded once for both stages. Node 2's
    flow process dies mid-share (SIGKILL, by fault point): the parent fails naming its shards; the UI's Retry of the
    parent sends out only the shards it left unfinished, and the nodes' servers (kept up, node 2's outliving its
    process) are reused. Then the parent runs the pipeline deployment on node 1: it regenerates and extracts
    nothing (no server for them), trains (1 epoch), exports and evaluates; the parent reports its outcome."""
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import State

    t0 = time.monotonic()
    armed = prod.root / "fanout-fault-armed"
    armed.touch()
    prod.worker("gpu-node-1", "node-1")  # the previous test's, when it ran (its fault is disarmed by then)
    # Node 2 gets shards 1 and 3 (round robin); its process is killed as shard 3 starts.
    prod.worker("gpu-node-2", "node-2", EYRIE_FAULTS="regenerate.shard-00003=kill", EYRIE_FAULTS_WHILE=str(armed))
    prod.worker("control", None)
    run = prod.root / "runs" / "fanout"
    nodes = {"gpu-node-1": prod.node_folder(run, "node-1"), "gpu-node-2": prod.node_folder(run, "node-2")}
    _, config = write_config(
        tmp_path / "config.yaml",
        tiny_llama,
        max_samples=16,  # 4 shards of 4: 2 per node, node 2's shard 3 the one killed
        shard_size=4,
        layer_ids=LAYERS,
        name="fanout",
        regenerate={"enabled": True, "concurrency": 4, "max_tokens": 16},
        data={"eval_fraction": 0.25},  # a few held-out prompts beside the 16 training rows
        train={"epochs": 1},
        evaluate={"num_prompts": 2, "max_tokens": 16},
    )
    created = create_run(
        prod, FANOUT, {"config": config.model_dump(mode="json"), "run_dir": str(run), "queues": list(nodes)}
    )
    first = wait_final(prod, created.id)
    t_first = time.monotonic() - t0
    assert first.state.type == StateType.FAILED, f"{first.state}\n{prod.logs()}"
    assert "fanout-regenerate-gpu-node-2" in first.state.message and "Crashed" in first.state.message, first.state
    assert first.work_pool_name == CONTROL_POOL and first.work_queue_name == "control"
    rf = RunFolder(run)
    shard_names = {s.name for s in load_shards(rf.prepare)}
    kids1 = children(prod, created.id)
    by_queue = {k.work_queue_name: k for k in kids1}
    assert sorted(by_queue) == sorted(nodes) and {k.work_pool_name for k in kids1} == {"eyrie-gpu"}
    assert by_queue["gpu-node-1"].state.type == StateType.COMPLETED
    assert by_queue["gpu-node-2"].state.type == StateType.CRASHED
    # The GPU pool's limit (one run per node) let the two nodes' runs overlap: the fan-out was not serialised.
    (s1, e1), (s2, e2) = [(k.start_time, k.end_time) for k in kids1]
    assert s1 < e2 and s2 < e1, (
        f"the node runs did not overlap: {[(str(k.start_time), str(k.end_time)) for k in kids1]}"
    )
    share1, share2 = (set(by_queue[q].parameters["shards"]) for q in nodes)
    assert not share1 & share2 and share1 | share2 == shard_names and "shard-00003" in share2
    done = {p.stem for p in (run / "regenerate" / "shards").glob("*.json")}
    left = shard_names - done
    assert share1 <= done and left and left <= share2, (done, share2)
    assert shard_task_states(prod, by_queue["gpu-node-1"].id, "regenerate", share1) == {s: "Completed" for s in share1}
    # Both servers are up: node 1's kept for its extraction share, node 2's outliving its killed process.
    assert all((folder / "server.json").exists() for folder in nodes.values())

    for q in ("gpu-node-2", "control"):
        prod.wait_idle(q)
    armed.unlink()
    result = _api(
        prod,
        lambda c: c.set_flow_run_state(
            created.id, State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI"), force=False
        ),
    )
    assert result.status == SetStateStatus.ACCEPT, result
    t1 = time.monotonic()
    parent = wait_final(prod, created.id, timeout_s=900)  # the retry goes on through train and evaluate
    t_retry = time.monotonic() - t1
    assert parent.state.type == StateType.COMPLETED, f"{parent.state}\n{prod.logs()}"
    kids2 = [k for k in children(prod, created.id) if k.id not in {k1.id for k1 in kids1}]
    regen2 = [k for k in kids2 if k.name.startswith("fanout-regenerate-")]
    extract = [k for k in kids2 if k.name.startswith("fanout-extract-")]
    (pipeline,) = [k for k in kids2 if k.name.startswith("fanout-pipeline-")]
    assert len(regen2) + len(extract) + 1 == len(kids2)
    # The retry regenerated only what node 2 left unfinished.
    retried = [s for k in regen2 for s in k.parameters["shards"]]
    assert sorted(retried) == sorted(left), (retried, left)
    for kid in regen2:
        share = set(kid.parameters["shards"])
        assert kid.state.type == StateType.COMPLETED, kid.state
        assert shard_task_states(prod, kid.id, "regenerate", share) == {s: "Completed" for s in share}
    # Extraction: every shard once, over both nodes (each node's run, its share possibly empty, stops its server).
    assert sorted(k.work_queue_name for k in extract) == sorted(nodes)
    shares = {}
    for kid in extract:
        assert kid.state.type == StateType.COMPLETED, kid.state
        share = set(kid.parameters["shards"])
        assert extract_task_states(prod, kid.id, share) == {s: "Completed" for s in share}
        shares[kid.work_queue_name] = share
    a, b = shares.values()
    assert not a & b and a | b == {s.name for s in load_shards(rf.stage("regenerate"))}, shares
    # Each node started its own server once, in its own folder, for both stages and the retry; stopped at the end.
    for queue, folder in nodes.items():
        assert starts(folder) == 1, f"{queue}: {starts(folder)} vLLM starts"
        assert not (folder / "server.json").exists()
    assert not (run / "extract" / "server.json").exists()  # no single-node server was involved
    assert (run / "regenerate" / "manifest.json").exists()
    assert sorted(p.stem for p in rf.shard_manifests.glob("*.json")) == sorted(a | b)
    n = check_samples(run, "regenerate")
    # The rest of the pipeline: one run of the pipeline's deployment on the first node, after every share ended.
    assert pipeline.state.type == StateType.COMPLETED, pipeline.state
    assert pipeline.deployment_id == _api(prod, lambda c: c.read_deployment_by_name(PIPELINE)).id
    assert pipeline.work_queue_name == "gpu-node-1" and pipeline.parameters["until"] == "evaluate"
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
        f"\nfan-out over 2 nodes: failed run {t_first:.0f}s, retry {t_retry:.0f}s (of which the pipeline run on "
        f"node 1 {t_pipeline:.0f}s); node 2 left {sorted(left)}; "
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


def test_a_cancelled_run_stops_its_server_and_trainer_a_crashed_one_keeps_its_server(prod):
    """Cancelled from the UI (its state set to Cancelling through the API, as the UI's Cancel does): the worker kills
    the flow's process, and the flow's on_cancellation hook stops the server recorded in the run folder and the
    trainer's process group, ranks included. Crashed (its process killed): the server stays up for the retry."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    from eyrie.vllm.process import VllmServer, _alive

    queue = "gpu-node-1"
    prod.worker(queue, "node-1")
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
