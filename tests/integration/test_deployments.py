"""deployments/setup.py against a real Prefect server: everything it creates, twice, and nothing new the second time.

The server is a real `prefect server start` on a free loopback port, on PostgreSQL (tests/prefect_server.py), with
authentication on, stopped at the end. deployments/setup.py runs as the operator runs it, in a subprocess; what it
created is read back here through Prefect's client, independently of the lines setup.py prints. What it expects of
the GPU nodes comes from their one declaration, `definitions.gpu_nodes` in deployments/prefect.yaml; a test adds a
third node there (one line) and finds its queue, the pool's limit and the fan-out's shares follow.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO
from prefect_server import http_status, running_prefect_server

from deployments.setup import gpu_nodes
from eyrie.stages import UNTIL

PIPELINE = "eyrie-pipeline/production"
EXTRACT = "eyrie-extract/production"
NODE = "eyrie-extract/node"
REGENERATE_NODE = "eyrie-regenerate/node"
FANOUT = "eyrie-extract-fanout/production"
DEPLOYMENTS = (PIPELINE, EXTRACT, NODE, REGENERATE_NODE, FANOUT)
GPU_POOL, CONTROL_POOL = "eyrie-gpu", "eyrie-control"
PREFECT_YAML = REPO / "deployments" / "prefect.yaml"
NODES = gpu_nodes(PREFECT_YAML)  # the declaration
N_DEPLOYMENTS = len(DEPLOYMENTS)


def pools(nodes: list[str]) -> dict:
    """pool: (pool concurrency limit, {queue: queue concurrency limit}): one queue per GPU node, limit 1 each; the GPU
    pool's limit is the number of nodes (one run per node, the nodes side by side)."""
    return {GPU_POOL: (len(nodes), {n: 1 for n in nodes}), CONTROL_POOL: (None, {"control": None})}


