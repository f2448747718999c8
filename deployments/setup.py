"""Create or update everything Eyrie needs on a Prefect server, idempotently.

    python -m deployments.setup --api-url http://prefect.internal:4200/api     # or PREFECT_API_URL

It makes the server match deployments/prefect.yaml, whose `definitions.gpu_nodes` is the one list of GPU nodes:
work pool `eyrie-gpu` (process) with one queue per node, limit 1 each, and a pool limit of one run per node; work
pool `eyrie-control` (process, no limit) with queue `control`, for the fan-out's parent, which holds no GPU and waits
for the nodes; the automation "Crash zombie flows" (Prefect's documented one: a flow run whose heartbeats stop is set
to CRASHED, freeing its concurrency slot); with `--notify-block TYPE/NAME` (or $EYRIE_NOTIFY_BLOCK) the automation
"Eyrie GPU run failed", which sends that notification block (a Slack, Teams, e-mail or custom webhook block the
operator created) a message naming the run when a run in the GPU pool fails or crashes; then the deployments,
through `prefect deploy --all --prefect-file`, which upserts them by name and their schedules by slug, then each
deployment's parameter schema with a `position` on every field (deployments/form.py: the run form in pipeline order).
The production deployments carry the production preset as their parameters (the run form opens filled). prefect.yaml
is checked before anything is written. Each write prints one line, and a run with nothing to do prints
`0 change(s)`. A queue in these pools that is not wanted (a node taken off the list) is reported, not deleted: runs
may still wait in it. `--check-node NAME` (run by the worker's
unit and image before the worker starts) exits 1 unless NAME is a listed node. Authentication:
PREFECT_API_AUTH_STRING (or PREFECT_API_KEY) from the environment, as for any Prefect client.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
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
CONTROL_QUEUE = "control"
# The flows that hold no GPU, so run from the control pool; every other flow runs from the GPU pool.
CONTROL_ENTRYPOINTS = {"flows/fanout.py:extract_fanout_flow"}
# A node's name is its queue, its worker's systemd instance and its folder in run folders (eyrie.run.folder.node_name).
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
ZOMBIE_AUTOMATION = "Crash zombie flows"
FAILED_RUN_AUTOMATION = "Eyrie GPU run failed"
NOTIFY_BLOCK_ENV = "EYRIE_NOTIFY_BLOCK"
# The zombie window is `definitions.zombie_after_s` of prefect.yaml, the flow runs' heartbeat frequency its
# `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` (Prefect 3.7: at least 30 s, default 180 s). Prefect's docs pair 30 s heartbeats
# with 90 s: the window must hold at least this many heartbeats, or a late one crashes a healthy run.
MIN_HEARTBEATS_PER_WINDOW = 3
MIN_HEARTBEAT_S = 30


class SetupError(RuntimeError):
    pass


def work_pools(nodes: list[str]) -> dict[str, dict[str, Any]]:
    """Pool -> its concurrency limit, description and queues (queue -> (limit, description)), from the node list."""
    gpu = f"`prefect worker start --pool {GPU_POOL} --work-queue <node> --limit 1`"
    return {
        GPU_POOL: {
            "concurrency_limit": len(nodes),  # one run per node, the nodes side by side
            "description": f"Eyrie's GPU nodes (deployments/prefect.yaml), one queue each (limit 1), run by {gpu}.",
            "queues": {n: (1, f"The GPU node {n}: its worker (eyrie-worker@{n}) runs with --limit 1.") for n in nodes},
        },
        CONTROL_POOL: {
            "concurrency_limit": None,  # its runs hold no GPU; the deployment's own limit (1, ENQUEUE) bounds them
            "description": "Parents of fanned-out extractions (eyrie-extract-fanout): no GPU, they wait for the nodes.",
            "queues": {CONTROL_QUEUE: (None, "Fan-out parents; a worker on any machine with the checkout and /data.")},
        },
    }


def gpu_nodes(path: Path = PREFECT_FILE) -> list[str]:
    """The GPU nodes, as prefect.yaml declares them (`definitions.gpu_nodes`)."""
    import yaml

    nodes = ((yaml.safe_load(path.read_text()) or {}).get("definitions") or {}).get("gpu_nodes")
    bad = [n for n in nodes or [] if not isinstance(n, str) or not NODE_NAME.fullmatch(n) or n == CONTROL_QUEUE]
    if not isinstance(nodes, list) or not nodes or bad or len(set(nodes)) != len(nodes):
        raise SetupError(
            f"{path}: `definitions.gpu_nodes` must list each GPU node once, by a name of letters, digits, '.', '_' or "
            f"'-' other than {CONTROL_QUEUE!r} (it names the node's queue, worker and run-folder folder): {nodes}"
        )
    return nodes


def zombie_window(path: Path = PREFECT_FILE) -> timedelta:
    """How long a flow run may go without a heartbeat before the zombie automation marks it CRASHED
    (`definitions.zombie_after_s`), checked against the heartbeat frequency the file gives the flow runs."""
    import yaml

    defs = (yaml.safe_load(path.read_text()) or {}).get("definitions") or {}
    env = ((defs.get("work_pool") or {}).get("job_variables") or {}).get("env") or {}
    freq, window = env.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY"), defs.get("zombie_after_s")
    try:
        freq_s, window_s = int(freq), int(window)
    except (TypeError, ValueError):
        raise SetupError(
            f"{path}: `definitions.work_pool.job_variables.env.PREFECT_FLOWS_HEARTBEAT_FREQUENCY` ({freq!r}) and "
            f"`definitions.zombie_after_s` ({window!r}) must be whole seconds: the flow runs' heartbeats and how "
            "long a run may miss them before it is marked CRASHED"
        ) from None
    if freq_s < MIN_HEARTBEAT_S or window_s < MIN_HEARTBEATS_PER_WINDOW * freq_s:
        raise SetupError(
            f"{path}: heartbeats every {freq_s} s and `zombie_after_s: {window_s}`: Prefect's heartbeats are at "
            f"least {MIN_HEARTBEAT_S} s apart, and the window must hold at least {MIN_HEARTBEATS_PER_WINDOW} of "
            f"them (here >= {MIN_HEARTBEATS_PER_WINDOW * max(freq_s, MIN_HEARTBEAT_S)} s), or a late heartbeat "
            "marks a healthy run CRASHED"
        )
    return timedelta(seconds=window_s)


def load_prefect_file(path: Path = PREFECT_FILE) -> tuple[list[str], list[dict[str, Any]]]:
    """The GPU nodes and the deployments of prefect.yaml, validated the way `prefect deploy` reads them, plus Eyrie's
    own checks. `prefect deploy` prints a warning and deploys nothing when the file does not validate; here that is
    an error."""
    import yaml
    from prefect.cli.deploy._models import PrefectYamlModel
    from pydantic import ValidationError

    from eyrie.config import parse_config
    from eyrie.errors import ConfigError

    nodes = gpu_nodes(path)
    zombie_window(path)
    pools = work_pools(nodes)
    try:
        model = PrefectYamlModel.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as err:
        raise SetupError(f"{path} does not validate as a Prefect 3.7 prefect.yaml:\n{err}") from None
    if not model.deployments:
        raise SetupError(f"{path} lists no deployments")
    deployments = [d.model_dump(exclude_unset=True, mode="json") for d in model.deployments]
    for d in deployments:
        where = f"{path}: deployment {d.get('name')!r} ({d.get('entrypoint')})"
        if lacking := [f"`{k}`" for k in ("name", "entrypoint", "work_pool") if not d.get(k)]:
            raise SetupError(f"{where} lacks {', '.join(lacking)}")
        # Only the pools and queues this setup creates: the server would create any other queue on first use, without
        # its limit, and a GPU flow in the control pool would run outside the GPU pool's limit.
        pool, queue = d["work_pool"].get("name"), d["work_pool"].get("work_queue_name")
        wanted = CONTROL_POOL if d["entrypoint"] in CONTROL_ENTRYPOINTS else GPU_POOL
        if pool != wanted:
            why = (
                "holds no GPU: in the GPU pool it would take a node's slot" if wanted == CONTROL_POOL else "uses a GPU"
            )
            raise SetupError(f"{where} uses work pool {pool!r}; it must use {wanted!r}: it {why}")
        if queue not in (queues := list(pools[pool]["queues"])):
            nodes_hint = " (the GPU nodes: definitions.gpu_nodes)" if pool == GPU_POOL else ""
            raise SetupError(
                f"{where} names work queue {queue!r} in pool {pool!r}, whose queues are {queues}{nodes_hint}"
            )
        # The fan-out's shares go to every GPU node: its `queues` are the node list (`*gpu_nodes`).
        if (shares := (d.get("parameters") or {}).get("queues")) is not None and shares != nodes:
            raise SetupError(f"{where}: its `queues` parameter {shares} must be the GPU nodes {nodes} (`*gpu_nodes`)")
        if not (REPO / d["entrypoint"].split(":")[0]).is_file():
            raise SetupError(f"{where}: {d['entrypoint'].split(':')[0]} does not exist")
        # The server checks a run's parameters against the flow's schema when the run is created through the API,
        # but not the runs its scheduler creates from a schedule's parameters, nor the deployment's own (the run
        # form's preset, and what a run given no config runs): check each config here, before anything is written,
        # with the same validation `eyrie run --config` applies.
        sources = [("parameters", d.get("parameters") or {})]
        sources += [
            (f"schedules[{i}].parameters", s.get("parameters") or {}) for i, s in enumerate(d.get("schedules") or [])
        ]
        for label, params in sources:
            if "config" in params:
                try:
                    parse_config(params["config"], f"{where} {label}.config")
                except ConfigError as err:
                    raise SetupError(str(err)) from None
    return nodes, deployments


def zombie_automation(within: timedelta | None = None):
    """Prefect's "Crash zombie flows" automation (docs: v3/advanced/detect-zombie-flows), with the window of
    prefect.yaml (`zombie_window`) unless `within` is given."""
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
            expect={f"prefect.flow-run.{e}" for e in ("heartbeat", "Completed", "Failed", "Cancelled", "Crashed")},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=zombie_window() if within is None else within,
        ),
        actions=[
            ChangeFlowRunState(state=StateType.CRASHED, message="Flow run marked as crashed due to missing heartbeats.")
        ],
    )


def failed_run_automation(block_document_id):
    """Notifies the operator's block when a run of the GPU pool ends Failed or Crashed (a 20-hour run that died must
    reach someone). Matched on the run's work pool, so every GPU deployment is covered, present and future."""
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=FAILED_RUN_AUTOMATION,
        description=f"Notifies when a run in the work pool {GPU_POOL!r} fails or crashes (deployments/setup.py).",
        enabled=True,
        trigger=EventTrigger(
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification(
                {"prefect.resource.role": "work-pool", "prefect.resource.name": GPU_POOL}
            ),
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            SendNotification(
                block_document_id=block_document_id,
                subject="Eyrie: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}",
                body=(
                    "Flow run {{ flow_run.name }} ({{ flow.name }}, deployment {{ deployment.name }}) entered "
                    "{{ flow_run.state.name }}: {{ flow_run.state.message }}\n(flow run id {{ flow_run.id }})\n"
                    "Its run folder keeps what finished; `eyrie status --run-dir DIR` shows what is left, and a retry "
                    "of the flow run resumes it."
                ),
            )
        ],
    )


