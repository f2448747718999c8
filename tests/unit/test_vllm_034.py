"""Eyrie's vLLM plugin and preflight's runner rule on vLLM 0.34, which removed Model Runner V1, without a GPU and
without importing 0.34 (the tests run the installed CPU vLLM 0.32).

The 0.34 wheel is read, never installed: `.cache/wheels/vllm-0.34.0-*.whl` (`pip download --no-deps
--only-binary=:all: vllm==0.34.0 -d .cache/wheels`); the tests that need it skip without it. Each run builds a `vllm`
package with 0.34's file layout (every module of the wheel, as an empty file: so what 0.34 lacks, V1's runner and
proposer, is absent), in which the modules the plugin touches are replaced: V2's EAGLE-3 setup
(`eagle3_utils.py`) and the kernel dispatcher are 0.34's own source; the rest (the connector factory, the interface
check, the config classes, the platform, the V2 runner's import of the hook) are fakes of the few names Eyrie reads,
pure logic. Eyrie's code runs against it in a subprocess, with that tree ahead of the installed vLLM.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eyrie.stages.preflight.installed_vllm import RUNNER_ENV, runner_without_rule

REPO = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("EYRIE_VLLM_WHEELS", REPO / ".cache" / "wheels"))
WHEEL = next(iter(sorted(WHEELS.glob("vllm-0.34.0-*.whl"))), None)
needs_wheel = pytest.mark.skipif(WHEEL is None, reason=f"no vLLM 0.34.0 wheel in {WHEELS}")

# Fakes of what Eyrie reads, beside 0.34's own eagle3_utils.py and dispatcher.py.
FAKES = {
    "vllm/__init__.py": "__version__ = '0.34.0'\n",
    "vllm/logger.py": "import logging\n\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/envs.py": "VLLM_CPU_OMP_THREADS_BIND = 'nobind'\n",
    "vllm/config/__init__.py": (
        "class SpeculativeConfig:\n"
        "    def __init__(self, draft_model_config=None, method='extract_hidden_states'):\n"
        "        self.draft_model_config, self.method = draft_model_config, method\n\n\n"
        "class VllmConfig:  # 0.34's has neither use_v2_model_runner nor the V2-unsupported features\n"
        "    def _get_v2_model_runner_unsupported_features(self):\n"
        "        raise AssertionError('asked for the reasons a server stays on V1')\n"
    ),
    "vllm/distributed/kv_transfer/kv_connector/factory.py": (
        "class KVConnectorFactory:\n"
        "    _registry = {}\n\n"
        "    @classmethod\n"
        "    def register_connector(cls, name, module, class_name):\n"
        "        cls._registry[name] = (module, class_name)\n"
    ),
    "vllm/distributed/parallel_state.py": (
        "def model_parallel_is_initialized():\n    return False\n\n\n"
        "def get_pp_group():\n    raise AssertionError('no pipeline parallelism here')\n"
    ),
    "vllm/model_executor/models/interfaces.py": (
        "from typing import Protocol\n\n\n"
        "class SupportsEagle3(Protocol):\n    supports_eagle3 = True\n\n\n"
        "def supports_eagle3(model):\n    return getattr(model, 'supports_eagle3', False) is True\n"
    ),
    "vllm/platforms/__init__.py": (
        "class _Gpu:\n    def is_cpu(self):\n        return False\n\n\ncurrent_platform = _Gpu()\n"
    ),
    "vllm/platforms/cpu.py": (
        "class CpuPlatform:\n    @classmethod\n    def check_and_update_config(cls, vllm_config):\n        pass\n"
    ),
    # 0.34's V2 runner imports the hook by name at its import (vllm/v1/worker/gpu/model_runner.py:174) and calls it
    # with (self.model, self.speculative_config, self.use_pp) after the load (:427); the call is all this fake keeps.
    "vllm/v1/worker/gpu/model_runner.py": (
        "from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers\n\n\n"
        "def load_model(model, speculative_config, use_pp=False):\n"
        "    set_eagle3_aux_hidden_state_layers(model, speculative_config, use_pp)\n"
        "    return model\n"
    ),
}
REAL = ("vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", "vllm/triton_utils/dispatcher.py")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-0.34")
    with zipfile.ZipFile(WHEEL) as z:  # type: ignore[arg-type]
        names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        for name in names:
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(z.read(name).decode() if name in REAL else "")
    for name, text in FAKES.items():
        assert name in names, f"0.34 has no {name}: the fake would add a module it lacks"
        (root / name).write_text(text)
    return root


def run_on(tree: Path, code: str, **env: str) -> dict:
    """`code` (which prints one JSON line last) in a fresh interpreter that imports vLLM from `tree`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("EYRIE_", "VLLM_"))}
    environ.update(env, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=environ)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_wheel
