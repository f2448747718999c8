"""deployments/setup.py against a real Prefect server: everything it creates, twice, and nothing new the second time.

The server is a real `prefect server start` on a free loopback port, with its own PREFECT_HOME (SQLite) and
authentication on, stopped at the end. deployments/setup.py runs as the operator runs it, in a subprocess; what it
created is read back here through Prefect's client, independently of setup.py's own report.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO

AUTH = "eyrie-admin:test-only-password"
PIPELINE = "eyrie-pipeline/production"
EXTRACT = "eyrie-extract/production"
STARTUP_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, auth: str | None = None) -> int:
    import httpx

    headers = {}
    if auth:
        import base64

        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    try:
        return httpx.get(url, headers=headers, timeout=5).status_code
    except httpx.HTTPError:
        return 0


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """A real Prefect server (SQLite under a temporary PREFECT_HOME, auth on); yields its API URL."""
    root = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update({
        "PREFECT_HOME": str(root / "home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_API_AUTH_STRING": AUTH,
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    })
    log = open(root / "server.log", "wb")
    # Its own session, so that the whole process group (uvicorn included) can be stopped at the end.
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--no-services"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while _get(f"{url}/health") != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not come up (exit {proc.poll()}):\n"
                                   + (root / "server.log").read_text()[-3000:])
            time.sleep(1)
        yield {"url": url, "root": root}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _setup_process(server, *args: str, auth: str = AUTH) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update({
        "PREFECT_HOME": str(server["root"] / "client-home"),
        "PREFECT_API_AUTH_STRING": auth,
        # Set on purpose: setup.py must keep it out of the deployment (the worker's value applies at run time).
        "EYRIE_HOME": "/deploying/machine/checkout",
    })
    return subprocess.run([sys.executable, "-m", "deployments.setup", "--api-url", server["url"], "--json", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _run_setup(server, *args: str) -> tuple[dict, list[str]]:
    """Runs `python -m deployments.setup --json`; returns its report and its log lines (what it wrote)."""
    proc = _setup_process(server, *args)
    assert proc.returncode == 0, f"setup failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    log = [line for line in proc.stderr.splitlines()
           if line.startswith(("created ", "updated ", "deleted ", "prefect deploy"))]
    return json.loads(proc.stdout), log


def _client(server):
    from prefect.client.orchestration import PrefectClient

    return PrefectClient(server["url"], auth_string=AUTH)


async def _read_back(server) -> dict:
    """What the server holds, read through Prefect's client (not through setup.py's snapshot)."""
    async with _client(server) as c:
        pool = await c.read_work_pool("eyrie-gpu")
        queue = await c.read_work_queue_by_name("gpu-node-1", work_pool_name="eyrie-gpu")
        gcl = await c.read_global_concurrency_limit_by_name("eyrie-gpu")
        automations = [a for a in await c.read_automations() if a.name == "Crash zombie flows"]
        deployments = {n: await c.read_deployment_by_name(n) for n in (PIPELINE, EXTRACT)}
        counts = {"work_pools": len(await c.read_work_pools()),
                  "work_queues": len(await c.read_work_queues(work_pool_name="eyrie-gpu")),
                  "global_concurrency_limits": len(await c.read_global_concurrency_limits(limit=200)),
                  "automations": len(await c.read_automations()),
                  "deployments": len(await c.read_deployments()), "flows": len(await c.read_flows())}
    return {"pool": pool, "queue": queue, "gcl": gcl, "automations": automations, "deployments": deployments,
            "counts": counts}


def _ids(state: dict) -> dict:
    return {"pool": state["pool"].id, "queue": state["queue"].id, "gcl": state["gcl"].id,
            "automations": sorted(a.id for a in state["automations"]),
            "deployments": {n: d.id for n, d in state["deployments"].items()},
            "deployment_limits": {n: d.global_concurrency_limit.id for n, d in state["deployments"].items()},
            "schedules": {n: sorted(s.id for s in d.schedules) for n, d in state["deployments"].items()}}


@pytest.mark.slow
def test_setup_creates_everything_once_and_is_idempotent(prefect_server):
    from prefect.client.schemas.objects import StateType
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.exceptions import PrefectHTTPStatusError

    from eyrie.config import load_config, parse_config

    t0 = time.monotonic()
    # Authentication is on: without credentials the API refuses, with them it answers.
    assert _get(f"{prefect_server['url']}/work_pools/") == 401
    assert _get(f"{prefect_server['url']}/admin/version", AUTH) == 200
    wrong = _setup_process(prefect_server, auth="eyrie-admin:wrong")
    assert wrong.returncode == 1 and "answered 401" in wrong.stderr, wrong.stderr

    first, first_log = _run_setup(prefect_server)
    t_first = time.monotonic() - t0
    state1 = asyncio.run(_read_back(prefect_server))

    # Work pool: type process, concurrency limit 1; its queue.
    assert state1["pool"].type == "process"
    assert state1["pool"].concurrency_limit == 1
    assert state1["queue"].work_pool_id == state1["pool"].id
    # Global concurrency limit for `concurrency("eyrie-gpu", strict=True)`.
    assert state1["gcl"].limit == 1 and state1["gcl"].active
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
    for name, d in state1["deployments"].items():
        assert d.work_pool_name == "eyrie-gpu" and d.work_queue_name == "gpu-node-1", name
        assert d.global_concurrency_limit is not None and d.global_concurrency_limit.limit == 1, name
        assert d.concurrency_options.collision_strategy.value == "ENQUEUE", name
        assert d.enforce_parameter_schema is True, name
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                 {"directory": "{{ $EYRIE_HOME }}"}}], name
        # The heartbeat frequency the automation's window is sized for.
        assert d.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "60", name
    pipeline = state1["deployments"][PIPELINE]
    assert pipeline.entrypoint == "flows/pipeline.py:pipeline_flow"
    assert state1["deployments"][EXTRACT].entrypoint == "flows/extract.py:extract_flow"
    # `config` is the PipelineConfig model (the UI renders it as a form).
    schema = pipeline.parameter_openapi_schema
    assert schema["properties"]["config"]["$ref"] == "#/definitions/PipelineConfig"
    assert set(schema["required"]) == {"config", "run_dir"}
    assert schema["properties"]["until"]["enum"] == ["prepare", "extract", "train", "evaluate"]

    # The weekly schedule: Sunday 03:00 UTC, inactive, carrying the production preset unchanged.
    assert len(pipeline.schedules) == 1
    weekly = pipeline.schedules[0]
    assert weekly.slug == "weekly-retrain" and weekly.active is False
    assert weekly.schedule.cron == "0 3 * * 0" and weekly.schedule.timezone == "UTC"
    assert parse_config(weekly.parameters["config"]) == load_config(REPO / "configs" / "kimi-k2.5-tp8.yaml")
    assert state1["deployments"][EXTRACT].schedules == []

    # setup.py's own before/after report agrees: the first run created all of it.
    assert first["before"]["work_pool"] is None and first["after"]["work_pool"] is not None
    assert first["changes"]
    assert sum(line.startswith("created ") for line in first_log) == 4  # pool, queue, limit, automation

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

    # --- drift is put back, keeping the ids: someone edited the pool and the limit, paused the automation and
    # created a second copy of it
    async def drift():
        from deployments.setup import zombie_automation

        from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate, WorkPoolUpdate

        async with _client(prefect_server) as c:
            await c.update_work_pool("eyrie-gpu", WorkPoolUpdate(concurrency_limit=4))
            await c.update_global_concurrency_limit("eyrie-gpu", GlobalConcurrencyLimitUpdate(limit=3))
            await c.pause_automation(zombie.id)
            return await c.create_automation(zombie_automation())

    duplicate = asyncio.run(drift())
    third, third_log = _run_setup(prefect_server, "--no-deploy")
    state3 = asyncio.run(_read_back(prefect_server))
    assert state3["pool"].concurrency_limit == 1 and state3["gcl"].limit == 1
    assert [a.id for a in state3["automations"]] == [zombie.id] and state3["automations"][0].enabled
    assert _ids(state3) == _ids(state1) and state3["counts"] == state1["counts"]
    assert sorted(third_log) == sorted([
        "updated work pool 'eyrie-gpu': ['concurrency_limit']",
        "updated global concurrency limit 'eyrie-gpu' to limit 1, active",
        f"deleted duplicate automation 'Crash zombie flows' {duplicate}",
        f"updated automation 'Crash zombie flows' ({zombie.id})"])

    print(f"\nfirst setup run {t_first:.1f}s; whole test body {time.monotonic() - t0:.1f}s")


def test_prefect_yaml_is_valid_for_prefect_deploy():
    """The file validates as Prefect 3.7's prefect.yaml, and setup.py's own checks pass (no server needed)."""
    from deployments.setup import deployment_full_names, load_prefect_file

    deployments = load_prefect_file()
    assert deployment_full_names(deployments) == [PIPELINE, EXTRACT]
    raw = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    assert raw["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $EYRIE_HOME }}"}}]
    for d in deployments:
        assert d["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
        assert d["enforce_parameter_schema"] is True
    # The weekly schedule inlines the production preset: the two must not drift apart.
    from eyrie.config import load_config, parse_config

    (weekly,) = deployments[0]["schedules"]
    assert parse_config(weekly["parameters"]["config"]) == load_config(REPO / "configs" / "kimi-k2.5-tp8.yaml")
