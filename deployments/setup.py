"""Create or update everything Eyrie needs on a Prefect server, idempotently.

    python -m deployments.setup --api-url http://prefect.internal:4200/api     # or PREFECT_API_URL

One run makes the server match this file and deployments/prefect.yaml:

- work pool `eyrie-gpu` (type process) and its queues, one per GPU node (GPU_QUEUES: `gpu-node-1`, `gpu-node-2`;
  concurrency limit 1 each, so a node runs one flow run at a time while the nodes run side by side). The pool's
  concurrency limit is the number of GPU queues (2): one flow run per node in all, on top of each worker's
  `--limit 1`;
- work pool `eyrie-control` (type process, no limit) and its queue `control`, for the fan-out's parent
  (eyrie-extract-fanout), which holds no GPU and waits for the nodes: in the GPU pool it would take one of the
  nodes' pool slots;
- automation "Crash zombie flows" (Prefect's documented one): a flow run that sent a heartbeat and then neither
  another heartbeat nor a terminal state within ZOMBIE_WITHIN is set to CRASHED, which also frees its
  deployment's concurrency slot;
- the deployments of deployments/prefect.yaml, through `prefect deploy --all --prefect-file` (run from the
  repository root, because entrypoints are relative to it).

Running it again changes nothing: the pools, queues and automation are written only when they differ from
what is wanted (limits and descriptions changed by hand are put back); the deployments are upserted by name and
their schedule by slug (only their `updated` timestamps move), so every id and every setting stays the same. A
queue in these pools that this setup does not manage (other than Prefect's `default`) is reported, not deleted.
prefect.yaml may use only these pools and queues: the fan-out parent (CONTROL_ENTRYPOINTS) the control pool, every
other flow the GPU pool. It prints what it created or changed, computed by comparing the server's state before and
after. Authentication: PREFECT_API_AUTH_STRING (or PREFECT_API_KEY) from the environment, as for any Prefect client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO / "deployments" / "prefect.yaml"

POOL_TYPE = "process"
GPU_POOL = "eyrie-gpu"
CONTROL_POOL = "eyrie-control"
# The GPU nodes: one work queue each, limit 1 (and the node's worker runs `--limit 1`). A further GPU node: add its
# queue here and to the fan-out's `queues` parameter in prefect.yaml, run this setup, and start the node's worker on
# it. The GPU pool's limit and the global limit's slots follow from this one definition.
GPU_QUEUES = {
    "gpu-node-1": "The GPU node gpu-node-1; its worker runs with --limit 1.",
    "gpu-node-2": "The GPU node gpu-node-2; its worker runs with --limit 1.",
}
GPU_QUEUE_LIMIT = 1  # exclusive: one flow run per node
CONTROL_QUEUE = "control"
# Pool -> its pool-wide concurrency limit, description and work queues (queue -> (concurrency limit, description)).
POOLS: dict[str, dict[str, Any]] = {
    GPU_POOL: {
        # One flow run per GPU node in all: the nodes run side by side (a fanned-out extraction), never more.
        "concurrency_limit": len(GPU_QUEUES),
        "description": "Eyrie's GPU nodes, one work queue each (limit 1), picked up by `prefect worker start "
        f"--pool {GPU_POOL} --work-queue <node> --limit 1`. Pool limit: one run per node.",
        "queues": {name: (GPU_QUEUE_LIMIT, desc) for name, desc in GPU_QUEUES.items()},
    },
    CONTROL_POOL: {
        # No limit: its runs hold no GPU; the deployment's own limit (1, ENQUEUE) bounds them.
        "concurrency_limit": None,
        "description": "Parents of fanned-out extractions (eyrie-extract-fanout), which hold no GPU and wait for the "
        f"GPU nodes: `prefect worker start --pool {CONTROL_POOL} --work-queue {CONTROL_QUEUE}`.",
        "queues": {
            CONTROL_QUEUE: (
                None,
                "Parents of fanned-out extractions (eyrie-extract-fanout): no GPU, they "
                "wait for the nodes. Its worker runs on any machine with the checkout and "
                "the shared run folders.",
            )
        },
    },
}
# The flows that hold no GPU, so run from the control pool; every other flow runs from the GPU pool.
CONTROL_ENTRYPOINTS = {"flows/fanout.py:extract_fanout_flow"}
ZOMBIE_AUTOMATION = "Crash zombie flows"
# prefect.yaml sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY=60 for flow runs (Prefect 3.7's default is 180 s): a run is
# declared a zombie after about ten missed heartbeats, or three at the default frequency. Prefect's docs pair 30 s
# heartbeats with 90 s; a window shorter than the frequency would crash every healthy run.
ZOMBIE_WITHIN = timedelta(minutes=10)


class SetupError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# The file


def load_prefect_file(path: Path = PREFECT_FILE) -> list[dict[str, Any]]:
    """The deployments of prefect.yaml, validated the way `prefect deploy` reads them, plus Eyrie's own checks.

    `prefect deploy` prints a warning and deploys nothing when the file does not validate; here that is an error.
    """
    import yaml
    from prefect.cli.deploy._models import PrefectYamlModel
    from pydantic import ValidationError

    from eyrie.config import parse_config
    from eyrie.errors import ConfigError

    raw = yaml.safe_load(path.read_text())
    try:
        model = PrefectYamlModel.model_validate(raw)
    except ValidationError as err:
        raise SetupError(f"{path} does not validate as a Prefect 3.7 prefect.yaml:\n{err}") from None
    if not model.deployments:
        raise SetupError(f"{path} lists no deployments")
    deployments = [d.model_dump(exclude_unset=True, mode="json") for d in model.deployments]
    for d in deployments:
        where = f"{path}: deployment {d.get('name')!r} ({d.get('entrypoint')})"
        for key in ("name", "entrypoint", "work_pool"):
            if not d.get(key):
                raise SetupError(f"{where} lacks `{key}`")
        _check_pool_and_queues(d, where)
        entry = REPO / d["entrypoint"].split(":")[0]
        if not entry.is_file():
            raise SetupError(f"{where}: {entry} does not exist")
        # The server checks a run's parameters against the flow's schema when the run is created through the API,
        # but not the runs its scheduler creates from a schedule's parameters: check the config here, before
        # anything is written, with the same validation `eyrie run --config` applies.
        for i, sched in enumerate(d.get("schedules") or []):
            params = sched.get("parameters") or {}
            if "config" in params:
                try:
                    parse_config(params["config"], f"{where} schedules[{i}].parameters.config")
                except ConfigError as err:
                    raise SetupError(str(err)) from None
    return deployments


def _check_pool_and_queues(d: dict[str, Any], where: str) -> None:
    """Only the pools and queues this setup creates: the server would create any other queue on first use, without
    its limit, and a GPU flow in the control pool would run outside the GPU pool's limit."""
    pool, queue = d["work_pool"].get("name"), d["work_pool"].get("work_queue_name")
    created = ", ".join(f"{p!r} (queues {sorted(spec['queues'])})" for p, spec in POOLS.items())
    if pool not in POOLS:
        raise SetupError(
            f"{where} uses work pool {pool!r}; this setup creates only {created} (deployments/setup.py POOLS)"
        )
    if not queue:
        raise SetupError(
            f"{where} lacks `work_pool.work_queue_name` (Prefect would use the pool's `default` queue, "
            f"which has no limit); pool {pool!r} has {sorted(POOLS[pool]['queues'])}"
        )
    if queue not in POOLS[pool]["queues"]:
        other = [p for p, spec in POOLS.items() if queue in spec["queues"]]
        hint = f"; {queue!r} is a queue of pool {other[0]!r}" if other else ""
        raise SetupError(
            f"{where} names work queue {queue!r} in pool {pool!r}, which has only "
            f"{sorted(POOLS[pool]['queues'])}{hint} (deployments/setup.py POOLS)"
        )
    wanted = CONTROL_POOL if d["entrypoint"] in CONTROL_ENTRYPOINTS else GPU_POOL
    if pool != wanted:
        why = (
            "it holds no GPU and waits for the nodes: in the GPU pool it would take a node's pool slot"
            if wanted == CONTROL_POOL
            else "it uses a GPU: only the GPU pool's limits keep one run per node"
        )
        raise SetupError(
            f"{where} uses work pool {pool!r}; it must use {wanted!r}: {why} (deployments/setup.py CONTROL_ENTRYPOINTS)"
        )
    # The fan-out's node queues: its `eyrie-extract/node` runs go to the GPU nodes' queues.
    for q in (d.get("parameters") or {}).get("queues") or []:
        if q not in GPU_QUEUES:
            raise SetupError(
                f"{where} names {q!r} in its `queues` parameter; the GPU node queues this setup creates "
                f"in pool {GPU_POOL!r} are {sorted(GPU_QUEUES)} (deployments/setup.py GPU_QUEUES)"
            )