def test_the_tree_is_0_34s_layout(tree):
    assert not (tree / "vllm/v1/worker/gpu_model_runner.py").exists()
    assert not (tree / "vllm/v1/spec_decode/llm_base_proposer.py").exists()
    assert (tree / "vllm/v1/worker/gpu/model_runner.py").exists()
    got = run_on(tree, "import json, vllm; print(json.dumps(vllm.__file__))")
    assert got.startswith(str(tree))


REGISTER = """
import json, sys
import vllm.v1.worker.gpu.model_runner as runner  # imported before the plugin: its own name for the hook is rebound
import eyrie.vllm.plugin as plugin
from eyrie.vllm.plugin import compat
plugin.register()
plugin.register()  # idempotent
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
import vllm.triton_utils.dispatcher as dispatcher
print(json.dumps({
    "connector": KVConnectorFactory._registry.get(plugin.CONNECTOR_NAME),
    "wrapped": compat.install(),
    "missing_hooks": compat.missing_hooks(),
    "v1_loaded": "vllm.v1.worker.gpu_model_runner" in sys.modules,
    "runner_hook_wrapped": getattr(runner.set_eagle3_aux_hidden_state_layers, "_eyrie_eagle3_compat", False),
    "dispatcher_untouched": not hasattr(dispatcher, "_rebind_kernels") and hasattr(dispatcher, "_rebind_impls"),
}))
"""


@needs_wheel
def test_the_plugin_registers_on_0_34_with_only_v2s_hook(tree):
    """register() with every switch on (the hidden interface, the CPU engine fork, the compatibility layer): V1's
    modules are absent, so V1's hook and V1's name for the interface check are skipped, not imported."""
    got = run_on(tree, REGISTER, EYRIE_TEST_HIDE_EAGLE3="TinyDecoder", EYRIE_CPU_ENGINE_FORK="1")
    assert got["connector"] == ["eyrie.vllm.plugin.connector", "EyrieHiddenStatesConnector"]
    assert got["wrapped"] == ["V2"]
    assert list(got["missing_hooks"]) == ["V1"] and "gpu_model_runner" in got["missing_hooks"]["V1"]
    assert got["v1_loaded"] is False
    assert got["runner_hook_wrapped"] is True
    assert got["dispatcher_untouched"] is True  # 0.34's _rebind_impls is left as vLLM wrote it


GRAFT = """
import json, torch
from torch import nn
import eyrie.vllm.plugin as plugin
plugin.register()
from vllm.config import SpeculativeConfig
from vllm.v1.worker.gpu.model_runner import load_model  # imported after the plugin: takes the wrapped hook


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Inner()

    def forward(self, x):
        return self.model(x)


torch.manual_seed(0)
model = TinyDecoder()
x = torch.randn(3, 4)
plain = model(x)
load_model(model, SpeculativeConfig(), False)  # 0.34's set_eagle3_aux_hidden_state_layers, through the V2 runner
out, aux = model(x)
expected = []
h = x
for i, layer in enumerate(model.model.layers):
    if i in (2, 3):
        expected.append(h)
    h = layer(h)
print(json.dumps({
    "class": type(model).__name__,
    "ids": list(model._eyrie_capture.ids),
    "same_output": bool(torch.allclose(out, plain)),
    "aux": [list(a.shape) for a in aux],
    "aux_right": all(bool(torch.allclose(a, e)) for a, e in zip(aux, expected)),
}))
"""


@needs_wheel
def test_v2s_eagle3_setup_grafts_a_class_lacking_the_interface_through_0_34s_own_function(tree):
    """0.34's `set_eagle3_aux_hidden_state_layers(model, spec_config, use_pp)` (its source, unchanged) raises for a
    model without the interface; through the plugin's wrapper it grafts it, takes the default aux ids (2, L//2, L-3)
    from the graft, and the model then returns the residual stream entering those layers."""
    got = run_on(tree, GRAFT)
    assert got["class"] == "TinyDecoderWithEagle3"
    assert got["ids"] == [2, 3]  # (2, 6 // 2, 6 - 3), deduplicated
    assert got["same_output"] is True
    assert got["aux"] == [[3, 4], [3, 4]] and got["aux_right"] is True


