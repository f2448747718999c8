"""Which of the vLLM facts Eyrie relies on each vLLM version has, read from the version's source without importing it.

    .venv/bin/python benchmarks/vllm_matrix.py --installed --wheel vllm-0.26.0-....whl --wheel vllm-0.34.0-....whl \
        --out benchmarks/results/vllm-matrix-2026-12-04

Every fact is collected from Eyrie's own code (`eyrie/`, walked as Python AST), so a new vLLM import or a new read of
a vLLM attribute is checked without editing this script:

- each `from vllm.x import A` / `import vllm.x` (a `try`/`except ImportError` pair of them is one fact: either will do);
- each attribute read off a name bound by such an import (`envs.VLLM_CPU_OMP_THREADS_BIND`,
  `registry._run_in_subprocess`, `getattr(module, "HAS_TRITON", ...)`), and off a parameter annotated with a vLLM
  class;
- for an Eyrie class that subclasses a vLLM class: each `self.x` it reads but never sets, and each method it overrides
  (vLLM must still have them, or the subclass reads nothing / is never called);
- each string naming a vLLM module (`importlib.import_module`, `-m vllm.entrypoints...`) and each (module, attribute)
  string pair (`compat.HOOKS`, `_lookup(...)`);
- each `VLLM_*` variable name Eyrie sets or reads (present: vLLM's `vllm/envs.py` registry has it);
- each `--flag` Eyrie passes to `vllm serve` (`eyrie/vllm/spec.py`; present: vLLM declares the flag, or the engine or
  frontend argument field it is generated from).

What cannot be named that way (an attribute of an object whose type the code does not say) is listed in `EXTRA_FACTS`.

Each fact is looked up in each version's `.py` files (a wheel is read as a zip; the installed vLLM as its folder, found
without importing it): present (file:line of its definition, re-exports followed), missing, moved (not where Eyrie
looks, but defined elsewhere in that version: file:line) or changed (present, but a function's parameters differ from
the reference version's, the first column: the one the test suite runs). A fact Eyrie's code has a path without
(`HANDLED`: 0.34's missing V1 runner, the runner switch it no longer reads, ...) counts as handled, named with that
path and the test that runs it; a wrapped function whose parameters change only after those Eyrie reads
(`PASSED_ON`) as passed on. Each version's paths through Eyrie's plugin and preflight (the hooks compat installs,
the runner rule's answer) are decided from the same facts, by preflight's own function where it has one. For the
installed vLLM the script also imports every module and symbol fact for real (a check of the static reading), imports
Eyrie's vLLM plugin and runs its `register()`, and runs the probe (`python -m eyrie.ops.vllm_probe`) as the flow
does: `drafter_flags`, and `check_target` on a native and a compatibility-layer tiny target built for it.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MODULE_RE = re.compile(r"^vllm(\.[A-Za-z_]\w*)*$")
IDENT_PATH_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
ENV_RE = re.compile(r"^VLLM_[A-Z0-9_]+$")
FLAG_RE = re.compile(r"^--[a-z][a-z0-9-]+$")
# Strings shaped like a vLLM module name that are not one.
NOT_MODULES = {
    "vllm.general_plugins": "the plugin entry-point group (checked as text below)",
    "vllm.eyrie.compat": "a logger name under vLLM's logger",
}
# Bases whose members say nothing (a vLLM class's other bases are searched; a base from another library is named).
TRIVIAL_BASES = {"ABC", "Generic", "Protocol", "object", "Enum", "NamedTuple", "TypedDict", "Any"}
# Where Eyrie's `vllm serve` flags are built.
FLAG_FILES = ("eyrie/vllm/spec.py",)
# The classes whose fields become `vllm serve` flags (`--max-model-len` from `max_model_len`).
ARG_CLASSES = ("EngineArgs", "AsyncEngineArgs", "FrontendArgs", "BaseFrontendArgs")
# Facts that mean the same and are tried in order (Eyrie uses the first the installed vLLM has).
ANY_OF = {
    "vllm serve's parser factory (SERVE_PARSER_MODULES)": (
        "eyrie/stages/preflight/installed_vllm.py:24",
        "preflight parses every server's arguments with it, and runs the runner rule on them",
        [
            "symbol:vllm.entrypoints.launchers.cli_args:make_arg_parser",
            "symbol:vllm.entrypoints.openai.cli_args:make_arg_parser",
            "symbol:vllm.entrypoints.common.cli_args:make_arg_parser",
        ],
    ),
}
# Facts the AST walk cannot name: (kind, module, name, why Eyrie needs it). Kinds: symbol (a dotted name defined in,
# or re-exported by, the module), text (the string appears in the module's source).
EXTRA_FACTS = [
    ("symbol", "vllm.config", "VllmConfig.use_v2_model_runner", "Model Runner V2 selection rule, run by preflight"),
    (
        "symbol",
        "vllm.config",
        "VllmConfig._get_v2_model_runner_unsupported_features",
        "preflight's reason a server stays on V1",
    ),
    (
        "symbol",
        "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
        "set_eagle3_aux_hidden_state_layers",
        "V2's EAGLE-3 hook (compat.HOOKS)",
    ),
    ("symbol", "vllm.model_executor.models.interfaces", "SupportsEagle3", "the EAGLE-3 interface"),
    ("symbol", "vllm.model_executor.models.interfaces", "supports_eagle3", "the interface check compat wraps"),
    (
        "symbol",
        "vllm.model_executor.models.interfaces",
        "SupportsEagle3.set_aux_hidden_state_layers",
        "the method the compat layer gives a class",
    ),
    (
        "symbol",
        "vllm.model_executor.models.interfaces",
        "SupportsEagle3.get_eagle3_default_aux_hidden_state_layers",
        "the default aux ids the compat layer gives a class",
    ),
    (
        "symbol",
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.use_aux_hidden_state_outputs",
        "V1 hook: whether aux outputs are asked for",
    ),
    ("symbol", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model", "V1 hook: the built model"),
    (
        "symbol",
        "vllm.v1.spec_decode.llm_base_proposer",
        "SpecDecodeBaseProposer._maybe_share_embeddings",
        "V1: compat exposes a grafted target's embeddings before the drafter shares them",
    ),
    (
        "symbol",
        "vllm.v1.worker.gpu_model_runner",
        "supports_eagle3",
        "the test switch that hides the interface rebinds it here",
    ),
    (
        "symbol",
        "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
        "supports_eagle3",
        "the test switch that hides the interface rebinds it here",
    ),
    (
        "symbol",
        "vllm.platforms.cpu",
        "CpuPlatform.check_and_update_config",
        "EYRIE_CPU_ENGINE_FORK wraps it to fork the engine core",
    ),
    ("symbol", "vllm.platforms.interface", "Platform.is_cpu", "current_platform.is_cpu(), CPU-only paths"),
    (
        "symbol",
        "vllm.v1.core.sched.output",
        "NewRequestData.sampling_params",
        "connector: a new request's sampling params",
    ),
    ("symbol", "vllm.v1.core.sched.output", "NewRequestData.req_id", "connector: a new request's id"),
    ("symbol", "vllm.sampling_params", "SamplingParams.extra_args", "connector: kv_transfer_params ride here"),
    (
        "symbol",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
        "ExampleHiddenStatesConnectorMetadata.new_req_filenames",
        "connector: the file each new request writes",
    ),
    (
        "symbol",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
        "ExampleHiddenStatesConnectorMetadata.pending_saves",
        "connector: saves submitted this step",
    ),
    ("symbol", "vllm.model_executor.models.registry", "_ModelInfo.is_hybrid", "preflight: runner rule facts"),
    ("symbol", "vllm.model_executor.models.registry", "_ModelInfo.is_attention_free", "preflight: refusals"),
    ("symbol", "vllm.model_executor.models.registry", "_ModelInfo.is_pooling_model", "preflight: refusals"),
    ("symbol", "vllm.model_executor.models.registry", "_ModelInfo.is_text_generation_model", "preflight: refusals"),
    (
        "symbol",
        "vllm.model_executor.models.registry",
        "_ModelInfo.supports_transcription_only",
        "preflight: refusals",
    ),
    ("symbol", "vllm.model_executor.models.registry", "_LazyRegisteredModel.load_model_cls", "preflight"),
    (
        "symbol",
        "vllm.v1.worker.gpu.model_runner",
        "set_eagle3_aux_hidden_state_layers",
        "V2's runner imports V2's EAGLE-3 hook by name: compat rebinds that name too",
    ),
    (
        "text",
        "vllm.v1.worker.gpu.model_runner",
        "set_eagle3_aux_hidden_state_layers(",
        "V2's runner calls the hook compat wraps after the load",
    ),
    (
        "text",
        "vllm.v1.worker.cpu.model_runner",
        "class CPUModelRunner(GPUModelRunner)",
        "from 0.34 the CPU build's runner is V2's subclass, so V2's hook serves it",
    ),
    ("text", "vllm.plugins", "vllm.general_plugins", "the entry-point group Eyrie's plugin is registered under"),
    (
        "text",
        "vllm.config.speculative",
        "extract_hidden_states",
        "the speculative method extraction servers run",
    ),
    (
        "text",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
        "shared_storage_path",
        "the connector's storage folder (kv_connector_extra_config)",
    ),
    (
        "text",
        "vllm.transformers_utils.configs.speculators.algos",
        '"norm_before_residual"',
        "a speculators flag vLLM's EAGLE-3 adapter reads (export.flags_vllm_reads)",
    ),
]

# Facts Eyrie's code has a path for where a version lacks them (a module fact covers its symbols): what it does then,
# and the test that runs that path (tests/unit/test_vllm_034.py builds 0.34's layout; the others run the installed
# vLLM; none where there is no path to run). A missing fact not named here is one Eyrie needs.
V1_GONE = "0.34 has no Model Runner V1"
HANDLED = {
    "module:vllm.v1.worker.gpu_model_runner:": (
        f"{V1_GONE}: compat installs only V2's hook, the hidden-interface switch skips V1's module, preflight's "
        "runner rule says V2 (its only runner)",
        "tests/unit/test_vllm_034.py",
    ),
    "module:vllm.v1.worker:gpu_model_runner": (f"{V1_GONE}: as its module", "tests/unit/test_vllm_034.py"),
    "module:vllm.v1.spec_decode.llm_base_proposer:": (
        f"{V1_GONE}: V1's drafter embedding sharing is not wrapped (V2 reads the graft's `model.embed_tokens`)",
        "tests/unit/test_vllm_034.py",
    ),
    "symbol:vllm.config:VllmConfig.use_v2_model_runner": (
        "preflight's runner rule: V2 where V1's runner module is gone too, V1 where it is not (a vLLM before V2)",
        "tests/unit/test_vllm_034.py",
    ),
    "symbol:vllm.config:VllmConfig._get_v2_model_runner_unsupported_features": (
        "not asked: only a vLLM with the V2 rule has servers that stay on V1",
        "tests/unit/test_vllm_034.py",
    ),
    "symbol:vllm.config:vllm.HAS_TRITON": (
        "read with a default, only under the V2 rule (the reason a server stays on V1)",
        "tests/unit/test_model_runner_rule.py",
    ),
    "env:vllm.envs:VLLM_USE_V2_MODEL_RUNNER": (
        "a vLLM without V1 does not read it: preflight's runner rule says so when a server sets it",
        "tests/unit/test_vllm_034.py",
    ),
    "module:vllm.triton_utils.dispatcher:": (
        "the CPU engine fork leaves a vLLM without the kernel scan as it is",
        "tests/unit/test_vllm_034.py",
    ),
    "symbol:vllm.triton_utils.dispatcher:_rebind_kernels": (
        "the CPU engine fork leaves 0.34's scan (`_rebind_impls`, which guards the namespaces itself) as it is",
        "tests/unit/test_vllm_034.py",
    ),
    "env:vllm.envs:VLLM_ENGINE_ITERATION_TIMEOUT_S": (
        "Eyrie only keeps it out of the servers' keys (`SCHEDULING_ENV`, a variable that does not change outputs): "
        "a vLLM that does not read it loses nothing",
        "",
    ),
    "text:vllm.v1.worker.cpu.model_runner:class CPUModelRunner(GPUModelRunner)": (
        "before 0.34 the CPU build runs V1 (its runner in `vllm.v1.worker.cpu_model_runner`), whose hook compat wraps",
        "tests/unit/test_compat_contracts.py",
    ),
}
# Functions Eyrie wraps and calls with what vLLM passed: a change of parameters after the first n is passed on.
PASSED_ON = {
    "symbol:vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils:set_eagle3_aux_hidden_state_layers": 1,
    "symbol:vllm.v1.worker.gpu.model_runner:set_eagle3_aux_hidden_state_layers": 1,  # the same function, imported
}


def handled(key: str) -> tuple[str, str] | None:
    """What Eyrie does without the fact `key`, and the test that runs it; None where Eyrie needs it."""
    kind, module, _ = key.split(":", 2)
    return HANDLED.get(key) or (HANDLED.get(f"module:{module}:") if kind == "symbol" else None)


# ---------------------------------------------------------------------------------------------------------------
# The facts, from Eyrie's code


@dataclass
class Fact:
    key: str  # kind:module:name
    kind: str  # module, symbol, env, flag, text, any
    module: str
    name: str
    why: str = ""
    used_at: list[str] = field(default_factory=list)
    alternatives: list[str] = field(default_factory=list)  # kind "any": the keys tried in order


def _key(kind: str, module: str, name: str) -> str:
    return f"{kind}:{module}:{name}"


class _Collector(ast.NodeVisitor):
    """One Eyrie file's vLLM facts: imports, attribute reads off imported vLLM names, strings."""

    def __init__(self, rel: str, add):
        self.rel, self.add = rel, add
        self.scopes: list[dict[str, tuple[str, str | None]]] = [{}]  # local name -> (vLLM module, symbol or None)
        self.docstrings: set[int] = set()

    def bound(self, name: str):
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def at(self, node) -> str:
        return f"{self.rel}:{node.lineno}"

    # imports ----------------------------------------------------------------------------------------------------
    def _import_facts(self, node) -> list[tuple[str, str, str, str]]:
        """(key, local name, module, symbol) for each vLLM name `node` binds."""
        out = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vllm" or alias.name.startswith("vllm."):
                    local = alias.asname or alias.name.split(".")[0]
                    target = alias.name if alias.asname else "vllm"
                    out.append((_key("module", alias.name, ""), local, target, None))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "vllm" or node.module.startswith("vllm."):
                for alias in node.names:
                    out.append(
                        (_key("symbol", node.module, alias.name), alias.asname or alias.name, node.module, alias.name)
                    )
        return out

    def _bind_import(self, node) -> list[str]:
        keys = []
        for key, local, module, symbol in self._import_facts(node):
            kind, mod, name = key.split(":", 2)
            self.add(kind, mod, name, self.at(node))
            self.scopes[-1][local] = (module, symbol)
            keys.append(key)
        return keys

    def visit_Import(self, node):
        self._bind_import(node)

    def visit_ImportFrom(self, node):
        self._bind_import(node)

    def visit_Try(self, node):
        """`try: from a import X / except ImportError: from b import X`: one fact, either import will do."""
        catches = [
            h
            for h in node.handlers
            if h.type is not None
            and any(
                isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in ast.walk(h.type)
            )
        ]
        first = [s for s in node.body if isinstance(s, (ast.Import, ast.ImportFrom))]
        if catches and first:
            fallback = [
                k
                for h in catches
                for s in h.body
                if isinstance(s, (ast.Import, ast.ImportFrom))
                for k in self._bind_import(s)
            ]
            keys = [k for s in first for k in self._bind_import(s)] + fallback  # the first import's names win
            if len(keys) > 1:
                self.add("any", "", " or ".join(keys), self.at(node), alternatives=keys)
            for s in node.body:
                if not isinstance(s, (ast.Import, ast.ImportFrom)):
                    self.visit(s)
            for h in node.handlers:
                if h not in catches:
                    self.visit(h)
            for s in node.orelse + node.finalbody:
                self.visit(s)
            return
        self.generic_visit(node)

    # scopes -----------------------------------------------------------------------------------------------------
    def _function(self, node):
        scope: dict = {}
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            ann = arg.annotation
            name = ann.id if isinstance(ann, ast.Name) else ann.value if isinstance(ann, ast.Constant) else None
            bound = self.bound(name) if isinstance(name, str) else None
            if bound and bound[1]:
                scope[arg.arg] = bound  # a parameter annotated with a vLLM class: its reads are facts
        self._docstring(node)
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _docstring(self, node):
        body = getattr(node, "body", [])
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            self.docstrings.add(id(body[0].value))

    def visit_Module(self, node):
        self._docstring(node)
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        self._docstring(node)
        bases = [self.bound(b.id) for b in node.bases if isinstance(b, ast.Name)]
        bases = [b for b in bases if b and b[1]]
        if bases:
            self._subclass(node, bases)
        self.generic_visit(node)

    def _subclass(self, node: ast.ClassDef, bases):
        """An Eyrie subclass of a vLLM class: what it reads off `self` but never sets, and what it overrides."""
        own = {s.name for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
        own |= {t.id for s in node.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)}
        set_here = set()
        reads: dict[str, int] = {}
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                if isinstance(n.ctx, ast.Store):
                    set_here.add(n.attr)
                else:
                    reads.setdefault(n.attr, n.lineno)
        module, symbol = bases[0]
        for attr, line in sorted(reads.items()):
            if attr not in own and attr not in set_here:
                self.add(
                    "symbol", module, f"{symbol}.{attr}", f"{self.rel}:{line}", why=f"{node.name} reads self.{attr}"
                )
        for s in node.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and not s.name.startswith("__"):
                self.add("symbol", module, f"{symbol}.{s.name}", self.at(s), why=f"{node.name} overrides it")

    # reads ------------------------------------------------------------------------------------------------------
    def visit_Attribute(self, node):
        chain = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and (bound := self.bound(cur.id)) is not None:
            chain.reverse()
            module, symbol = bound
            # a submodule bound by `import vllm.a.b` is read as vllm.a.b...; stop at the first dunder
            names = [symbol] if symbol else []
            for part in chain:
                if part.startswith("__") and part != "__version__":
                    break
                names.append(part)
            if names and (symbol is None or len(names) > 1):
                self.add("symbol", module, ".".join(names), self.at(node))
            return  # the inner Attribute nodes are this chain
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and len(node.args) >= 2:
            obj, attr = node.args[0], node.args[1]
            if isinstance(obj, ast.Name) and isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                bound = self.bound(obj.id)
                if bound is not None:
                    module, symbol = bound
                    self.add("symbol", module, ".".join(filter(None, [symbol, attr.value])), self.at(node))
        self._string_pairs(node.args, node)
        self.generic_visit(node)

    def visit_Tuple(self, node):
        self._string_pairs(node.elts, node)
        self.generic_visit(node)

    def _string_pairs(self, items, node):
        """A pair ("vllm.module", "Attr.path") (a 2-tuple, or a call's two arguments): the attribute of that module."""
        if len(items) != 2:
            return
        a, b = (i.value if isinstance(i, ast.Constant) and isinstance(i.value, str) else None for i in items)
        if a and b and "." in a and MODULE_RE.match(a) and a not in NOT_MODULES and IDENT_PATH_RE.match(b):
            if not MODULE_RE.match(b):
                self.add("symbol", a, b, self.at(node))

    def visit_Constant(self, node):
        v = node.value
        if not isinstance(v, str) or id(node) in self.docstrings:
            return
        if MODULE_RE.match(v) and "." in v and v not in NOT_MODULES:
            self.add("module", v, "", self.at(node))
        elif ENV_RE.match(v):
            self.add("env", "vllm.envs", v, self.at(node))
        elif FLAG_RE.match(v) and self.rel in FLAG_FILES:
            self.add("flag", "vllm serve", v, self.at(node))