def deployment_full_names(deployments: list[dict[str, Any]]) -> list[str]:
    """`<flow name>/<deployment name>` for each deployment. The flow's name is read from its decorator in the source,
    without importing the module (the flows import torch and vLLM)."""
    from prefect.flows import load_flow_arguments_from_entrypoint

    names = []
    for d in deployments:
        file, func = d["entrypoint"].rsplit(":", 1)
        flow_name = load_flow_arguments_from_entrypoint(f"{REPO / file}:{func}", arguments={"name"})["name"]
        names.append(f"{flow_name}/{d['name']}")
    return names


# ---------------------------------------------------------------------------------------------------------------
# The objects


def zombie_automation():
    """Prefect's "Crash zombie flows" automation (docs: v3/advanced/detect-zombie-flows), with a wider window."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=ZOMBIE_AUTOMATION,
        description=(
            "Marks a flow run CRASHED when it stops sending heartbeats (a killed or lost worker process) "
            "so that it frees its deployment's concurrency slot. Managed by deployments/setup.py."
        ),
        enabled=True,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=ZOMBIE_WITHIN,
        ),
        actions=[
            ChangeFlowRunState(state=StateType.CRASHED, message="Flow run marked as crashed due to missing heartbeats.")
        ],
    )


async def ensure_work_pools(client, log) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    for name, spec in POOLS.items():
        limit, description = spec["concurrency_limit"], spec["description"]
        try:
            pool = await client.read_work_pool(name)
        except ObjectNotFound:
            await client.create_work_pool(
                WorkPoolCreate(
                    name=name,
                    type=POOL_TYPE,
                    concurrency_limit=limit,
                    description=description,
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                )
            )
            log(f"created work pool {name!r} (type {POOL_TYPE}, concurrency limit {limit})")
            continue
        if pool.type != POOL_TYPE:
            raise SetupError(
                f"work pool {name!r} exists with type {pool.type!r}, not {POOL_TYPE!r}: a pool's type "
                f"cannot change; delete it (`prefect work-pool delete {name}`) and run this again"
            )
        update = {}
        if pool.concurrency_limit != limit:
            update["concurrency_limit"] = limit
        if pool.description != description:
            update["description"] = description
        if not pool.base_job_template:
            update["base_job_template"] = ProcessWorker.get_default_base_job_template()
        if update:
            await client.update_work_pool(name, WorkPoolUpdate(**update))
            log(f"updated work pool {name!r}: {sorted(update)}")


async def ensure_work_queues(client, log) -> None:
    from prefect.exceptions import ObjectNotFound

    for pool, spec in POOLS.items():
        for name, (limit, description) in spec["queues"].items():
            try:
                queue = await client.read_work_queue_by_name(name, work_pool_name=pool)
            except ObjectNotFound:
                await client.create_work_queue(
                    name, work_pool_name=pool, concurrency_limit=limit, description=description
                )
                log(f"created work queue {name!r} in pool {pool!r} (concurrency limit {limit})")
                continue
            if queue.concurrency_limit != limit:
                await client.update_work_queue(queue.id, concurrency_limit=limit)
                log(
                    f"updated work queue {name!r} in pool {pool!r}: concurrency limit {queue.concurrency_limit} "
                    f"-> {limit}"
                )
            if queue.description != description:
                await client.update_work_queue(queue.id, description=description)
                log(f"updated work queue {name!r} in pool {pool!r}: description")
        # Not deleted: runs may still wait in it. Prefect creates `default` in every pool; nothing sends runs there.
        for queue in await client.read_work_queues(work_pool_name=pool):
            if queue.name not in spec["queues"] and queue.name != "default":
                log(
                    f"warning: work queue {queue.name!r} in pool {pool!r} is not managed by deployments/setup.py "
                    f"(it manages {sorted(spec['queues'])}); once nothing uses it: "
                    f"`prefect work-queue delete {queue.name} --pool {pool}`"
                )


def _same_automation(existing, desired) -> bool:
    from prefect.events.schemas.automations import AutomationCore

    return AutomationCore.model_validate(existing.model_dump(exclude={"id"})) == desired


async def ensure_zombie_automation(client, log) -> None:
    from prefect.client.schemas.sorting import AutomationSort
    from prefect.events.filters import AutomationFilter, AutomationFilterName

    desired = zombie_automation()
    found = await client.read_automations(
        automations=AutomationFilter(name=AutomationFilterName(any_=[ZOMBIE_AUTOMATION])),
        sort=AutomationSort.CREATED_DESC,
    )
    found = [a for a in found if a.name == ZOMBIE_AUTOMATION]
    if not found:
        await client.create_automation(desired)
        log(f"created automation {ZOMBIE_AUTOMATION!r}")
        return
    keep, extra = found[-1], found[:-1]  # the oldest stays: its id is the one already known
    for dup in extra:  # exactly one: two would both fire on the same run
        await client.delete_automation(dup.id)
        log(f"deleted duplicate automation {ZOMBIE_AUTOMATION!r} {dup.id}")
    if not _same_automation(keep, desired):
        await client.update_automation(keep.id, desired)
        log(f"updated automation {ZOMBIE_AUTOMATION!r} ({keep.id})")


def run_prefect_deploy(prefect_file: Path, log) -> None:
    env = dict(os.environ)
    # `prefect deploy` substitutes environment variables into the pull steps at deploy time when they are set; the
    # working directory must come from the worker's environment at run time instead.
    env.pop("EYRIE_HOME", None)
    env["PREFECT_CLI_PROMPT"] = "false"
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SetupError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    log("prefect deploy --all: done")


# ---------------------------------------------------------------------------------------------------------------
# State: what this setup manages, as plain data, for the before/after comparison (and the tests).


async def snapshot(client, full_names: list[str]) -> dict[str, Any]:
    """Everything this setup manages, plus object counts, keyed by name so a diff reads well."""
    from prefect.exceptions import ObjectNotFound

    state: dict[str, Any] = {"work_pools": {}, "work_queues": {}}
    n_queues = 0
    for name in POOLS:
        try:
            pool = await client.read_work_pool(name)
            queues = await client.read_work_queues(work_pool_name=name)
        except ObjectNotFound:
            state["work_pools"][name], queues = None, []
        else:
            state["work_pools"][name] = {
                "id": str(pool.id),
                "type": pool.type,
                "concurrency_limit": pool.concurrency_limit,
                "description": pool.description,
                "is_paused": pool.is_paused,
                "base_job_template": pool.base_job_template,
            }
        state["work_queues"][name] = {
            q.name: {
                "id": str(q.id),
                "concurrency_limit": q.concurrency_limit,
                "description": q.description,
                "is_paused": q.is_paused,
            }
            for q in queues
        }
        n_queues += len(queues)
    # Deployment concurrency limits are global limits named `deployment:<id>`, so they show up here too.
    limits = await _all_global_limits(client)
    state["global_concurrency_limits"] = {
        g.name: {"id": str(g.id), "limit": g.limit, "active": g.active} for g in limits
    }
    automations = await client.read_automations()
    state["automations"] = {}
    for a in sorted(automations, key=lambda a: str(a.id)):
        state["automations"].setdefault(a.name, []).append(
            {
                "id": str(a.id),
                "enabled": a.enabled,
                "definition": _canonical(json.loads(a.model_dump_json(exclude={"id"}))),
            }
        )
    state["deployments"] = {}
    for name in full_names:
        try:
            d = await client.read_deployment_by_name(name)
        except ObjectNotFound:
            state["deployments"][name] = None
            continue
        gcl = d.global_concurrency_limit
        state["deployments"][name] = {
            "id": str(d.id),
            "flow_id": str(d.flow_id),
            "entrypoint": d.entrypoint,
            "work_pool_name": d.work_pool_name,
            "work_queue_name": d.work_queue_name,
            "concurrency_limit": gcl.limit if gcl else None,
            "concurrency_limit_id": str(gcl.id) if gcl else None,
            "collision_strategy": (d.concurrency_options.collision_strategy.value if d.concurrency_options else None),
            "enforce_parameter_schema": d.enforce_parameter_schema,
            "paused": d.paused,
            "parameters": d.parameters,
            "parameter_openapi_schema": d.parameter_openapi_schema,
            "pull_steps": d.pull_steps,
            "job_variables": d.job_variables,
            "tags": sorted(d.tags),
            "description": d.description,
            "version": d.version,
            "schedules": {
                s.slug or str(s.id): {
                    "id": str(s.id),
                    "active": s.active,
                    "schedule": s.schedule.model_dump(mode="json"),
                    "parameters": s.parameters,
                }
                for s in d.schedules
            },
        }
    state["counts"] = {
        "work_pools": len(await client.read_work_pools()),
        "work_queues": n_queues,
        "global_concurrency_limits": len(limits),
        "automations": len(automations),
        "deployments": len(await client.read_deployments()),
        "flows": len(await client.read_flows()),
    }
    return state


async def _all_global_limits(client) -> list:
    limits, page = [], 200  # the server's maximum page
    while batch := await client.read_global_concurrency_limits(limit=page, offset=len(limits)):
        limits += batch
        if len(batch) < page:
            break
    return limits


def _canonical(value: Any) -> Any:
    """Sort lists of strings: the automation's `after`/`expect`/`for_each` are sets, whose order varies by process."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_canonical(v) for v in value]
        return sorted(items) if all(isinstance(v, str) for v in items) else items
    return value


