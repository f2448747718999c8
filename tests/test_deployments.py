"""deployments/setup.py against a real Prefect server: everything it creates, twice, and nothing new the second time.

The server is a real `prefect server start` on a free loopback port, on PostgreSQL (tests/prefect_server.py), with
authentication on, stopped at the end. deployments/setup.py runs as the operator runs it, in a subprocess; what it
created is read back here through Prefect's client, independently of setup.py's own report.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO
from prefect_server import http_status, running_prefect_server

from eyrie.stages import UNTIL

PIPELINE = "eyrie-pipeline/production"
EXTRACT = "eyrie-extract/production"
NODE = "eyrie-extract/node"
FANOUT = "eyrie-extract-fanout/production"
DEPLOYMENTS = (PIPELINE, EXTRACT, NODE, FANOUT)
GPU_POOL, CONTROL_POOL = "eyrie-gpu", "eyrie-control"
# pool: (pool concurrency limit, {queue: queue concurrency limit}). The GPU pool's limit is the number of GPU queues:
# one run per node, the nodes side by side.
POOLS = {GPU_POOL: (2, {"gpu-node-1": 1, "gpu-node-2": 1}), CONTROL_POOL: (None, {"control": None})}


@pytest.fixture(scope="module")
def prefect_server(postgres, tmp_path_factory):
    """A real Prefect server on PostgreSQL, on a database of its own (this module checks what a first setup run
    creates, so it needs an empty server whatever ran before), with authentication on."""
    with running_prefect_server(
        postgres, tmp_path_factory.mktemp("prefect-server"), "eyrie_deployments", services=False
    ) as server:
        yield server


def _setup_process(server, *args: str, auth: str | None = None) -> subprocess.CompletedProcess:
    # EYRIE_HOME is set on purpose: setup.py must keep it out of the deployment (the worker's value applies at run
    # time). The URL comes from --api-url, as an operator passes it.
    env = server.client_env(
        server.root / "client-home",
        PREFECT_API_AUTH_STRING=auth or server.auth,
        EYRIE_HOME="/deploying/machine/checkout",
    )
    env.pop("PREFECT_API_URL")
    return subprocess.run(
        [sys.executable, "-m", "deployments.setup", "--api-url", server.url, "--json", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _run_setup(server, *args: str) -> tuple[dict, list[str]]:
    """Runs `python -m deployments.setup --json`; returns its report and its log lines (what it wrote)."""
    proc = _setup_process(server, *args)
    assert proc.returncode == 0, f"setup failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    log = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith(("created ", "updated ", "deleted ", "warning: ", "prefect deploy"))
    ]
    return json.loads(proc.stdout), log


def _client(server):
    return server.client()


async def _read_back(server) -> dict:
    """What the server holds, read through Prefect's client (not through setup.py's snapshot)."""
    async with _client(server) as c:
        pools = {p: await c.read_work_pool(p) for p in POOLS}
        queues = {
            (p, q): await c.read_work_queue_by_name(q, work_pool_name=p) for p, (_, qs) in POOLS.items() for q in qs
        }
        automations = [a for a in await c.read_automations() if a.name == "Crash zombie flows"]
        deployments = {n: await c.read_deployment_by_name(n) for n in DEPLOYMENTS}
        counts = {
            "work_pools": len(await c.read_work_pools()),
            "work_queues": {p: len(await c.read_work_queues(work_pool_name=p)) for p in POOLS},
            "global_concurrency_limits": len(await c.read_global_concurrency_limits(limit=200)),
            "global_limit_names": sorted(g.name for g in await c.read_global_concurrency_limits(limit=200)),
            "automations": len(await c.read_automations()),
            "deployments": len(await c.read_deployments()),
            "flows": len(await c.read_flows()),
        }
    return {
        "pools": pools,
        "queues": queues,
        "automations": automations,
        "deployments": deployments,
        "counts": counts,
    }


async def _create_queue(server, name: str, pool: str) -> None:
    async with _client(server) as c:
        await c.create_work_queue(name, work_pool_name=pool)


def _ids(state: dict) -> dict:
    return {
        "pools": {n: p.id for n, p in state["pools"].items()},
        "queues": {n: q.id for n, q in state["queues"].items()},
        "automations": sorted(a.id for a in state["automations"]),
        "deployments": {n: d.id for n, d in state["deployments"].items()},
        "deployment_limits": {
            n: d.global_concurrency_limit and d.global_concurrency_limit.id for n, d in state["deployments"].items()
        },
        "schedules": {n: sorted(s.id for s in d.schedules) for n, d in state["deployments"].items()},
    }


@pytest.mark.slow
def test_setup_creates_everything_once_and_is_idempotent(prefect_server):
    from prefect.client.schemas.objects import StateType
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.exceptions import PrefectHTTPStatusError

    from eyrie.config import load_config, parse_config

    t0 = time.monotonic()
    # Authentication is on: without credentials the API refuses, with them it answers.
    assert http_status(f"{prefect_server.url}/work_pools/") == 401
    assert http_status(f"{prefect_server.url}/admin/version", prefect_server.auth) == 200
    wrong = _setup_process(prefect_server, auth="eyrie-admin:wrong")
    assert wrong.returncode == 1 and "answered 401" in wrong.stderr, wrong.stderr

    first, first_log = _run_setup(prefect_server)
    t_first = time.monotonic() - t0
    state1 = asyncio.run(_read_back(prefect_server))

    # Work pools, type process: the GPU pool (limit 2: one run per node, the nodes side by side), one queue per node,
    # limit 1 each; the fan-out parents' pool (no limit) and its queue.
    for name, (limit, queues) in POOLS.items():
        pool = state1["pools"][name]
        assert pool.type == "process" and pool.concurrency_limit == limit, name
        for q, q_limit in queues.items():
            queue = state1["queues"][name, q]
            assert queue.work_pool_id == pool.id and queue.concurrency_limit == q_limit, (name, q)
    # Besides Prefect's `default` queue, each pool holds only its own queues.
    assert state1["counts"]["work_queues"] == {p: len(qs) + 1 for p, (_, qs) in POOLS.items()}
    # No global concurrency limit besides the deployments' own (`deployment:<id>`): the queues keep one run per node.
    names = state1["counts"]["global_limit_names"]
    assert names and all(n.startswith("deployment:") for n in names), names
    # The zombie-run automation, exactly once: heartbeats missing -> CRASHED.
    assert len(state1["automations"]) == 1
    zombie = state1["automations"][0]
    assert zombie.enabled
    assert isinstance(zombie.trigger, EventTrigger)
    assert zombie.trigger.posture == Posture.Proactive
    assert zombie.trigger.after == {"prefect.flow-run.heartbeat"}
    assert "prefect.flow-run.heartbeat" in zombie.trigger.expect
    assert zombie.trigger.for_each == {"prefect.resource.id"}
    assert [(a.type, a.state) for a in zombie.actions] == [("change-flow-run-state", StateType.CRASHED)]

    # Deployments: pool/queue, concurrency 1 with ENQUEUE, schema enforced, code from $EYRIE_HOME at run time.
    # A node's share of a fan-out has no deployment-wide limit (the nodes run at once; each node's queue has 1).
    for name, d in state1["deployments"].items():
        assert d.work_pool_name == (CONTROL_POOL if name == FANOUT else GPU_POOL), name
        assert d.work_queue_name == ("control" if name == FANOUT else "gpu-node-1"), name
        if name == NODE:
            assert d.global_concurrency_limit is None, name
        else:
            assert d.global_concurrency_limit is not None and d.global_concurrency_limit.limit == 1, name
            assert d.concurrency_options.collision_strategy.value == "ENQUEUE", name
        assert d.enforce_parameter_schema is True, name
        assert d.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $EYRIE_HOME }}"}}
        ], name
        # The heartbeat frequency the automation's window is sized for.
        assert d.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "60", name
    pipeline = state1["deployments"][PIPELINE]
    assert pipeline.entrypoint == "flows/pipeline.py:pipeline_flow"
    assert state1["deployments"][EXTRACT].entrypoint == "flows/extract.py:extract_run_flow"
    assert state1["deployments"][NODE].entrypoint == "flows/extract.py:extract_flow"
    assert state1["deployments"][FANOUT].entrypoint == "flows/fanout.py:extract_fanout_flow"
    assert state1["deployments"][FANOUT].parameters == {"queues": ["gpu-node-1", "gpu-node-2"]}
    assert "shards" in state1["deployments"][NODE].parameter_openapi_schema["properties"]
    # `config` is the PipelineConfig model (the UI renders it as a form).
    schema = pipeline.parameter_openapi_schema
    assert schema["properties"]["config"]["$ref"] == "#/definitions/PipelineConfig"
    assert set(schema["required"]) == {"config", "run_dir"}
    assert schema["properties"]["until"]["enum"] == list(UNTIL)

    # The weekly schedule: Sunday 03:00 UTC, inactive, carrying the production preset unchanged.
    assert len(pipeline.schedules) == 1
    weekly = pipeline.schedules[0]
    assert weekly.slug == "weekly-retrain" and weekly.active is False
    assert weekly.schedule.cron == "0 3 * * 0" and weekly.schedule.timezone == "UTC"
    assert parse_config(weekly.parameters["config"]) == load_config(REPO / "configs" / "kimi-k2.5-tp8.yaml")
    assert state1["deployments"][EXTRACT].schedules == []

    # setup.py's own before/after report agrees: the first run created all of it.
    assert first["before"]["work_pools"] == {GPU_POOL: None, CONTROL_POOL: None}
    assert all(first["after"]["work_pools"].values())
    assert first["changes"]
    assert sum(line.startswith("created ") for line in first_log) == 6  # 2 pools, 3 queues, automation

    # --- second run: nothing new, nothing changed
    second, second_log = _run_setup(prefect_server)
    state2 = asyncio.run(_read_back(prefect_server))
    assert _ids(state2) == _ids(state1)
    assert state2["counts"] == state1["counts"]
    assert second["changes"] == [], second["changes"]
    assert second["before"] == second["after"] == first["after"]
    assert second_log == ["prefect deploy --all: done"]  # nothing created, updated or deleted

    # --- the server checks parameters when a run is created
    async def create_runs():
        async with _client(prefect_server) as c:
            bad = copy.deepcopy(weekly.parameters)
            bad["config"]["data"]["max_length"] = "abc"
            with pytest.raises(PrefectHTTPStatusError) as err:
                await c.create_flow_run_from_deployment(pipeline.id, parameters=bad)
            unknown_key = copy.deepcopy(weekly.parameters)
            unknown_key["config"]["train"]["epoch"] = 3  # a typo of `epochs`
            with pytest.raises(PrefectHTTPStatusError) as err_extra:
                await c.create_flow_run_from_deployment(pipeline.id, parameters=unknown_key)
            with pytest.raises(PrefectHTTPStatusError) as err_missing:
                await c.create_flow_run_from_deployment(pipeline.id, parameters={"config": weekly.parameters["config"]})
            # Control: the schedule's own parameters are accepted and the run waits in the GPU node's queue.
            good = await c.create_flow_run_from_deployment(pipeline.id, parameters=weekly.parameters)
            runs = await c.read_flow_runs()
            return err.value, err_extra.value, err_missing.value, good, runs

    bad, extra, missing, good, runs = asyncio.run(create_runs())
    assert bad.response.status_code == 409
    assert "config.data.max_length" in bad.response.json()["detail"]
    assert "'abc' is not of type 'integer'" in bad.response.json()["detail"]
    assert extra.response.status_code == 409 and "epoch" in extra.response.json()["detail"]
    assert missing.response.status_code == 409 and "run_dir" in missing.response.json()["detail"]
    assert good.state.type == StateType.SCHEDULED and good.work_queue_name == "gpu-node-1"
    assert [r.id for r in runs] == [good.id]  # the rejected ones were never created

    # --- drift is put back, keeping the ids: someone removed the GPU pool's limit and gave the control pool one,
    # edited queues' limits, paused the automation and created a second copy of it
    async def drift():
        from prefect.client.schemas.actions import WorkPoolUpdate

        from deployments.setup import zombie_automation

        async with _client(prefect_server) as c:
            await c.update_work_pool(GPU_POOL, WorkPoolUpdate(concurrency_limit=None))
            await c.update_work_pool(CONTROL_POOL, WorkPoolUpdate(concurrency_limit=1))
            await c.update_work_queue(state1["queues"][GPU_POOL, "gpu-node-2"].id, concurrency_limit=3)
            await c.update_work_queue(state1["queues"][GPU_POOL, "gpu-node-1"].id, concurrency_limit=None)
            await c.update_work_queue(state1["queues"][CONTROL_POOL, "control"].id, concurrency_limit=5)
            await c.pause_automation(zombie.id)
            return await c.create_automation(zombie_automation())

    duplicate = asyncio.run(drift())
    drifted = asyncio.run(_read_back(prefect_server))
    assert drifted["pools"][GPU_POOL].concurrency_limit is None  # the edits took
    assert drifted["pools"][CONTROL_POOL].concurrency_limit == 1
    third, third_log = _run_setup(prefect_server, "--no-deploy")
    state3 = asyncio.run(_read_back(prefect_server))
    for name, (limit, queues) in POOLS.items():
        assert state3["pools"][name].concurrency_limit == limit, name
        for q, q_limit in queues.items():
            assert state3["queues"][name, q].concurrency_limit == q_limit, (name, q)
    assert [a.id for a in state3["automations"]] == [zombie.id] and state3["automations"][0].enabled
    assert _ids(state3) == _ids(state1) and state3["counts"] == state1["counts"]
    assert sorted(third_log) == sorted(
        [
            "updated work pool 'eyrie-gpu': ['concurrency_limit']",
            "updated work pool 'eyrie-control': ['concurrency_limit']",
            "updated work queue 'gpu-node-1' in pool 'eyrie-gpu': concurrency limit None -> 1",
            "updated work queue 'gpu-node-2' in pool 'eyrie-gpu': concurrency limit 3 -> 1",
            "updated work queue 'control' in pool 'eyrie-control': concurrency limit 5 -> None",
            f"deleted duplicate automation 'Crash zombie flows' {duplicate}",
            f"updated automation 'Crash zombie flows' ({zombie.id})",
        ]
    )
    # A fourth run finds nothing to do.
    fourth, fourth_log = _run_setup(prefect_server, "--no-deploy")
    assert fourth["changes"] == [] and fourth_log == [], (fourth["changes"], fourth_log)

    # A queue it does not manage in one of its pools (the `control` queue an earlier version kept in the GPU pool) is
    # reported, and left alone: runs may still wait in it.
    asyncio.run(_create_queue(prefect_server, "control", GPU_POOL))
    fifth, fifth_log = _run_setup(prefect_server, "--no-deploy")
    assert fifth["changes"] == [], fifth["changes"]
    assert fifth_log == [
        "warning: work queue 'control' in pool 'eyrie-gpu' is not managed by deployments/setup.py "
        "(it manages ['gpu-node-1', 'gpu-node-2']); once nothing uses it: "
        "`prefect work-queue delete control --pool eyrie-gpu`"
    ], fifth_log

    print(f"\nfirst setup run {t_first:.1f}s; whole test body {time.monotonic() - t0:.1f}s")


def test_prefect_yaml_is_valid_for_prefect_deploy():
    """The file validates as Prefect 3.7's prefect.yaml, and setup.py's own checks pass (no server needed)."""
    from deployments.setup import deployment_full_names, load_prefect_file

    deployments = load_prefect_file()
    assert deployment_full_names(deployments) == list(DEPLOYMENTS)
    raw = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    assert raw["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $EYRIE_HOME }}"}}]
    for d, name in zip(deployments, DEPLOYMENTS):
        if name != NODE:  # the nodes of a fan-out run side by side
            assert d["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}, name
        assert d["enforce_parameter_schema"] is True, name
    # The weekly schedule inlines the production preset: the two must not drift apart.
    from eyrie.config import load_config, parse_config

    (weekly,) = deployments[0]["schedules"]
    assert parse_config(weekly["parameters"]["config"]) == load_config(REPO / "configs" / "kimi-k2.5-tp8.yaml")


@pytest.mark.parametrize(
    "edit, message",
    ids=[
        "other-pool",
        "other-queue",
        "queue-of-other-pool",
        "no-queue",
        "gpu-flow-on-control",
        "fanout-on-gpu",
        "fanout-to-control",
    ],
    argvalues=[
        # A pool it does not create.
        (
            lambda ds: ds[0]["work_pool"].update(name="eyrie-gpus"),
            "uses work pool 'eyrie-gpus'; this setup creates only 'eyrie-gpu' (queues ['gpu-node-1', 'gpu-node-2']), "
            "'eyrie-control' (queues ['control'])",
        ),
        # A queue it does not create, and one of the other pool.
        (
            lambda ds: ds[0]["work_pool"].update(work_queue_name="gpu-node-3"),
            "names work queue 'gpu-node-3' in pool 'eyrie-gpu', which has only ['gpu-node-1', 'gpu-node-2']",
        ),
        (
            lambda ds: ds[3]["work_pool"].update(name="eyrie-gpu"),
            "names work queue 'control' in pool 'eyrie-gpu', which has only ['gpu-node-1', 'gpu-node-2']; "
            "'control' is a queue of pool 'eyrie-control'",
        ),
        (lambda ds: ds[0]["work_pool"].pop("work_queue_name"), "lacks `work_pool.work_queue_name`"),
        # A GPU flow on the control pool (outside the GPU pool's limit); the fan-out's parent on a GPU node's queue.
        (
            lambda ds: ds[0]["work_pool"].update(name="eyrie-control", work_queue_name="control"),
            "uses work pool 'eyrie-control'; it must use 'eyrie-gpu'",
        ),
        (
            lambda ds: ds[3]["work_pool"].update(name="eyrie-gpu", work_queue_name="gpu-node-2"),
            "uses work pool 'eyrie-gpu'; it must use 'eyrie-control'",
        ),
        # The fan-out sends shares only to GPU node queues.
        (
            lambda ds: ds[3]["parameters"].update(queues=["gpu-node-1", "control"]),
            "names 'control' in its `queues` parameter; the GPU node queues this setup creates in pool 'eyrie-gpu' are "
            "['gpu-node-1', 'gpu-node-2']",
        ),
    ],
)
def test_prefect_yaml_may_use_only_the_pools_and_queues_setup_creates(tmp_path, edit, message):
    from deployments.setup import SetupError, load_prefect_file

    raw = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    raw.pop("definitions")  # the anchors are resolved; edit each deployment's own copy
    raw["deployments"] = [copy.deepcopy(d) for d in raw["deployments"]]
    edit(raw["deployments"])
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SetupError) as err:
        load_prefect_file(path)
    assert message in str(err.value), str(err.value)