UNWRAPPED = """
import json, os
os.environ["EYRIE_EAGLE3_COMPAT"] = "0"
import eyrie.vllm.plugin as plugin
plugin.register()
from torch import nn
from vllm.config import SpeculativeConfig
from vllm.v1.worker.gpu.model_runner import load_model
try:
    load_model(nn.Linear(2, 2), SpeculativeConfig(), False)
    print(json.dumps("no error"))
except RuntimeError as err:
    print(json.dumps(str(err)))
"""


@needs_wheel
def test_without_the_compatibility_layer_0_34_refuses_as_it_does(tree):
    assert run_on(tree, UNWRAPPED) == "Model does not support EAGLE3 interface"


RULE = """
import argparse, json
from eyrie.stages.preflight.installed_vllm import has_v1_runner, runner_switch_refusal, server_model_runner
env = json.loads({env!r})
runner, why = server_model_runner(argparse.Namespace(), {{"architectures": ["X"]}}, env)
print(json.dumps([has_v1_runner(), runner, why, runner_switch_refusal(has_v1_runner(), env)]))
"""


@needs_wheel
@pytest.mark.parametrize("env", [{}, {RUNNER_ENV: "1"}, {RUNNER_ENV: "0"}])
def test_preflights_runner_rule_says_v2_on_0_34_because_it_has_no_v1(tree, env):
    """0.34 refuses to start with the runner switch set to anything but 1 (`Platform.validate_environ`): preflight
    says so, and refuses the server (check_model_runners turns the refusal into a failure)."""
    has_v1, runner, why, refusal = run_on(tree, RULE.format(env=json.dumps(env)))
    assert has_v1 is False
    assert runner == "V2"
    assert why.startswith("vLLM 0.34.0 has no V1 runner")
    assert "V1" not in why.replace("no V1 runner", "")
    assert (f"{RUNNER_ENV}=" in why) == bool(env)
    if env.get(RUNNER_ENV) == "0":
        assert "refuse to start" in why and "Unset VLLM_USE_V2_MODEL_RUNNER" in refusal
    else:
        assert refusal is None


def test_a_vllm_without_the_rule_but_with_v1_stays_on_v1():
    runner, why = runner_without_rule("0.20.0", True, {})
    assert runner == "V1" and "no Model Runner V2 rule" in why


@needs_wheel
def test_0_34s_runners_call_v2s_hook_as_the_fakes_do():
    """What the fakes stand for, read in 0.34's source: V2's GPU runner imports the hook by name and calls it with the
    model first; the CPU runner is a subclass of V2's; the hook's parameters are (model, spec_config, use_pp)."""
    with zipfile.ZipFile(WHEEL) as z:  # type: ignore[arg-type]
        runner = ast.parse(z.read("vllm/v1/worker/gpu/model_runner.py"))
        cpu = ast.parse(z.read("vllm/v1/worker/cpu/model_runner.py"))
        utils = ast.parse(z.read("vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"))
    imported = {
        (n.module, a.name) for n in ast.walk(runner) if isinstance(n, ast.ImportFrom) for a in n.names if n.module
    }
    assert ("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils", "set_eagle3_aux_hidden_state_layers") in imported
    calls = [
        n
        for n in ast.walk(runner)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "set_eagle3_aux_hidden_state_layers"
    ]
    assert [ast.unparse(c.args[0]) for c in calls] == ["self.model"]
    assert [ast.unparse(b) for n in ast.walk(cpu) if isinstance(n, ast.ClassDef) for b in n.bases] == ["GPUModelRunner"]
    (hook,) = [
        n for n in utils.body if isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_aux_hidden_state_layers"
    ]
    assert [a.arg for a in hook.args.args] == ["model", "spec_config", "use_pp"]


def test_the_fork_leaves_a_vllm_without_the_kernel_scan_module_alone(tmp_path):
    """0.26 has no `vllm.triton_utils.dispatcher` (a fake package without it: pure logic); 0.34's dispatcher without
    `_rebind_kernels` is covered by the registration above."""
    (tmp_path / "vllm/triton_utils").mkdir(parents=True)
    (tmp_path / "vllm/__init__.py").write_text("")
    (tmp_path / "vllm/triton_utils/__init__.py").write_text("")
    code = "import json; from eyrie.vllm.plugin import fork; print(json.dumps(fork.scan_only_plain_namespaces()))"
    assert run_on(tmp_path, code) is None
