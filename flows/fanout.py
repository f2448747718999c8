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

The parent runs from a queue of its own (`control`): on a GPU node's queue it would hold that node's only slot while
waiting for the node's share.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from eyrie.config import PipelineConfig
from eyrie.errors import ExtractionError, EyrieError, RegenerationError
from eyrie.run.folder import RunFolder
from eyrie.stages.extract import ExtractionPlan
from eyrie.stages.preflight import PreflightReport
from eyrie.stages.prepare import load_shards
from eyrie.stages.regenerate import RegenerationPlan, extraction_source
from flows.opening import open_run
from flows.regenerate import assemble
from tasks.preflight import preflight_task

NODE_DEPLOYMENT = "eyrie-extract/node"
REGENERATE_NODE_DEPLOYMENT = "eyrie-regenerate/node"
POLL_S = 5.0


def split_shards(names: list[str], queues: list[str]) -> dict[str, list[str]]:
    """Round robin: shares differ by at most one shard; a queue left without a shard gets no run."""
    return {q: names[i :: len(queues)] for i, q in enumerate(queues) if names[i :: len(queues)]}


@flow(name="eyrie-extract-fanout")
def extract_fanout_flow(
    config: PipelineConfig,
    run_dir: str,
    queues: list[str],
    deployment: str = NODE_DEPLOYMENT,
    regenerate_deployment: str = REGENERATE_NODE_DEPLOYMENT,
) -> dict:
    """Regenerate (with regenerate.enabled) and extract `run_dir`'s pending shards on the nodes behind `queues` (one
    work queue per node), and check that every shard is complete. `run_dir` must be on storage every node mounts at
    the same path. Each node's server serves both stages: its regeneration share leaves it up, its extraction share
    (an empty one if no shard is left for it) reuses and stops it."""
    log = get_run_logger()
    if not queues or len(set(queues)) != len(queues):
        raise ExtractionError(f"queues {queues}: name each node's work queue once")
    run = RunFolder(run_dir)
    run.ensure()
    with run.lock() as held:
        # The pipeline's own opening: the nodes get the config with its hub revisions pinned, so they key their
        # shards as the pipeline does.
        opened = open_run(config, run)
        config, report = opened.config, opened.report
        _check_queues(deployment, queues, log)
        # The nodes lock what they write themselves (flows/shares.py): a node outlives this process if it dies, and
        # then keeps every other run off the folder until it ends. Opened: let them in.
        held.admit_shares()
        nodes: dict[str, dict] = {}
        kept: list[str] = []  # queues whose node left its server up for its extraction share
        if config.regenerate.enabled:
            plan = RegenerationPlan(config, run, PreflightReport(**report))
            shares = split_shards([s.name for s in plan.pending()], queues)
            params = {"config": config.model_dump(mode="json"), "run_dir": str(run.root), "report": report}
            finished = _fan_out(regenerate_deployment, "regenerate", shares, {**params, "keep_server": True}, log)
            _check_nodes(finished, shares, RegenerationError)
            nodes["regenerate"] = _node_outcomes(finished, shares)
            kept = list(shares)
            # Read again now the shards ran: the assembly's key counts the rows they lost.
            regenerated = assemble(config, run, RegenerationPlan(config, run, PreflightReport(**report)))
            # The disk check again, on the regenerated data's length (seconds; nothing loads).
            report = preflight_task(config, str(run.root), tokens=regenerated["stats"]["tokens"])
        plan = ExtractionPlan(config, run, PreflightReport(**report), load_shards(extraction_source(run, config)))
        rehash = config.extraction.verify_checksums
        shares = split_shards([s.name for s in plan.pending(rehash)], queues)
        for q in kept:
            shares.setdefault(q, [])  # an empty share: the node stops the server it kept up
        params = {"config": config.model_dump(mode="json"), "run_dir": str(run.root), "report": report}
        finished = _fan_out(deployment, "extract", shares, params, log)
        _check_nodes(finished, shares, ExtractionError)
        missing = [s.name for s in plan.shards if not plan.is_complete(s, rehash)]
        if missing:
            raise ExtractionError(
                f"every node run completed, yet {len(missing)} shards lack a complete manifest "
                f"({', '.join(missing[:10])}): is {run.root} the same shared folder on every node?"
            )
        nodes["extract"] = _node_outcomes(finished, shares)
    return {
        "run_dir": str(run.root),
        "shards": len(plan.shards),
        "hidden_states": str(run.hidden_states),
        "nodes": nodes["extract"],
        **({"regenerate_nodes": nodes["regenerate"]} if "regenerate" in nodes else {}),
    }


def _fan_out(deployment: str, stage: str, shares: dict[str, list[str]], params: dict, log) -> dict:
    """One run of `deployment` per queue with its share; waits until every one is final."""
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
    return _wait(children, log)


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


def _wait(children: dict, log) -> dict:
    """Poll the node runs until each is final; log each change of state."""
    seen: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        while True:
            runs = {q: client.read_flow_run(fr.id) for q, fr in children.items()}
            for q, fr in runs.items():
                if seen.get(q) != fr.state.name:
                    seen[q] = fr.state.name
                    log.info(f"{fr.name} on {q}: {fr.state.name}")
            if all(fr.state.is_final() for fr in runs.values()):
                return runs
            time.sleep(POLL_S)