POOLS = pools(NODES)


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
        [sys.executable, "-m", "deployments.setup", "--api-url", server.url, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


NO_NOTIFY_WARNING = "warning: no --notify-block"  # these tests give no block; the last test checks the warning


def _run_setup(server, *args: str) -> list[str]:
    """Runs `python -m deployments.setup`; returns what it printed, line by line, after the node list it read (and
    without the warning that no notification block was given, which the module's last test checks)."""
    proc = _setup_process(server, *args)
    assert proc.returncode == 0, f"setup failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("GPU nodes (deployments/prefect.yaml): "), lines
    assert lines[-1].endswith(f" change(s) on {server.url}"), lines
    return [line for line in lines[1:] if not line.startswith(NO_NOTIFY_WARNING)]


def _changes(lines: list[str]) -> int:
    """The count on the last line, checked against the lines that announce a change."""
    count = int(lines[-1].split()[0])
    assert count == sum(line.startswith(("created ", "updated ", "deleted ")) for line in lines), lines
    return count


def _client(server):
    return server.client()


async def _read_back(server, nodes: list[str] = NODES) -> dict:
    """What the server holds, read through Prefect's client."""
    wanted = pools(nodes)
    async with _client(server) as c:
        pools_ = {p: await c.read_work_pool(p) for p in wanted}
        queues = {
            (p, q): await c.read_work_queue_by_name(q, work_pool_name=p) for p, (_, qs) in wanted.items() for q in qs
        }
        automations = [a for a in await c.read_automations() if a.name == "Crash zombie flows"]
        deployments = {n: await c.read_deployment_by_name(n) for n in DEPLOYMENTS}
        counts = {
            "work_pools": len(await c.read_work_pools()),
            "work_queues": {p: len(await c.read_work_queues(work_pool_name=p)) for p in wanted},
            "global_concurrency_limits": len(await c.read_global_concurrency_limits(limit=200)),
            "global_limit_names": sorted(g.name for g in await c.read_global_concurrency_limits(limit=200)),
            "automations": len(await c.read_automations()),
            "deployments": len(await c.read_deployments()),
            "flows": len(await c.read_flows()),
        }
    return {
        "pools": pools_,
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


def _assert_form_in_declaration_order(schema: dict) -> None:
    """Each model of eyrie/config.py in the stored schema, laid out by `position` as Prefect's UI does, reads in
    its declaration order."""
    import eyrie.config as config_module

    assert schema["definitions"], schema.keys()
    for name, model_schema in schema["definitions"].items():
        props = model_schema["properties"]
        declared = [f.alias or n for n, f in getattr(config_module, name).model_fields.items()]
        assert sorted(props, key=lambda k: props[k].get("position", 0)) == declared, name
    top = schema["properties"]
    assert [top[k].get("position") for k in sorted(top, key=lambda k: top[k]["position"])] == list(range(len(top)))


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

    first_log = _run_setup(prefect_server)
    t_first = time.monotonic() - t0
    state1 = asyncio.run(_read_back(prefect_server))

    # Work pools, type process: the GPU pool (limit: one run per node, the nodes side by side), one queue per node,
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
        assert d.work_queue_name == ("control" if name == FANOUT else NODES[0]), name  # the first node by default
        if name in (NODE, REGENERATE_NODE):
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
    assert state1["deployments"][FANOUT].parameters["queues"] == NODES  # every node gets a share
    assert state1["deployments"][REGENERATE_NODE].entrypoint == "flows/regenerate.py:regenerate_flow"
    for node in (NODE, REGENERATE_NODE):
        assert "shards" in state1["deployments"][node].parameter_openapi_schema["properties"]
    # `config` is the PipelineConfig model (the UI renders it as a form).
    schema = pipeline.parameter_openapi_schema
    assert schema["properties"]["config"]["$ref"] == "#/definitions/PipelineConfig"
    assert set(schema["required"]) == {"config", "run_dir"}
    assert schema["properties"]["until"]["enum"] == list(UNTIL)
    # The run form: PostgreSQL hands the schema's keys back sorted by length; every field at every depth keeps the
    # `position` of its declaration (pipeline order), by which Prefect's UI lays the form out.
    _assert_form_in_declaration_order(schema)
    # The production deployments open their form filled with the production preset.
    preset = load_config(REPO / "configs" / "kimi-k2.5-tp8.yaml")
    for name in (PIPELINE, EXTRACT, FANOUT):
        params = state1["deployments"][name].parameters
        assert parse_config(params["config"]) == preset and params["run_dir"] == "/data/runs/kimi", name
        _assert_form_in_declaration_order(state1["deployments"][name].parameter_openapi_schema)

    # The weekly schedule: Sunday 03:00 UTC, inactive, carrying the production preset unchanged.
    assert len(pipeline.schedules) == 1
    weekly = pipeline.schedules[0]
    assert weekly.slug == "weekly-retrain" and weekly.active is False
    assert weekly.schedule.cron == "0 3 * * 0" and weekly.schedule.timezone == "UTC"
    assert parse_config(weekly.parameters["config"]) == load_config(REPO / "configs" / "kimi-k2.5-tp8.yaml")
    assert state1["deployments"][EXTRACT].schedules == []

    # setup.py's own before/after report agrees: the first run created all of it.
    # What setup printed agrees: the first run created all of it, one line each.
    n_queues = sum(len(qs) for _, qs in POOLS.values())
    assert _changes(first_log) == len(POOLS) + n_queues + 1 + N_DEPLOYMENTS  # pools, queues, automation, deployments
    assert sum(line.startswith("created work queue ") for line in first_log) == n_queues
    assert f"prefect deploy --all: {N_DEPLOYMENTS} deployments applied, {N_DEPLOYMENTS} new" in first_log

    # --- second run: nothing new, nothing changed
    second_log = _run_setup(prefect_server)
    state2 = asyncio.run(_read_back(prefect_server))
    # `prefect deploy` wrote the schema again, without positions; setup put them back.
    _assert_form_in_declaration_order(state2["deployments"][PIPELINE].parameter_openapi_schema)
    assert _ids(state2) == _ids(state1)
    assert state2["counts"] == state1["counts"]
    # Nothing created, updated or deleted, and it says so.
    assert second_log == [
        f"prefect deploy --all: {N_DEPLOYMENTS} deployments applied, 0 new",
        f"0 change(s) on {prefect_server.url}",
    ]

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
            # A required parameter missing (a node deployment has no parameters of its own to fill it in).
            node = state1["deployments"][NODE]
            with pytest.raises(PrefectHTTPStatusError) as err_missing:
                await c.create_flow_run_from_deployment(node.id, parameters={"config": weekly.parameters["config"]})
            # Control: the schedule's own parameters are accepted and the run waits in the GPU node's queue.
            good = await c.create_flow_run_from_deployment(pipeline.id, parameters=weekly.parameters)
            # A run given only a config takes the rest from the deployment's preset, as the run form does.
            filled = await c.create_flow_run_from_deployment(
                pipeline.id, parameters={"config": weekly.parameters["config"]}
            )
            runs = await c.read_flow_runs()
            return err.value, err_extra.value, err_missing.value, good, filled, runs

    bad, extra, missing, good, filled, runs = asyncio.run(create_runs())
    assert bad.response.status_code == 409
    assert "config.data.max_length" in bad.response.json()["detail"]
    assert "'abc' is not of type 'integer'" in bad.response.json()["detail"]
    assert extra.response.status_code == 409 and "epoch" in extra.response.json()["detail"]
    assert missing.response.status_code == 409 and "run_dir" in missing.response.json()["detail"]
    assert good.state.type == StateType.SCHEDULED and good.work_queue_name == NODES[0]
    assert filled.parameters["run_dir"] == "/data/runs/kimi" and filled.parameters["until"] == "evaluate"
    assert {r.id for r in runs} == {good.id, filled.id}  # the rejected ones were never created

    # --- drift is put back, keeping the ids: someone removed the GPU pool's limit and gave the control pool one,
    # edited queues' limits, paused the automation and created a second copy of it
    async def drift():
        from prefect.client.schemas.actions import WorkPoolUpdate

        from deployments.setup import zombie_automation

        async with _client(prefect_server) as c:
            await c.update_work_pool(GPU_POOL, WorkPoolUpdate(concurrency_limit=None))
            await c.update_work_pool(CONTROL_POOL, WorkPoolUpdate(concurrency_limit=1))
            await c.update_work_queue(state1["queues"][GPU_POOL, NODES[1]].id, concurrency_limit=3)
            await c.update_work_queue(state1["queues"][GPU_POOL, NODES[0]].id, concurrency_limit=None)
            await c.update_work_queue(state1["queues"][CONTROL_POOL, "control"].id, concurrency_limit=5)
            await c.pause_automation(zombie.id)
            return await c.create_automation(zombie_automation())

    duplicate = asyncio.run(drift())
    drifted = asyncio.run(_read_back(prefect_server))
    assert drifted["pools"][GPU_POOL].concurrency_limit is None  # the edits took
    assert drifted["pools"][CONTROL_POOL].concurrency_limit == 1
    third_log = _run_setup(prefect_server, "--no-deploy")
    state3 = asyncio.run(_read_back(prefect_server))
    for name, (limit, queues) in POOLS.items():
        assert state3["pools"][name].concurrency_limit == limit, name
        for q, q_limit in queues.items():
            assert state3["queues"][name, q].concurrency_limit == q_limit, (name, q)
    assert [a.id for a in state3["automations"]] == [zombie.id] and state3["automations"][0].enabled
    assert _ids(state3) == _ids(state1) and state3["counts"] == state1["counts"]
    first_node, second_node = NODES[:2]
    assert sorted(third_log[:-1]) == sorted(
        [
            f"updated work pool 'eyrie-gpu': concurrency_limit None -> {len(NODES)}",
            "updated work pool 'eyrie-control': concurrency_limit 1 -> None",
            f"updated work queue '{first_node}' in pool 'eyrie-gpu': concurrency_limit None -> 1",
            f"updated work queue '{second_node}' in pool 'eyrie-gpu': concurrency_limit 3 -> 1",
            "updated work queue 'control' in pool 'eyrie-control': concurrency_limit 5 -> None",
            f"deleted duplicate automation 'Crash zombie flows' {duplicate}",
            f"updated automation 'Crash zombie flows' ({zombie.id})",
        ]
    )
    assert _changes(third_log) == 7
    # A fourth run finds nothing to do.
    assert _run_setup(prefect_server, "--no-deploy") == [f"0 change(s) on {prefect_server.url}"]

    # A queue it does not manage in one of its pools (the `control` queue an earlier version kept in the GPU pool) is
    # reported, and left alone: runs may still wait in it.
    asyncio.run(_create_queue(prefect_server, "control", GPU_POOL))
    assert _run_setup(prefect_server, "--no-deploy") == [
        f"warning: work queue 'control' in pool 'eyrie-gpu' is not one of {NODES} (deployments/prefect.yaml); "
        "once nothing uses it: `prefect work-queue delete control --pool eyrie-gpu`",
        f"0 change(s) on {prefect_server.url}",
    ]

    print(f"\nfirst setup run {t_first:.1f}s; whole test body {time.monotonic() - t0:.1f}s")


@pytest.mark.slow
def test_a_third_node_is_one_line_in_prefect_yaml(prefect_server, tmp_path):
    """Adding a GPU node is one line, in `definitions.gpu_nodes`: setup creates its queue and raises the pool's limit,
    and the fan-out's `queues` (an alias of the list) include it; taking it off again lowers the limit and reports
    the queue, which it leaves alone (runs may wait in it)."""
    text = PREFECT_YAML.read_text()
    last = f"    - {NODES[-1]}\n"
    assert text.count(last) == 1
    grown = tmp_path / "prefect.yaml"
    grown.write_text(text.replace(last, last + "    - gpu-node-3\n"))
    nodes = [*NODES, "gpu-node-3"]
    assert gpu_nodes(grown) == nodes

    lines = _run_setup(prefect_server, "--prefect-file", str(grown))
    assert "created work queue 'gpu-node-3' in pool 'eyrie-gpu' (concurrency limit 1)" in lines, lines
    assert f"updated work pool 'eyrie-gpu': concurrency_limit {len(NODES)} -> {len(nodes)}" in lines, lines
    state = asyncio.run(_read_back(prefect_server, nodes))
    assert state["pools"][GPU_POOL].concurrency_limit == len(nodes)
    assert state["queues"][GPU_POOL, "gpu-node-3"].concurrency_limit == 1
    assert state["deployments"][FANOUT].parameters["queues"] == nodes
    assert {d.work_queue_name for n, d in state["deployments"].items() if n != FANOUT} == {NODES[0]}

    # Off the list again (the repository's file): the limit follows; the queue is reported, not deleted.
    lines = _run_setup(prefect_server, "--no-deploy")
    assert f"updated work pool 'eyrie-gpu': concurrency_limit {len(nodes)} -> {len(NODES)}" in lines, lines
    assert any(line.startswith("warning: work queue 'gpu-node-3' in pool 'eyrie-gpu'") for line in lines), lines
    state = asyncio.run(_read_back(prefect_server, nodes))
    assert state["pools"][GPU_POOL].concurrency_limit == len(NODES)
    assert state["queues"][GPU_POOL, "gpu-node-3"] is not None


def test_prefect_yaml_is_valid_for_prefect_deploy():
    """The file validates as Prefect 3.7's prefect.yaml, and setup.py's own checks pass (no server needed)."""
    from deployments.setup import load_prefect_file

    nodes, deployments = load_prefect_file()
    assert nodes == NODES and len(nodes) >= 2
    names = {"eyrie-pipeline": "flows/pipeline.py:pipeline_flow", "eyrie-extract": "flows/extract.py:extract_run_flow"}
    assert [(d["entrypoint"], d["name"]) for d in deployments] == [
        (names["eyrie-pipeline"], "production"),
        (names["eyrie-extract"], "production"),
        ("flows/extract.py:extract_flow", "node"),
        ("flows/regenerate.py:regenerate_flow", "node"),
        ("flows/fanout.py:extract_fanout_flow", "production"),
    ]
    raw = yaml.safe_load(PREFECT_YAML.read_text())
    assert raw["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $EYRIE_HOME }}"}}]
    for d, name in zip(deployments, DEPLOYMENTS):
        if name not in (NODE, REGENERATE_NODE):  # the nodes of a fan-out run side by side
            assert d["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}, name
        assert d["enforce_parameter_schema"] is True, name
        # The GPU flows default to the first node's queue; the fan-out's shares go to every node.
        assert d["work_pool"]["work_queue_name"] == ("control" if name == FANOUT else NODES[0]), name
    assert deployments[-1]["parameters"]["queues"] == NODES  # the fan-out, last
    # The weekly schedule inlines the production preset: the two must not drift apart.
    from eyrie.config import load_config, parse_config

    (weekly,) = deployments[0]["schedules"]
    assert parse_config(weekly["parameters"]["config"]) == load_config(REPO / "configs" / "kimi-k2.5-tp8.yaml")


@pytest.mark.parametrize(
    "edit, message",
    ids=[
        "other-pool",
        "other-queue",
        "control-queue-on-gpu",
        "no-queue",
        "gpu-flow-on-control",
        "fanout-on-gpu",
        "fanout-to-some-nodes",
        "fanout-to-control",
        "node-twice",
        "node-bad-name",
        "node-named-control",
        "no-nodes",
    ],
    argvalues=[
        # A pool it does not create.
        (lambda raw: raw["deployments"][0]["work_pool"].update(name="eyrie-gpus"), "uses work pool 'eyrie-gpus'"),
        # A queue that is not a declared node, the control queue, or none (Prefect's `default`, without a limit).
        (
            lambda raw: raw["deployments"][0]["work_pool"].update(work_queue_name="gpu-node-3"),
            "names work queue 'gpu-node-3' in pool 'eyrie-gpu', whose queues are ['gpu-node-1', 'gpu-node-2'] "
            "(the GPU nodes: definitions.gpu_nodes)",
        ),
        (
            lambda raw: raw["deployments"][0]["work_pool"].update(work_queue_name="control"),
            "names work queue 'control' in pool 'eyrie-gpu'",
        ),
        (lambda raw: raw["deployments"][0]["work_pool"].pop("work_queue_name"), "names work queue None"),
        # A GPU flow on the control pool (outside the GPU pool's limit); the fan-out's parent on a GPU node's queue.
        (
            lambda raw: raw["deployments"][0]["work_pool"].update(name="eyrie-control", work_queue_name="control"),
            "uses work pool 'eyrie-control'; it must use 'eyrie-gpu'",
        ),
        (
            lambda raw: raw["deployments"][-1]["work_pool"].update(name="eyrie-gpu", work_queue_name="gpu-node-2"),
            "uses work pool 'eyrie-gpu'; it must use 'eyrie-control'",
        ),
        # The fan-out's shares go to exactly the declared nodes: a literal list in place of the alias is checked.
        (
            lambda raw: raw["deployments"][-1]["parameters"].update(queues=["gpu-node-1"]),
            "its `queues` parameter ['gpu-node-1'] must be the GPU nodes ['gpu-node-1', 'gpu-node-2']",
        ),
        (
            lambda raw: raw["deployments"][-1]["parameters"].update(queues=["gpu-node-1", "control"]),
            "must be the GPU nodes",
        ),
        # The declaration itself: each node once, by a name that can be a queue, a systemd instance and a folder.
        (lambda raw: raw["definitions"]["gpu_nodes"].append("gpu-node-1"), "must list each GPU node once"),
        (lambda raw: raw["definitions"]["gpu_nodes"].append("../gpu"), "must list each GPU node once"),
        (lambda raw: raw["definitions"]["gpu_nodes"].append("control"), "other than 'control'"),
        (lambda raw: raw["definitions"].pop("gpu_nodes"), "must list each GPU node once"),
    ],
)
def test_prefect_yaml_may_use_only_the_pools_and_queues_setup_creates(tmp_path, edit, message):
    from deployments.setup import SetupError, load_prefect_file

    raw = yaml.safe_load(PREFECT_YAML.read_text())
    # The anchors are resolved; edit each deployment's own copy.
    raw["deployments"] = [copy.deepcopy(d) for d in raw["deployments"]]
    edit(raw)
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SetupError) as err:
        load_prefect_file(path)
    assert message in str(err.value), str(err.value)