def collect_facts(root: Path, package: str = "eyrie") -> dict[str, Fact]:
    """Every vLLM fact the code under root/package relies on (see the module docstring), keyed `kind:module:name`."""
    facts: dict[str, Fact] = {}

    def add(kind, module, name, where, why="", alternatives=None):
        key = _key(kind, module, name)
        fact = facts.setdefault(key, Fact(key, kind, module, name, why, alternatives=list(alternatives or [])))
        if where not in fact.used_at:
            fact.used_at.append(where)
        if why and not fact.why:
            fact.why = why

    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        _Collector(rel, add).visit(ast.parse(path.read_text(), filename=rel))
    # A (module, "") fact repeated by a symbol fact of the same import adds nothing; symbol facts imply their module.
    for fact in list(facts.values()):  # a fact tried among others stands only in its group
        if fact.kind == "any":
            for k in fact.alternatives:
                facts.pop(k, None)
    for label, (where, why, keys) in ANY_OF.items():
        for k in keys:
            facts.pop(k, None)
            facts.pop(_key("module", k.split(":")[1], ""), None)
        add("any", "", label, where, why=why, alternatives=keys)
    for kind, module, name, why in EXTRA_FACTS:
        add(kind, module, name, "benchmarks/vllm_matrix.py (EXTRA_FACTS)", why=why)
    return facts


