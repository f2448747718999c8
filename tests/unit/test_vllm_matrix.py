"""The vLLM version matrix's fact collection and lookup (benchmarks/vllm_matrix.py), on a tiny synthetic package and
a tiny synthetic vLLM written here: no wheel, no vLLM import."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

APP = '''
"""A package that leans on vLLM."""
import vllm
from vllm.a import Present, Moved, Missing
from vllm.conn import Base

try:
    from vllm.util.new import Parser
except ImportError:
    from vllm.util import Parser

HOOK = ("vllm.runner", "Runner.setup")


def read():
    from vllm import envs

    return envs.VLLM_KNOWN, vllm.__version__, "VLLM_GONE", "--max-model-len"


class Mine(Base):
    def __init__(self):
        self._own = 1

    def step(self, x):
        return self._inherited + self._own + self._never_set
'''

VLLM = {
    "vllm/__init__.py": "from .version import __version__\n",
    "vllm/version.py": "__version__ = '9.9'\n",
    "vllm/envs.py": "environment_variables = {\n    'VLLM_KNOWN': lambda: 1,\n}\n\n\n"
    "def __getattr__(name):\n    pass\n",
    "vllm/a.py": "class Present:\n    pass\n",
    "vllm/b.py": "class Moved:\n    pass\n",
    "vllm/conn.py": "class Root:\n    def step(self, x):\n        pass\n\n\nclass Base(Root):\n"
    "    def __init__(self):\n        self._inherited = 0\n",
    "vllm/util/__init__.py": "",
    "vllm/util/new.py": "class Parser:\n    pass\n",
    "vllm/runner.py": "class Runner:\n    def setup(self, model):\n        pass\n",
}


@pytest.fixture
def vm():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import vllm_matrix

        yield vllm_matrix
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_collects_what_the_code_relies_on(vm, tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text(APP)
    facts = vm.collect_facts(tmp_path, "app")
    keys = set(facts)
    for key in (
        "module:vllm:",
        "symbol:vllm.a:Present",
        "symbol:vllm.a:Moved",
        "symbol:vllm.a:Missing",
        "symbol:vllm:envs.VLLM_KNOWN",
        "symbol:vllm:__version__",
        "symbol:vllm.runner:Runner.setup",  # a (module, attribute) string pair
        "env:vllm.envs:VLLM_GONE",
        "symbol:vllm.conn:Base._inherited",  # read off self, set by vLLM's class
        "symbol:vllm.conn:Base._never_set",
        "symbol:vllm.conn:Base.step",  # overridden
    ):
        assert key in keys, key
    assert "symbol:vllm.conn:Base._own" not in keys  # the subclass sets it itself
    # the try/except ImportError pair is one fact, either import will do
    (group,) = [f for f in facts.values() if f.kind == "any" and "Parser" in f.name]
    assert group.alternatives == ["symbol:vllm.util.new:Parser", "symbol:vllm.util:Parser"]
    assert "symbol:vllm.util:Parser" not in keys
    assert facts["symbol:vllm.a:Present"].used_at == ["app/__init__.py:4"]


def test_present_missing_moved_changed(vm, tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text(APP)
    facts = {k: f for k, f in vm.collect_facts(tmp_path, "app").items() if "EXTRA_FACTS" not in f.used_at[0]}
    facts = {k: f for k, f in facts.items() if f.name not in vm.ANY_OF}
    ref = vm.Source(VLLM, "1.0", "synthetic")
    newer = dict(VLLM, **{"vllm/runner.py": "class Runner:\n    def setup(self, model, extra):\n        pass\n"})
    table = vm.matrix(facts, [ref, vm.Source(newer, "2.0", "synthetic")])

    def status(key, version="1.0"):
        return table[key][version].status, table[key][version].where

    assert status("symbol:vllm.a:Present") == ("present", "vllm/a.py:1")
    assert status("symbol:vllm.a:Missing")[0] == "missing"
    assert status("symbol:vllm.a:Moved") == ("moved", "vllm/b.py:1")
    assert status("symbol:vllm:__version__") == ("present", "vllm/version.py:1")  # a re-export followed
    assert status("symbol:vllm:envs.VLLM_KNOWN")[0] == "present"  # named by the module's __getattr__ registry
    assert status("env:vllm.envs:VLLM_GONE")[0] == "missing"
    assert status("symbol:vllm.conn:Base._inherited") == ("present", "vllm/conn.py:8")
    assert status("symbol:vllm.conn:Base.step") == ("present", "vllm/conn.py:2")  # found on the base's base
    assert status("symbol:vllm.conn:Base._never_set")[0] == "missing"
    assert status("symbol:vllm.runner:Runner.setup") == ("present", "vllm/runner.py:2")
    # the newer version's method takes another parameter: changed, against the first (reference) version
    assert status("symbol:vllm.runner:Runner.setup", "2.0") == ("changed", "vllm/runner.py:2")
    assert "(self, model, extra)" in table["symbol:vllm.runner:Runner.setup"]["2.0"].note
    (group,) = [k for k in table if k.startswith("any:")]
    assert table[group]["1.0"].status == "present" and "vllm.util.new" in table[group]["1.0"].note


def test_flags_from_a_literal_or_an_argument_field(vm):
    src = vm.Source(
        {
            "vllm/engine/arg_utils.py": "class EngineArgs:\n    max_model_len: int = 0\n",
            "vllm/entrypoints/cli.py": 'parser.add_argument("--host")\n',
        },
        "1.0",
        "synthetic",
    )
    find = vm.Resolver(src).find
    assert find(vm.Fact("", "flag", "vllm serve", "--max-model-len")).where == "vllm/engine/arg_utils.py:2"
    assert find(vm.Fact("", "flag", "vllm serve", "--host")).where == "vllm/entrypoints/cli.py:1"
    assert find(vm.Fact("", "flag", "vllm serve", "--gone")).status == "missing"


def test_a_wrapped_function_changed_after_what_eyrie_reads_is_passed_on(vm, tmp_path, monkeypatch):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text(APP)
    facts = {k: f for k, f in vm.collect_facts(tmp_path, "app").items() if "EXTRA_FACTS" not in f.used_at[0]}
    facts = {k: f for k, f in facts.items() if f.name not in vm.ANY_OF}
    key = "symbol:vllm.runner:Runner.setup"
    newer = dict(VLLM, **{"vllm/runner.py": "class Runner:\n    def setup(self, model, extra):\n        pass\n"})
    renamed = dict(VLLM, **{"vllm/runner.py": "class Runner:\n    def setup(self, other):\n        pass\n"})
    monkeypatch.setitem(vm.PASSED_ON, key, 2)  # (self, model) read, the rest passed on
    sources = [vm.Source(VLLM, "1.0", "s"), vm.Source(newer, "2.0", "s"), vm.Source(renamed, "3.0", "s")]
    table = vm.matrix(facts, sources)
    assert [table[key][v].status for v in ("1.0", "2.0", "3.0")] == ["present", "passed on", "changed"]


def test_a_missing_fact_eyrie_has_a_path_without_counts_as_handled(vm):
    assert vm.handled("module:vllm.v1.worker.gpu_model_runner:")[1] == "tests/unit/test_vllm_034.py"
    assert vm.handled("symbol:vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_model")  # its module's path
    assert vm.handled("symbol:vllm.a:Missing") is None
    assert vm._count("missing", "env:vllm.envs:VLLM_USE_V2_MODEL_RUNNER") == "handled"
    assert vm._count("missing", "symbol:vllm.a:Missing") == "missing"
    for test in {t for _, t in vm.HANDLED.values() if t}:  # each path names a test that exists
        assert (REPO / test).is_file(), test