def diff(before: Any, after: Any, path: str = "") -> list[str]:
    """Human-readable differences between two snapshots (or parts of them)."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for k in sorted(set(before) | set(after), key=str):
            out += diff(before.get(k), after.get(k), f"{path}.{k}" if path else str(k))
        return out
    if before != after:
        short = lambda v: s if len(s := json.dumps(v, default=str)) <= 120 else s[:117] + "..."  # noqa: E731
        return [f"{path}: {short(before)} -> {short(after)}"]
    return []


# ---------------------------------------------------------------------------------------------------------------


async def setup(prefect_file: Path = PREFECT_FILE, deploy: bool = True, log=print) -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    deployments = load_prefect_file(prefect_file)
    full_names = deployment_full_names(deployments)
    async with get_client() as client:
        if (err := await client.api_healthcheck()) is not None:
            raise SetupError(f"cannot reach the Prefect API at {client.api_url}: {err}")
        before = await snapshot(client, full_names)
        await ensure_work_pools(client, log)
        await ensure_work_queues(client, log)
        await ensure_zombie_automation(client, log)
    if deploy:
        run_prefect_deploy(prefect_file, log)
    async with get_client() as client:
        after = await snapshot(client, full_names)
    missing = [n for n, d in after["deployments"].items() if d is None]
    if deploy and missing:
        raise SetupError(f"after `prefect deploy`, these deployments are missing: {missing}")
    return {"before": before, "after": after, "changes": diff(before, after)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.setup", description=__doc__.split("\n\n")[0])
    p.add_argument("--api-url", help="Prefect API URL, e.g. http://host:4200/api (default: $PREFECT_API_URL)")
    p.add_argument("--prefect-file", type=Path, default=PREFECT_FILE)
    p.add_argument("--no-deploy", action="store_true", help="only the pools, queues, limit and automation")
    p.add_argument("--json", action="store_true", help="print the before/after state and the changes as JSON")
    args = p.parse_args(argv)

    if args.api_url:
        os.environ["PREFECT_API_URL"] = args.api_url  # before Prefect reads its settings; inherited by `prefect deploy`
    from prefect.settings import get_current_settings

    api_url = get_current_settings().api.url  # the environment, else the active Prefect profile
    if not api_url:
        # Without one the client would start a temporary local server and "succeed" against a throw-away database.
        print("deployments.setup: error: no Prefect server: pass --api-url or set PREFECT_API_URL", file=sys.stderr)
        return 2
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        result = asyncio.run(setup(args.prefect_file.resolve(), deploy=not args.no_deploy, log=log))
    except SetupError as err:
        print(f"deployments.setup: error: {err}", file=sys.stderr)
        return 1
    except PrefectHTTPStatusError as err:
        hint = (
            " (set PREFECT_API_AUTH_STRING to the server's PREFECT_SERVER_API_AUTH_STRING)"
            if err.response.status_code == 401
            else ""
        )
        print(f"deployments.setup: error: {api_url} answered {err.response.status_code}{hint}: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        changes = result["changes"]
        print(f"{len(changes)} change(s) on {api_url}" + (":" if changes else ""))
        for c in changes:
            print(f"  {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