# ---------------------------------------------------------------------------------------------------------------
# A vLLM version's source


class Source:
    """A vLLM's .py files by path (`vllm/a/b.py`), parsed on demand: from a wheel (zip), a folder holding the `vllm`
    package, or a dict (tests)."""

    def __init__(self, files: dict[str, str], version: str, origin: str):
        self.files, self.version, self.origin = files, version, origin
        self._trees: dict[str, ast.Module | None] = {}

    @classmethod
    def from_wheel(cls, wheel: Path, package: str = "vllm") -> Source:
        with zipfile.ZipFile(wheel) as z:
            files = {n: z.read(n).decode("utf-8", "replace") for n in z.namelist() if _is_py(n, package)}
            meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
            version = _meta_version(z.read(meta).decode()) if meta else wheel.name.split("-")[1]
        return cls(files, version, f"wheel `{wheel.name}`, source read (not importable here)")

    @classmethod
    def from_folder(cls, parent: Path, version: str, package: str = "vllm") -> Source:
        files = {
            p.relative_to(parent).as_posix(): p.read_text(errors="replace")
            for p in (parent / package).rglob("*.py")
            if _is_py(p.relative_to(parent).as_posix(), package)
        }
        return cls(files, version, "installed (imported and run for real)")

    def path_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for p in (f"{base}/__init__.py", f"{base}.py"):
            if p in self.files:
                return p
        return None

    def is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self.files

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            try:
                self._trees[path] = ast.parse(self.files[path], filename=path)
            except SyntaxError:
                self._trees[path] = None
        return self._trees[path]

    def defined_at(self, name: str) -> list[tuple[str, int]]:
        """Where `name` is defined at a module's top level (class, def or assignment), for `moved`: a text search,
        not a parse of every file."""
        pattern = re.compile(
            rf"^(?:class|def|async def)\s+{re.escape(name)}\b|^{re.escape(name)}\s*(?::[^=\n]*)?=", re.M
        )
        out = []
        for path in sorted(self.files):
            text = self.files[path]
            if name in text and (m := pattern.search(text)):
                out.append((path, text.count("\n", 0, m.start()) + 1))
        return out


