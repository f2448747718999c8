"""Two environments, as a node with its own vLLM has them: the flow's, where vLLM is not importable, and the one
$EYRIE_VLLM_PYTHON names, which has vLLM and Eyrie's plugin but no Prefect. Emulated without a second vLLM install:
that interpreter is a wrapper script at another path running this venv's Python with Prefect blocked, and the flow is
a process whose `import vllm` fails. Preflight passes there with the facts of that vLLM, export reads the drafter
flags there, the keys and the servers' command take that interpreter, and vLLM never enters the flow's process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_environments import BLOCK, wrapper

from eyrie.run.vllm_env_facts import facts
from eyrie.run.vllm_python import VLLM_PYTHON_ENV
from eyrie.stages.export import NORM_FLAGS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two probe processes import vLLM

FLOW = """
import json, sys
{block}
sys.path.insert(0, "tests")
from pathlib import Path
from conftest import build_tiny_target, config_dict
from eyrie.config import parse_config
from eyrie.run.identity import installed_version
from eyrie.stages.export import flags_vllm_reads
from eyrie.stages.preflight.check import run_preflight
from eyrie.vllm.spec import ServerSpec, vllm_cpu_build

config = parse_config(config_dict(build_tiny_target(sys.argv[2])))
report = run_preflight(config, Path(sys.argv[1]), raise_on_failure=False)
print(json.dumps({{
    "report": report.as_dict(),
    "flags": sorted(flags_vllm_reads()),
    "installed": installed_version("vllm"),
    "cpu_build": vllm_cpu_build(),
    "command": ServerSpec.for_serving(config, "drafter").command(1)[0],
    "vllm_imported": sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")),
}}))
"""


def test_preflight_and_export_through_the_probe(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setenv("EYRIE_DIGEST_STORE", str(tmp_path / "store"))
    script = wrapper(tmp_path / "vllm-env", blocked=("prefect",))
    env = {**os.environ, VLLM_PYTHON_ENV: str(script)}
    code = FLOW.format(block=BLOCK.format(blocked={"vllm"}))
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run"), tiny_llama.name],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["vllm_imported"] == []
    assert got["command"] == str(script)
    here = facts(full=False)
    assert got["installed"] == here["vllm"] and got["cpu_build"] == here["cpu_build"]
    assert set(NORM_FLAGS) <= set(got["flags"])  # vLLM 0.32's EAGLE-3 adapter reads every norm flag
    report = got["report"]
    assert report["failures"] == [], report["failures"]
    assert report["vllm_python"] == str(script)  # named in the report beside the version
    assert (report["architecture"], report["eagle3_path"]) == ("LlamaForCausalLM", "native")
    assert report["vllm_class"] == "vllm.model_executor.models.llama.LlamaForCausalLM"
    assert report["captured_layer_ids"] == [2, 4, 5, 8] and report["vllm_version"] == here["vllm"]
    runners = report["target_facts"]["model_runners"]
    assert set(runners) == {"extraction", "export/evaluation"} and runners["extraction"]["runner"] == "V1"
    assert report["target_facts"]["verifier_weights"]  # what the drafter borrows, decided there
