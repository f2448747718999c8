"""Regeneration and extraction over several GPU nodes: one parent flow run spreads each stage's pending shards over
per-node work queues.

Each node's share is a flow run of the `eyrie-regenerate/node` deployment (flows/regenerate.py with `shards=`), then
of `eyrie-extract/node` (flows/extract.py with `shards=`), created with `run_deployment(..., work_queue_name=<the
node's queue>)`, so the node's worker runs it there. The node starts its own vLLM server once for both of its shares,
in `<run>/extract/nodes/<node>/`: its regeneration share leaves it up, its extraction share reuses and stops it. The
parent assembles the regenerated shards once every node is done. All nodes write into the one run folder, on shared
storage, and share Prefect's result storage. A node's run that fails fails the parent, naming its shards; retrying
the parent sends out only the shards still pending (those of the failed node).

The parent opens the run as the pipeline does (flows/opening.py: revisions pinned, staging cleaned, preflight,
prepare), once, under the run folder's lock, which it holds until every node is done. Each node's share locks what
it writes itself (flows/shares.py): a share that outlives a dead parent still keeps every pipeline run, extraction
and retried fan-out off the folder until it ends, and a share whose parent is no longer running does not start.

Then, with `until` past extract (the default: evaluate), the rest of the pipeline runs on the first node in `queues`
as one run of the pipeline's deployment (`eyrie-pipeline/production`, on that node's queue): the parent releases the
run folder's lock once every node's process has let go of its share, and waits for that run. The pipeline finds
prepare, regeneration and extraction done in the run folder (their keys and manifests; it starts no server for them)
and trains on that node with `train.devices` GPUs, exports and evaluates (and promotes). The parent fails when that
run does not complete, naming it and its state. Cancelling the parent cancels the node runs it started that are
still going (`cancel_node_runs`).

The parent's flow run holds one progress artifact per stage over all the nodes' shares ("N of M shards", rows/s,
time left), counted from the manifests the nodes write into the shared run folder (`SharesDone`).

The parent runs from a queue of its own (`control`): on a GPU node's queue it would hold that node's only slot while
waiting for the node's share.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Callable, Iterable
from typing import Literal

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from eyrie.config import PipelineConfig
from eyrie.errors import ExtractionError, EyrieError, RegenerationError
from eyrie.run.folder import RunFolder
from eyrie.run.lock import SHARES_LOCK
from eyrie.stages.extract import ExtractionPlan
from eyrie.stages.extract.manifest import shard_complete
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.prepare import Shard, load_shards
from eyrie.stages.regenerate import RegenerationPlan, extraction_source
from flows.opening import open_run
from flows.regenerate import assemble
from tasks.preflight import preflight_task
from tasks.progress import StageProgress

NODE_DEPLOYMENT = "eyrie-extract/node"
REGENERATE_NODE_DEPLOYMENT = "eyrie-regenerate/node"
PIPELINE_DEPLOYMENT = "eyrie-pipeline/production"
POLL_S = 5.0
SHARES_RELEASE_S = 120.0  # how long a finished node's process may take to exit (and let go of its share's locks)


def split_shards(names: list[str], queues: list[str]) -> dict[str, list[str]]:
    """Round robin: shares differ by at most one shard; a queue left without a shard gets no run."""
    return {q: names[i :: len(queues)] for i, q in enumerate(queues) if names[i :: len(queues)]}


def cancel_node_runs(flow, flow_run, state) -> None:
    """on_cancellation: the node runs (and the pipeline run) this fan-out started that are not final yet are set
    Cancelling, so their workers stop them (their own hooks stop their servers and trainers)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.logging.loggers import flow_run_logger
    from prefect.states import Cancelling

    log = flow_run_logger(flow_run)
    with get_client(sync_client=True) as client:
        kids = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id]))
        )
        for kid in kids:
            if kid.state is None or kid.state.is_final() or kid.state.is_cancelling():
                continue
            client.set_flow_run_state(kid.id, Cancelling(message=f"its fan-out parent {flow_run.name} was cancelled"))
            log.info(f"cancelling {kid.name} ({kid.id}), {kid.state.name} on queue {kid.work_queue_name}")