def _is_py(name: str, package: str) -> bool:
    return name.startswith(f"{package}/") and name.endswith(".py")


def _meta_version(metadata: str) -> str:
    m = re.search(r"^Version: (.+)$", metadata, re.M)
    return m.group(1).strip() if m else "?"


def _defined_names(node) -> list[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _top_level(tree: ast.Module):
    """Module-level statements, including those under `if` / `try` (TYPE_CHECKING, optional imports)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, ast.If):
            stack[:0] = node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack[:0] = node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody
        else:
            yield node


def _signature(node) -> str:
    a = node.args
    parts = [p.arg for p in [*a.posonlyargs, *a.args]]
    if a.vararg:
        parts.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        parts.append("*")
    parts += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        parts.append("**" + a.kwarg.arg)
    return f"({', '.join(parts)})"


# ---------------------------------------------------------------------------------------------------------------
# Looking a fact up in one version


@dataclass
class Found:
    status: str  # present, missing, moved, changed (set by the table, against the reference)
    where: str = ""  # file:line
    shape: str = ""  # module, class, function (its parameters), value, instance attribute, env, flag, text
    note: str = ""


class Resolver:
    def __init__(self, src: Source):
        self.src = src

    # a name in a module, re-exports followed
    def symbol(self, module: str, name: str, depth: int = 0):
        """(kind, path, node) for `name` in `module`: kind module (node None), def (a class/function/assign node),
        lazy (the module's __getattr__ names it: node is the string's line), or None."""
        if depth > 8:
            return None
        sub = f"{module}.{name}"
        if self.src.path_of(sub):
            return ("module", self.src.path_of(sub), None)
        path = self.src.path_of(module)
        tree = self.src.tree(path) if path else None
        if tree is None:
            return None
        lazy = False
        for node in _top_level(tree):
            if name in _defined_names(node):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__getattr__":
                    continue
                return ("def", path, node)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        origin = self._absolute(module, node)
                        if origin:
                            found = self.symbol(origin, alias.name, depth + 1)
                            if found:
                                return found
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name and self.src.path_of(alias.name):
                        return ("module", self.src.path_of(alias.name), None)
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                lazy = True
        if lazy:  # a module that builds its names on demand (vllm.envs, vllm.platforms): the name as a string
            for n in ast.walk(tree):
                if isinstance(n, ast.Constant) and n.value == name:
                    return ("lazy", path, n)
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str | None:
        if node.level == 0:
            return node.module
        parts = module.split(".")
        base = parts if self.src.is_package(module) else parts[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))

    def _module_of(self, path: str) -> str:
        p = path[:-3]
        return (p[: -len("/__init__")] if p.endswith("/__init__") else p).replace("/", ".")

    # an attribute of a class, bases followed
    def member(self, path: str, cls: ast.ClassDef, attr: str, depth: int = 0):
        if depth > 8:
            return None
        for node in cls.body:
            if attr in _defined_names(node):
                return ("def", path, node)
        for node in ast.walk(cls):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name):
                    if t.value.id in ("self", "cls"):
                        return ("instance", path, node)
        module = self._module_of(path)
        outside = None
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name is None:
                continue
            found = self.symbol(module, name)
            if found and found[0] == "def" and isinstance(found[2], ast.ClassDef):
                got = self.member(found[1], found[2], attr, depth + 1)
                if got:
                    return got
            elif found is None and name not in TRIVIAL_BASES:
                outside = name
        if outside:  # a base from another library (argparse's ArgumentParser): its members are not vLLM's to check
            return ("outside", path, cls, outside)
        return None

    def dotted(self, module: str, name: str):
        """`A.b.c` in `module`: the first part as a symbol, the rest as members of classes or modules."""
        parts = name.split(".")
        found = self.symbol(module, parts[0])
        for part in parts[1:]:
            if found is None:
                return None
            kind, path, node = found[:3]
            if kind == "module":
                found = self.symbol(self._module_of(path), part)
            elif kind == "def" and isinstance(node, ast.ClassDef):
                found = self.member(path, node, part)
            else:
                return ("opaque", path, node)  # an instance or a value: its attributes cannot be read statically
        return found

    def find(self, fact: Fact) -> Found:
        src = self.src
        if fact.kind == "module":
            path = src.path_of(fact.module)
            return Found("present", f"{path}:1", "module") if path else self._moved_module(fact.module)
        if fact.kind == "symbol":
            if not src.path_of(fact.module):
                return self._moved(fact.name, f"no module {fact.module}")
            found = self.dotted(fact.module, fact.name)
            if found is None:
                return self._moved(fact.name, f"{fact.module} has no {fact.name}")
            return self._found(found)
        if fact.kind == "env":
            path = src.path_of("vllm.envs")
            tree = src.tree(path) if path else None
            for n in ast.walk(tree) if tree else []:
                if isinstance(n, ast.Dict):
                    for k in n.keys:
                        if isinstance(k, ast.Constant) and k.value == fact.name:
                            return Found("present", f"{path}:{k.lineno}", "env")
            return Found("missing", note="not in vllm.envs' registry")
        if fact.kind == "flag":
            return self._flag(fact.name)
        if fact.kind == "text":
            path = src.path_of(fact.module)
            if not path:
                return Found("missing", note=f"no module {fact.module}")
            text = src.files[path]
            i = text.find(fact.name)
            if i < 0:
                return Found("missing", note=f"{fact.module} does not mention {fact.name!r}")
            return Found("present", f"{path}:{text.count(chr(10), 0, i) + 1}", "text")
        if fact.kind == "any":
            tried = []
            for alt in fact.alternatives:
                kind, module, name = alt.split(":", 2)
                got = self.find(Fact(alt, kind, module, name))
                if got.status == "present":
                    return Found("present", got.where, got.shape, note=f"as {module}:{name}" if name else module)
                tried.append(got)
            moved = next((t for t in tried if t.status == "moved"), None)  # none where Eyrie looks: found elsewhere?
            notes = "; ".join(t.note for t in tried)
            return Found("moved", moved.where, note=notes) if moved else Found("missing", note=notes)
        raise ValueError(fact.kind)

    def _found(self, found) -> Found:
        kind, path, node = found[:3]
        if kind == "outside":
            return Found("present", f"{path}:{node.lineno}", "outside vLLM", note=f"inherited from {found[3]}")
        line = getattr(node, "lineno", 1)
        where = f"{path}:{line}"
        if kind == "module":
            return Found("present", where, "module")
        if kind == "lazy":
            return Found("present", where, "lazy module attribute")
        if kind == "instance":
            return Found("present", where, "instance attribute")
        if kind == "opaque":
            return Found("present", where, "value", note="attributes of a value are not read statically")
        if isinstance(node, ast.ClassDef):
            return Found("present", where, "class")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Found("present", where, "function" + _signature(node))
        return Found("present", where, "value")

    def _moved(self, dotted: str, note: str) -> Found:
        head = dotted.split(".")[0]
        defs = self.src.defined_at(head)
        if defs and "." not in dotted:
            path, line = defs[0]
            return Found("moved", f"{path}:{line}", note=f"{note}; defined in {self._module_of(path)}")
        return Found("missing", note=note)

    def _moved_module(self, module: str) -> Found:
        leaf = module.rsplit(".", 1)[-1]
        hits = sorted(p for p in self.src.files if p.endswith(f"/{leaf}.py") or p.endswith(f"/{leaf}/__init__.py"))
        if hits:
            return Found("moved", f"{hits[0]}:1", note=f"no module {module}; a module {leaf} is at {hits[0]}")
        return Found("missing", note=f"no module {module}")

    def _flag(self, flag: str) -> Found:
        literal = f'"{flag}"'
        for path in sorted(self.src.files):
            text = self.src.files[path]
            i = text.find(literal)
            if i >= 0 and ("entrypoints" in path or "engine" in path):
                return Found("present", f"{path}:{text.count(chr(10), 0, i) + 1}", "flag")
        field_name = flag[2:].replace("-", "_")
        for path in sorted(self.src.files):
            if not any(f"class {c}" in self.src.files[path] for c in ARG_CLASSES):
                continue
            tree = self.src.tree(path)
            for node in tree.body if tree else []:
                if isinstance(node, ast.ClassDef) and node.name in ARG_CLASSES:
                    for s in node.body:
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                            if s.target.id == field_name:
                                return Found("present", f"{path}:{s.lineno}", "flag", note=f"{node.name}.{field_name}")
        return Found("missing", note=f"no {flag} and no {field_name} field in {', '.join(ARG_CLASSES)}")


# ---------------------------------------------------------------------------------------------------------------
# The table


def matrix(facts: dict[str, Fact], sources: list[Source]) -> dict[str, dict[str, Found]]:
    """fact key -> version -> Found; a present function whose parameters differ from the first version's: changed."""
    out: dict[str, dict[str, Found]] = {}
    for key, fact in sorted(facts.items()):
        row = {s.version: Resolver(s).find(fact) for s in sources}
        ref = row[sources[0].version]
        for found in row.values():
            if (
                found is not ref
                and found.status == "present"
                and ref.status == "present"
                and found.shape.startswith("function")
                and ref.shape.startswith("function")
                and found.shape != ref.shape
            ):
                found.status = "changed"
                found.note = f"parameters {found.shape[8:]}, {sources[0].version} has {ref.shape[8:]}"
                first = PASSED_ON.get(key)
                if first and _params(found.shape)[:first] == _params(ref.shape)[:first]:
                    found.note += f"; Eyrie's wrapper reads the first {first} and passes the rest on"
                    found.status = "passed on"
        out[key] = row
    return out


def _params(shape: str) -> list[str]:
    """The parameter names of a `function(...)` shape."""
    inner = shape[shape.find("(") + 1 : shape.rfind(")")]
    return [p.strip().split("=")[0].split(":")[0].strip() for p in inner.split(",") if p.strip()]


def _label(fact: Fact) -> str:
    if fact.kind == "module":
        return f"`{fact.module}` (module)"
    if fact.kind == "symbol":
        return f"`{fact.module}`: `{fact.name}`"
    if fact.kind == "env":
        return f"`{fact.name}` (variable)"
    if fact.kind == "flag":
        return f"`{fact.name}` (`vllm serve` flag)"
    if fact.kind == "text":
        return f"`{fact.module}` mentions `{fact.name}`"
    if fact.name in ANY_OF:
        return fact.name
    alts = [k.split(":", 2) for k in fact.alternatives]
    return "one of: " + ", ".join(f"`{m}`: `{n}`" if n else f"`{m}`" for _, m, n in alts)


def _uses(fact: Fact) -> str:
    """Where Eyrie's code relies on the fact, and why where the table names it."""
    places = [u for u in fact.used_at if not u.startswith("benchmarks/")][:2]
    return "; ".join(filter(None, [", ".join(f"`{p}`" for p in places), fact.why]))


def _cell(found: Found) -> str:
    where = found.where.removeprefix("vllm/")
    if found.status == "present":
        return f"present `{where}`"
    if found.status in ("moved", "changed"):
        return f"**{found.status}** `{where}`"
    if found.status == "passed on":
        return f"changed, passed on `{where}`"
    return "**missing**"


STATUSES = ("present", "missing", "moved", "changed", "passed on")
COUNTS = ("present", "passed on", "handled", "missing", "moved", "changed")


def _count(status: str, key: str) -> str:
    """The summary's column: a fact Eyrie has a path without counts as handled, whatever its status."""
    return "handled" if status in ("missing", "moved", "changed") and handled(key) else status


def eyrie_paths(facts: dict[str, Fact], table: dict[str, dict[str, Found]], version: str) -> dict[str, str]:
    """What Eyrie's plugin and preflight do on `version`, decided from its source as their code decides it on an
    installed vLLM (the same facts; the runner rule's answer from preflight's own function)."""
    from eyrie.stages.preflight.installed_vllm import runner_without_rule

    def has(key: str) -> bool:
        row = table.get(key)
        return row is not None and row[version].status in ("present", "passed on")

    v1 = has("module:vllm.v1.worker.gpu_model_runner:")
    v1_hook = v1 and has("symbol:vllm.v1.worker.gpu_model_runner:GPUModelRunner._setup_eagle3_aux_hidden_state_outputs")
    v2_hook = has("symbol:vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils:set_eagle3_aux_hidden_state_layers")
    if has("symbol:vllm.config:VllmConfig.use_v2_model_runner"):
        rule = "the version's own rule (`VllmConfig.use_v2_model_runner`), run by preflight on each server's arguments"
    else:
        runner, why = runner_without_rule(version, v1, {})
        rule = f"{runner}: {why}"
    return {
        "compat hooks installed": ", ".join(r for r, ok in (("V1", v1_hook), ("V2", v2_hook)) if ok) or "none",
        "V2 hook's call": (
            "rebound in the V2 runner too"
            if has("symbol:vllm.v1.worker.gpu.model_runner:set_eagle3_aux_hidden_state_layers")
            else "not imported by the V2 runner by name"
        ),
        "hidden-interface switch": "interfaces, " + ("V1's runner, " if v1 else "") + "V2's eagle3_utils",
        "preflight's runner rule": rule,
        "CPU engine fork's kernel scan": (
            "wrapped" if has("symbol:vllm.triton_utils.dispatcher:_rebind_kernels") else "left as vLLM has it"
        ),
    }


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version)[:3])