async def notify_block_id(client, slug: str):
    """The id of the notification block `TYPE/NAME` (the slug `prefect block ls` shows)."""
    from prefect.exceptions import ObjectNotFound

    block_type, _, name = slug.partition("/")
    if not block_type or not name:
        raise SetupError(f"--notify-block {slug!r}: give the block as TYPE/NAME, e.g. slack-webhook/eyrie-oncall")
    try:
        return (await client.read_block_document_by_name(name, block_type, include_secrets=False)).id
    except ObjectNotFound:
        raise SetupError(
            f"no notification block {slug!r} on this Prefect server: create it first (UI: Blocks > Add, e.g. a Slack "
            f"Webhook; or `prefect block create {block_type}`), then run this again"
        ) from None


def _differing(obj, wanted: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in wanted.items() if getattr(obj, k) != v}


def _what(obj, update: dict[str, Any]) -> str:
    return ", ".join(f"{k} {getattr(obj, k)} -> {v}" if k == "concurrency_limit" else k for k, v in update.items())


async def ensure_work_pools(client, pools: dict[str, dict[str, Any]], change, log) -> None:
    """Each pool and each of its queues, created or put back to the wanted limit and description."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    for name, spec in pools.items():
        wanted = {"concurrency_limit": spec["concurrency_limit"], "description": spec["description"]}
        template = ProcessWorker.get_default_base_job_template()
        try:
            pool = await client.read_work_pool(name)
        except ObjectNotFound:
            await client.create_work_pool(
                WorkPoolCreate(name=name, type=POOL_TYPE, base_job_template=template, **wanted)
            )
            change(f"created work pool {name!r} (type {POOL_TYPE}, concurrency limit {spec['concurrency_limit']})")
        else:
            if pool.type != POOL_TYPE:
                raise SetupError(
                    f"work pool {name!r} exists with type {pool.type!r}, not {POOL_TYPE!r}: a pool's type "
                    f"cannot change; delete it (`prefect work-pool delete {name}`) and run this again"
                )
            update = _differing(pool, wanted) | ({} if pool.base_job_template else {"base_job_template": template})
            if update:
                await client.update_work_pool(name, WorkPoolUpdate(**update))
                change(f"updated work pool {name!r}: {_what(pool, update)}")
        for q, (limit, description) in spec["queues"].items():
            try:
                queue = await client.read_work_queue_by_name(q, work_pool_name=name)
            except ObjectNotFound:
                await client.create_work_queue(q, work_pool_name=name, concurrency_limit=limit, description=description)
                change(f"created work queue {q!r} in pool {name!r} (concurrency limit {limit})")
                continue
            if update := _differing(queue, {"concurrency_limit": limit, "description": description}):
                await client.update_work_queue(queue.id, **update)
                change(f"updated work queue {q!r} in pool {name!r}: {_what(queue, update)}")
        # Not deleted: runs may still wait in it. Prefect creates `default` in every pool; nothing sends runs there.
        for queue in await client.read_work_queues(work_pool_name=name):
            if queue.name not in spec["queues"] and queue.name != "default":
                log(
                    f"warning: work queue {queue.name!r} in pool {name!r} is not one of {list(spec['queues'])} "
                    f"(deployments/prefect.yaml); once nothing uses it: "
                    f"`prefect work-queue delete {queue.name} --pool {name}`"
                )


async def ensure_automation(client, desired, change) -> None:
    """The automation named `desired.name`, exactly once and as desired."""
    from prefect.client.schemas.sorting import AutomationSort
    from prefect.events.filters import AutomationFilter, AutomationFilterName
    from prefect.events.schemas.automations import AutomationCore

    name = desired.name
    found = await client.read_automations(
        automations=AutomationFilter(name=AutomationFilterName(any_=[name])),
        sort=AutomationSort.CREATED_DESC,
    )
    found = [a for a in found if a.name == name]
    if not found:
        await client.create_automation(desired)
        change(f"created automation {name!r}")
        return
    keep, extra = found[-1], found[:-1]  # the oldest stays: its id is the one already known
    for dup in extra:  # exactly one: two would both fire on the same run
        await client.delete_automation(dup.id)
        change(f"deleted duplicate automation {name!r} {dup.id}")
    if AutomationCore.model_validate(keep.model_dump(exclude={"id"})) != desired:
        await client.update_automation(keep.id, desired)
        change(f"updated automation {name!r} ({keep.id})")


async def deploy(client, prefect_file: Path, deployments: list[dict[str, Any]], change, log) -> None:
    """`prefect deploy --all`: a deployment that was not there before is a change; the others are updated in place."""
    wanted = {(d["entrypoint"], d["name"]) for d in deployments}
    before = {(d.entrypoint, d.name) for d in await client.read_deployments()}
    env = dict(os.environ)
    # `prefect deploy` substitutes environment variables into the pull steps at deploy time when they are set; the
    # working directory must come from the worker's environment at run time instead.
    env.pop("EYRIE_HOME", None)
    env["PREFECT_CLI_PROMPT"] = "false"
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)]
    proc = await asyncio.to_thread(subprocess.run, cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SetupError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    if missing := wanted - {(d.entrypoint, d.name) for d in await client.read_deployments()}:
        raise SetupError(f"after `prefect deploy`, these deployments are missing: {sorted(missing)}")
    for entrypoint, name in sorted(wanted - before):
        change(f"created deployment {name!r} ({entrypoint})")
    log(f"prefect deploy --all: {len(wanted)} deployments applied, {len(wanted - before)} new")
    await lay_out_forms(client, wanted)


async def lay_out_forms(client, wanted: set[tuple[str, str]]) -> None:
    """Each deployment's parameter schema stored with a `position` on every field at every depth (deployments/form.py),
    so that Prefect's run form reads in pipeline order rather than in the server's key order. `prefect deploy` writes
    the schema without them each time it runs, so this follows every deploy; it is part of applying the deployments,
    not a change of its own."""
    from prefect.client.schemas.actions import DeploymentUpdate

    from deployments.form import flow_parameter_schema

    schemas: dict[str, dict[str, Any]] = {}
    for d in await client.read_deployments():
        if (d.entrypoint, d.name) not in wanted:
            continue
        if d.entrypoint not in schemas:
            schemas[d.entrypoint] = await asyncio.to_thread(flow_parameter_schema, d.entrypoint, REPO)
        if d.parameter_openapi_schema != schemas[d.entrypoint]:
            update = DeploymentUpdate.model_validate({"parameter_openapi_schema": schemas[d.entrypoint]})
            await client.update_deployment(d.id, update)


async def setup(
    prefect_file: Path = PREFECT_FILE, deploy_too: bool = True, log=print, notify_block: str | None = None
) -> list[str]:
    """Makes the server match prefect.yaml; returns the changes it made, each already logged."""
    from prefect.client.orchestration import get_client

    nodes, deployments = load_prefect_file(prefect_file)
    log(f"GPU nodes (deployments/prefect.yaml): {', '.join(nodes)}")
    changes: list[str] = []

    def change(msg: str) -> None:
        changes.append(msg)
        log(msg)

    async with get_client() as client:
        if (err := await client.api_healthcheck()) is not None:
            raise SetupError(f"cannot reach the Prefect API at {client.api_url}: {err}")
        pools = work_pools(nodes)
        await ensure_work_pools(client, pools, change, log)
        await ensure_automation(client, zombie_automation(zombie_window(prefect_file)), change)
        if notify_block:
            await ensure_automation(client, failed_run_automation(await notify_block_id(client, notify_block)), change)
        else:  # an automation made earlier stays: an operator may have set it up by hand
            log(
                f"warning: no --notify-block (or ${NOTIFY_BLOCK_ENV}): a failed or crashed GPU run notifies no one; "
                "create a notification block (e.g. a Slack webhook) and pass it as TYPE/NAME"
            )
        if deploy_too:
            await deploy(client, prefect_file, deployments, change, log)
    return changes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.setup", description=__doc__.split("\n\n")[0])
    p.add_argument("--api-url", help="Prefect API URL, e.g. http://host:4200/api (default: $PREFECT_API_URL)")
    p.add_argument("--prefect-file", type=Path, default=PREFECT_FILE)
    p.add_argument("--no-deploy", action="store_true", help="only the pools, queues and automations")
    p.add_argument(
        "--notify-block",
        default=os.environ.get(NOTIFY_BLOCK_ENV) or None,
        metavar="TYPE/NAME",
        help=f"notification block for a failed or crashed GPU run, e.g. slack-webhook/oncall (${NOTIFY_BLOCK_ENV})",
    )
    p.add_argument("--check-node", metavar="NAME", help="exit 1 unless NAME is a GPU node of the file; no server")
    args = p.parse_args(argv)

    if args.check_node is not None:
        try:
            if args.check_node in (nodes := gpu_nodes(args.prefect_file)):
                return 0
            raise SetupError(f"{args.check_node!r} is not a GPU node of {args.prefect_file} ({', '.join(nodes)})")
        except SetupError as err:
            print(f"deployments.setup: error: {err}: add it to definitions.gpu_nodes and run setup", file=sys.stderr)
            return 1
    if args.api_url:
        os.environ["PREFECT_API_URL"] = args.api_url  # before Prefect reads its settings; inherited by `prefect deploy`
    from prefect.settings import get_current_settings

    api_url = get_current_settings().api.url  # the environment, else the active Prefect profile
    if not api_url:
        # Without one the client would start a temporary local server and "succeed" against a throw-away database.
        print("deployments.setup: error: no Prefect server: pass --api-url or set PREFECT_API_URL", file=sys.stderr)
        return 2
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        changes = asyncio.run(
            setup(args.prefect_file.resolve(), deploy_too=not args.no_deploy, notify_block=args.notify_block)
        )
    except SetupError as err:
        print(f"deployments.setup: error: {err}", file=sys.stderr)
        return 1
    except PrefectHTTPStatusError as err:
        code = err.response.status_code
        hint = " (set PREFECT_API_AUTH_STRING to the server's PREFECT_SERVER_API_AUTH_STRING)" if code == 401 else ""
        print(f"deployments.setup: error: {api_url} answered {code}{hint}: {err}", file=sys.stderr)
        return 1
    print(f"{len(changes)} change(s) on {api_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