@flow(name="eyrie-extract-fanout", on_cancellation=[cancel_node_runs])
def extract_fanout_flow(
    config: PipelineConfig,
    run_dir: str,
    queues: list[str],
    until: Literal["extract", "train", "evaluate"] = "evaluate",
    deployment: str = NODE_DEPLOYMENT,
    regenerate_deployment: str = REGENERATE_NODE_DEPLOYMENT,
    pipeline_deployment: str = PIPELINE_DEPLOYMENT,
) -> dict:
    """Regenerate (with regenerate.enabled) and extract `run_dir`'s pending shards on the nodes behind `queues` (one
    work queue per node), and check that every shard is complete; then, with `until` past extract, run the pipeline
    up to `until` on the first node (`pipeline_deployment` on `queues[0]`): train, export, evaluate. `run_dir` must
    be on storage every node mounts at the same path. Each node's server serves both stages: its regeneration share
    leaves it up, its extraction share (an empty one if no shard is left for it) reuses and stops it."""
    log = get_run_logger()
    if not queues or len(set(queues)) != len(queues):
        raise ExtractionError(f"queues {queues}: name each node's work queue once")
    run = RunFolder(run_dir)
    run.ensure()
    serve = until == "evaluate"
    with run.lock() as held:
        # The pipeline's own opening: the nodes get the config with its hub revisions pinned, so they key their
        # shards as the pipeline does. With `serve`, preflight checks export and evaluation too, before any node
        # spends GPU hours.
        # One preflight card per run: the last preflight's (after regeneration, where the nodes regenerate).
        opened = open_run(config, run, serve=serve, card=not config.regenerate.enabled)
        config, report = opened.config, opened.report
        if serve and not opened.prepared["stats"]["rows_eval"]:
            raise EyrieError(
                f"no held-out conversations to evaluate on ({opened.prepared['stats']['rows_read']} rows read, "
                f"data.eval_fraction {config.data.eval_fraction}): raise data.eval_fraction, or pass "
                "until=train or until=extract"
            )
        _check_queues(deployment, queues, log)
        if until != "extract":
            _check_queues(pipeline_deployment, queues[:1], log)
        # The nodes lock what they write themselves (flows/shares.py): a node outlives this process if it dies, and
        # then keeps every other run off the folder until it ends. Opened: let them in.
        held.admit_shares()
        nodes: dict[str, dict] = {}
        kept: list[str] = []  # queues whose node left its server up for its extraction share
        if config.regenerate.enabled:
            plan = RegenerationPlan(config, run, PreflightReport(**report))
            shares = split_shards([s.name for s in plan.pending()], queues)
            params = {"config": config.model_dump(mode="json"), "run_dir": str(run.root), "report": report}
            finished = _fan_out(
                regenerate_deployment,
                "regenerate",
                shares,
                {**params, "keep_server": True},
                log,
                SharesDone(plan.shards, shares, plan.is_complete),
            )
            _check_nodes(finished, shares, RegenerationError)
            nodes["regenerate"] = _node_outcomes(finished, shares)
            kept = list(shares)
            # Read again now the shards ran: the assembly's key counts the rows they lost.
            regenerated = assemble(config.regenerate, run, RegenerationPlan(config, run, PreflightReport(**report)))
            # The disk check again, on the regenerated data's length (seconds; nothing loads).
            report = preflight_task(config, str(run.root), tokens=regenerated["stats"]["tokens"], serve=serve)
        plan = ExtractionPlan(
            config, run, PreflightReport(**report), load_shards(extraction_source(run, config.regenerate))
        )
        rehash = config.extraction.verify_checksums
        shares = split_shards([s.name for s in plan.pending(rehash)], queues)
        for q in kept:
            shares.setdefault(q, [])  # an empty share: the node stops the server it kept up
        params = {"config": config.model_dump(mode="json"), "run_dir": str(run.root), "report": report}

        # A node's shard is done once its manifest holds under the plan's key and its files are there (a stat each,
        # once per shard; nothing is re-hashed from here).
        def written(shard: Shard, plan: ExtractionPlan = plan) -> bool:
            return shard_complete(plan.manifest_path(shard), plan.keys[shard.name], run.hidden_states, False)

        finished = _fan_out(deployment, "extract", shares, params, log, SharesDone(plan.shards, shares, written))
        _check_nodes(finished, shares, ExtractionError)
        missing = [s.name for s in plan.shards if not plan.is_complete(s, rehash)]
        if missing:
            raise ExtractionError(
                f"every node run completed, yet {len(missing)} shards lack a complete manifest "
                f"({', '.join(missing[:10])}): is {run.root} the same shared folder on every node?"
            )
        nodes["extract"] = _node_outcomes(finished, shares)
        if until != "extract":
            # A node's run is final before its process exits and lets go of its share's locks; the pipeline run
            # would find the folder in use.
            _wait_shares_released(run, log)
    outcome = {
        "run_dir": str(run.root),
        "shards": len(plan.shards),
        "hidden_states": str(run.hidden_states),
        "nodes": nodes["extract"],
        **({"regenerate_nodes": nodes["regenerate"]} if "regenerate" in nodes else {}),
    }
    if until == "extract":
        return outcome
    # The rest on the first node, under the pipeline's own lock: it finds every stage so far done.
    log.info(f"train, export, evaluate (until {until}) on {queues[0]}")
    child = run_deployment(
        pipeline_deployment,
        parameters={"config": config.model_dump(mode="json"), "run_dir": str(run.root), "until": until},
        work_queue_name=queues[0],
        flow_run_name=f"{config.name}-pipeline-{queues[0]}",
        timeout=0,
    )
    done = _wait({queues[0]: child}, log)[queues[0]]
    if not done.state.is_completed():
        raise EyrieError(
            f"the pipeline run {done.name} ({done.id}) on queue {queues[0]} did not complete: {done.state.name}: "
            f"{done.state.message}. Retry this flow run: the finished stages are served from the run folder"
        )
    return {**outcome, "pipeline": {"flow_run": str(done.id), "queue": queues[0], "until": until}}