@pytest.mark.slow
def test_a_notification_block_that_does_not_exist_is_refused_with_how_to_make_it(prefect_server):
    # Last in the module: it runs setup once more on the server the tests above set up.
    proc = _setup_process(prefect_server, "--no-deploy", "--notify-block", "slack-webhook/eyrie-oncall")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no notification block 'slack-webhook/eyrie-oncall'" in proc.stderr and "create it first" in proc.stderr
    proc = _setup_process(prefect_server, "--no-deploy", "--notify-block", "eyrie-oncall")
    assert proc.returncode == 1 and "give the block as TYPE/NAME" in proc.stderr, proc.stderr
    # Without a block, setup says a failed run reaches no one (and still succeeds).
    proc = _setup_process(prefect_server, "--no-deploy")
    assert proc.returncode == 0 and NO_NOTIFY_WARNING in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_cancelling_the_fanout_parent_cancels_the_node_runs_it_started(prefect_server):
    """The fan-out's on_cancellation hook sets every run it started (node shares, the pipeline run) that is not final
    Cancelling, so their workers stop them; finished ones keep their state, runs of other parents are left alone.
    (The server's own services are off here: what changes, the hook changed.)"""
    from prefect import task
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelled, Completed, Running, Scheduled

    from flows.fanout import cancel_node_runs, extract_fanout_flow

    @task
    def share():
        pass

    async def make(c):
        parent = await c.create_flow_run(extract_fanout_flow, name="fanout-parent", state=Running())
        other = await c.create_flow_run(extract_fanout_flow, name="other-parent", state=Running())
        kids = {}
        for name, state, of in (
            ("running", Running(), parent),
            ("queued", Scheduled(), parent),
            ("done", Completed(), parent),
            ("others", Running(), other),
        ):
            tr = await c.create_task_run(share, flow_run_id=of.id, dynamic_key=name)
            kids[name] = await c.create_flow_run(extract_fanout_flow, name=name, parent_task_run_id=tr.id, state=state)
        return await c.read_flow_run(parent.id), kids

    async def states(c, kids):
        return {name: (await c.read_flow_run(k.id)).state.type for name, k in kids.items()}

    async def go(fn, *args):
        async with _client(prefect_server) as c:
            return await fn(c, *args)

    parent, kids = asyncio.run(go(make))
    with temporary_settings({PREFECT_API_URL: prefect_server.url, PREFECT_API_AUTH_STRING: prefect_server.auth}):
        cancel_node_runs(extract_fanout_flow, parent, Cancelled())
    assert asyncio.run(go(states, kids)) == {
        "running": StateType.CANCELLING,
        "queued": StateType.CANCELLED,  # not started yet: the server ends it at once (a worker has nothing to stop)
        "done": StateType.COMPLETED,
        "others": StateType.RUNNING,
    }