def markdown(facts, table, sources, runs: dict | None, header: str) -> str:
    sources = sorted(sources, key=lambda s: _version_key(s.version))
    versions = [s.version for s in sources]
    lines = [header, ""]
    lines.append("| vLLM | source read | " + " | ".join(COUNTS) + " |")
    lines.append("|---|---|" + "---|" * len(COUNTS))
    for s in sources:
        counts = {k: sum(_count(row[s.version].status, key) == k for key, row in table.items()) for k in COUNTS}
        lines.append(f"| {s.version} | {s.origin} | " + " | ".join(str(counts[k]) for k in counts) + " |")
    lines += [
        "",
        "present: where Eyrie looks; passed on: a function Eyrie wraps whose parameters after those it reads differ "
        "from the reference's (the installed vLLM); handled: missing, moved or changed, and Eyrie's code has a path "
        "without it (the last column says which, and the test that runs it); missing, moved, changed: the rest, "
        "which Eyrie needs.",
        "",
        "Facts that differ between the versions (cell: status and where, file:line under `vllm/`):",
        "",
    ]
    lines.append("| fact | " + " | ".join(versions) + " | Eyrie relies on it at | where a version lacks it |")
    lines.append("|---|" + "---|" * len(versions) + "---|---|")
    same, differ = [], []
    for key, row in table.items():
        (same if all(f.status == "present" for f in row.values()) else differ).append(key)
    for key in differ:
        fact = facts[key]
        cells = [_cell(table[key][v]) for v in versions]
        path = handled(key)
        lacking = any(f.status in ("missing", "moved", "changed") for f in table[key].values())
        without = (f"{path[0]} (`{path[1]}`)" if path[1] else path[0]) if path else "**needed**" if lacking else ""
        lines.append(f"| {_label(fact)} | " + " | ".join(cells) + f" | {_uses(fact)} | {without} |")
    lines += ["", "Eyrie's paths on each version, decided from its source as Eyrie's code decides them:", ""]
    paths = {v: eyrie_paths(facts, table, v) for v in versions}
    lines.append("| | " + " | ".join(versions) + " |")
    lines.append("|---|" + "---|" * len(versions))
    for what in paths[versions[0]]:
        lines.append(f"| {what} | " + " | ".join(paths[v][what] for v in versions) + " |")
    lines += ["", f"Present in every version ({len(same)}):", ""]
    lines.append("| fact | " + " | ".join(versions) + " |")
    lines.append("|---|" + "---|" * len(versions))
    for key in same:
        lines.append(f"| {_label(facts[key])} | " + " | ".join(_cell(table[key][v]) for v in versions) + " |")
    if runs:
        lines += ["", f"## Run for real on the installed vLLM {runs['version']}", ""]
        lines.append(f"- static reading against real imports: {runs['agree']}")
        for d in runs["disagree"]:
            lines.append(f"  - disagrees: {d}")
        for what in ("plugin", "probe"):
            run = runs[what]
            lines.append(f"- {what}: `{run['command']}` -> exit {run['rc']}: `{json.dumps(run['answer'])}`")
        for kind, got in runs["check_target"].items():
            lines.append(
                f"- probe `check_target` on {kind} (the demo's config, this target): exit {got['rc']}, "
                f"`{got['vllm_class']}`, EAGLE-3 path {got['eagle3_path']}, "
                f"runners {json.dumps(got['model_runners'])}, failures {json.dumps(got['failures'])}"
                + (f", error {got['error']}" if got["error"] else "")
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# The installed vLLM, for real

REAL_CHECK = r"""
import importlib, json, sys
out = {}
for key in json.loads(sys.stdin.read()):
    kind, module, name = key.split(":", 2)
    try:
        obj = importlib.import_module(module)
        for part in (name.split(".") if name else []):
            if isinstance(obj, type) and not hasattr(obj, part):
                # a field (dataclass, msgspec, NamedTuple) is declared on the class, set on its instances
                if any(part in getattr(c, "__annotations__", {}) for c in obj.__mro__) or part in getattr(
                    obj, "__struct_fields__", ()
                ):
                    break
            if type(obj).__name__ == "module" and not hasattr(obj, part):
                try:  # a submodule not imported yet: `from package import submodule` imports it
                    obj = importlib.import_module(obj.__name__ + "." + part)
                    continue
                except ImportError:
                    pass
            obj = getattr(obj, part)
        out[key] = "present"
    except Exception as err:
        out[key] = f"missing ({type(err).__name__}: {str(err)[:120]})"
print(json.dumps(out))
"""

PLUGIN = (
    "import json, eyrie.vllm.plugin as p, eyrie.vllm.plugin.connector, eyrie.vllm.plugin.compat as c, "
    "eyrie.vllm.plugin.fork, eyrie.vllm.plugin.model_inspection, eyrie.vllm.plugin.auth; p.register(); "
    "print(json.dumps({'runners_wrapped': c.install(), 'missing_hooks': sorted(c.missing_hooks())}))"
)


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def run_installed(python: str, facts: dict[str, Fact], found: dict[str, dict[str, Found]], version: str) -> dict:
    keys = [
        k
        for k, f in facts.items()
        if f.kind in ("module", "symbol") and found[k][version].shape not in ("instance attribute",)
    ]
    real = subprocess.run([python, "-c", REAL_CHECK], input=json.dumps(keys), capture_output=True, text=True, cwd=REPO)
    answer = _last_json(real.stdout) or {}
    disagree = [
        f"{k}: static {found[k][version].status}, imported {answer.get(k)}"
        for k in keys
        if (found[k][version].status == "present") != (answer.get(k) == "present")
    ]
    plugin = subprocess.run([python, "-c", PLUGIN], capture_output=True, text=True, cwd=REPO)
    probe = subprocess.run(
        [python, "-m", "eyrie.ops.vllm_probe"],
        input='{"op": "drafter_flags"}',
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    targets = check_targets(python)
    return {
        "version": version,
        "agree": f"{len(keys) - len(disagree)} of {len(keys)} module and symbol facts (instance attributes excluded)",
        "disagree": disagree,
        "plugin": {
            "command": 'python -c "import eyrie.vllm.plugin...; register()"',
            "rc": plugin.returncode,
            "answer": _last_json(plugin.stdout) or plugin.stderr.strip()[-400:],
        },
        "check_target": targets,
        "probe": {
            "command": 'echo \'{"op": "drafter_flags"}\' | python -m eyrie.ops.vllm_probe',
            "rc": probe.returncode,
            "answer": _last_json(probe.stdout) or probe.stderr.strip()[-400:],
        },
    }


# Preflight's check of a native and a compatibility-layer target, through the probe as the flow runs it.
PROBE_TARGETS = ("tiny-llama", "tiny-gpt2")


def check_targets(python: str) -> dict:
    """The probe's `check_target` on tiny targets built here (the demo's config, its target swapped): each one's
    vLLM class, EAGLE-3 path, model runners and failures."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in PROBE_TARGETS:
            path = f"{tmp}/{kind}"
            build = f"from eyrie.target.tiny import build_target; build_target({kind!r}, {path!r})"
            subprocess.run([python, "-c", build], capture_output=True, text=True, cwd=REPO, check=True)
            config = (
                "import json, sys; from eyrie.config import load_config; "
                "c = load_config('configs/demo.yaml').model_dump(mode='json'); "
                f"c['target']['model'] = {path!r}; "
                "print(json.dumps({'op': 'check_target', 'config': c, 'serve': True}))"
            )
            request = subprocess.run([python, "-c", config], capture_output=True, text=True, cwd=REPO, check=True)
            run = subprocess.run(
                [python, "-m", "eyrie.ops.vllm_probe"], input=request.stdout, capture_output=True, text=True, cwd=REPO
            )
            report = (_last_json(run.stdout) or {}).get("report") or {}
            runners = (report.get("target_facts") or {}).get("model_runners") or {}
            out[kind] = {
                "rc": run.returncode,
                "vllm_class": report.get("vllm_class"),
                "eagle3_path": report.get("eagle3_path"),
                "model_runners": {k: v.get("runner") for k, v in runners.items()},
                "failures": report.get("failures"),
                "error": None if report else run.stderr.strip()[-400:],
            }
    return out


def installed_source() -> Source:
    spec = importlib.util.find_spec("vllm")  # finds the package; does not import it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no vLLM installed in this environment")
    folder = Path(next(iter(spec.submodule_search_locations))).parent
    version = "?"
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return Source.from_folder(folder, version)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--installed", action="store_true", help="the installed vLLM first (the reference), run for real")
    ap.add_argument("--wheel", type=Path, action="append", default=[], help="a vLLM wheel, read as a zip")
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    ap.add_argument("--machine", default="", help="the machine, for the results' header")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    command = shlex.join(["benchmarks/vllm_matrix.py", *(argv if argv is not None else sys.argv[1:])])
    for w in args.wheel:  # the wheel's name, not where it lay
        command = command.replace(str(w), w.name)
    # The facts come from the working tree: name what in eyrie/ differs from the commit.
    dirty = subprocess.run(["git", "status", "--porcelain", "eyrie"], capture_output=True, text=True, cwd=REPO)
    edits = sorted(line[3:] for line in dirty.stdout.splitlines() if line[3:].endswith(".py"))
    code = f"Code at {commit.stdout.strip() or '?'}" + (
        f", with the working tree's uncommitted edits of {', '.join(edits)}" if edits else ""
    )
    header = (
        f"# vLLM facts Eyrie relies on, by version ({datetime.date.today().isoformat()})\n\n"
        f"Machine: {args.machine or 'not given'}. {code}. Command, from the repository root: "
        f"`.venv/bin/python {command}`"
    )
    sources = ([installed_source()] if args.installed else []) + [Source.from_wheel(w) for w in args.wheel]
    if not sources:
        ap.error("name --installed and/or --wheel")
    facts = collect_facts(REPO)
    table = matrix(facts, sources)
    runs = run_installed(sys.executable, facts, table, sources[0].version) if args.installed else None
    md = markdown(facts, table, sources, runs, header)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(md)
        data = {
            "versions": [{"version": s.version, "source": s.origin} for s in sources],
            "facts": [
                {**asdict(facts[k]), "found": {v: asdict(f) for v, f in row.items()}, "without_it": handled(k)}
                for k, row in table.items()
            ],
            "eyrie_paths": {s.version: eyrie_paths(facts, table, s.version) for s in sources},
            "installed_run": runs,
        }
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