class SharesDone:
    """The parent's own progress over every node's share: one progress artifact ("N of M shards", rows/s, time
    left) on the parent's flow run, counted from the run folder, which every node writes into: a shard is done once
    `done(shard)` holds (its manifest, under the plan's key). Checked at each poll, for the shards not done yet."""

    def __init__(
        self, shards: Iterable[Shard], shares: dict[str, list[str]], done: Callable[[Shard], bool], artifacts=True
    ):
        self.shards = list(shards)
        self.waiting = {name for names in shares.values() for name in names}
        self.done = done
        self.progress: StageProgress | None = None
        self.artifacts = artifacts

    def start(self, stage: str) -> None:
        self.progress = StageProgress(stage, self.shards, set(self.waiting), artifacts=self.artifacts)

    def poll(self) -> None:
        assert self.progress is not None
        for shard in self.shards:
            if shard.name in self.waiting and self.done(shard):
                self.waiting.discard(shard.name)
                self.progress.finish(shard.name)
        self.progress.publish()

    def close(self) -> None:
        if self.progress is not None:
            self.poll()
            self.progress.close()


def _fan_out(
    deployment: str, stage: str, shares: dict[str, list[str]], params: dict, log, done: SharesDone | None = None
) -> dict:
    """One run of `deployment` per queue with its share; waits until every one is final, counting the shards done
    (`done`) meanwhile."""
    log.info(f"{stage}: " + (", ".join(f"{len(names)} shards on {q}" for q, names in shares.items()) or "nothing"))
    name = params["config"]["name"]
    children = {
        q: run_deployment(
            deployment,
            parameters={**params, "shards": names},
            work_queue_name=q,
            flow_run_name=f"{name}-{stage}-{q}",
            timeout=0,
        )
        for q, names in shares.items()
    }
    if done is None:
        return _wait(children, log)
    done.start(stage)
    try:
        return _wait(children, log, done.poll)
    finally:
        done.close()


def _check_nodes(finished: dict, shares: dict[str, list[str]], error: type[EyrieError]) -> None:
    failed = [
        f"{fr.name} ({fr.id}) on queue {q}, shards {', '.join(shares[q]) or 'none'}: {fr.state.name}: "
        f"{fr.state.message}"
        for q, fr in finished.items()
        if not fr.state.is_completed()
    ]
    if failed:
        raise error(
            f"{len(failed)} of {len(finished)} node runs did not complete: "
            + "; ".join(failed)
            + ". Retry this flow run: finished shards are kept and only the rest are sent out."
        )


def _node_outcomes(finished: dict, shares: dict[str, list[str]]) -> dict:
    return {q: {"flow_run": str(fr.id), "shards": shares[q]} for q, fr in finished.items()}


def _check_queues(deployment: str, queues: list[str], log) -> None:
    """Every queue must exist in the deployment's pool: the server would create a missing one, and its share would
    wait there for a worker that never comes."""
    with get_client(sync_client=True) as client:
        pool = client.read_deployment_by_name(deployment).work_pool_name
        known = {q.name: q for q in client.read_work_queues(work_pool_name=pool)}
    missing = [q for q in queues if q not in known]
    if missing:
        raise ExtractionError(
            f"work queues {missing} do not exist in pool {pool!r} (it has {sorted(known)}): pass "
            "the queues of the GPU nodes, or add the node to `definitions.gpu_nodes` in deployments/prefect.yaml, "
            "run `python -m deployments.setup` and start its worker"
        )
    for q in queues:
        if known[q].status is None or known[q].status.value != "READY":
            log.warning(f"no worker has polled queue {q} lately ({known[q].status}): its share waits until one does")


def _wait_shares_released(run: RunFolder, log, timeout_s: float = SHARES_RELEASE_S) -> None:
    """Until no node's process holds a share lock of `run` (the run folder's lock, held, admits them)."""
    deadline = time.monotonic() + timeout_s
    with open(run.root / SHARES_LOCK, "a+") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ExtractionError(
                        f"every node run is final, yet a node's process still holds a share of {run.root} after "
                        f"{timeout_s:.0f}s: find it with `fuser {run.root / SHARES_LOCK}` and let it end, then "
                        "retry this flow run"
                    ) from None
                time.sleep(0.5)


def _wait(children: dict, log, on_poll: Callable[[], None] | None = None) -> dict:
    """Poll the node runs until each is final; log each change of state; `on_poll` after each poll."""
    seen: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        while True:
            runs = {q: client.read_flow_run(fr.id) for q, fr in children.items()}
            for q, fr in runs.items():
                if seen.get(q) != fr.state.name:
                    seen[q] = fr.state.name
                    log.info(f"{fr.name} on {q}: {fr.state.name}")
            if on_poll is not None:
                on_poll()
            if all(fr.state.is_final() for fr in runs.values()):
                return runs
            time.sleep(POLL_S)
