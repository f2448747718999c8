"""The vLLM start-up levers: which ones a server of the target is started with, decided from the installed vLLM's own
facts and the target's config.json, each named with why (docs/operations/start-up.md).

A large target's start is its load (the weights), vLLM's memory profiling, its compile and, for a multimodal
wrapper, a vision tower the run never uses. vLLM offers levers for each; Eyrie applies those that work for the
target and the installed vLLM and refuses, before any load, those an operator asks for that cannot:

- `language-model-only`: `--language-model-only` for a multimodal wrapper (config.json with a `text_config` and a
  vision or audio config): vLLM never builds the vision tower. It changes what the server is built with, so it is
  part of the server's identity (`ServerSpec.language_model_only`); text outputs are the language model's either way;
- `startup-plan`: `VLLM_ENABLE_STARTUP_PLAN=1`: vLLM keeps its memory-profiling result under VLLM_CACHE_ROOT and a
  second start of the same server skips the profiling (vllm/v1/worker/startup_plan.py). Start-up only;
- `compile-cache`: `VLLM_CACHE_ROOT` pinned to the node's persistent vLLM cache (the environment's, else vLLM's
  default), never a temporary folder: compile artifacts, AOT artifacts and the start-up plan survive a restart;
- `weight-cache` (asked for: `extraction.startup.weight_cache`, or `--load-format ipc_cache` in server_args):
  `--load-format ipc_cache`, the weights mapped from a `vllm preload` daemon. vLLM refuses it at load
  (`check_ipc_quant_support`) unless every layer's quantization method declares `supports_pre_processed_weights`,
  and off CUDA/ROCm (`check_ipc_platform_support`): decided here from the same facts, before any load;
- `snapshot` (asked for: `extraction.startup.snapshot`): `vllm snapshot create` refuses tensor parallelism above 1
  and speculative decoding (`validate_create_args`); Eyrie's servers all decode speculatively (extraction's
  `extract_hidden_states`, export's and evaluation's EAGLE-3) or, for the baseline, are started by `vllm serve`.

The installed vLLM's facts are read from its source files, never by importing it (`read_facts`): the server
command is built in the flow's process, which may not be the interpreter that runs vLLM (`eyrie.run.vllm_python`).
A lever the installed vLLM lacks is named unavailable in vLLM X and nothing of it is passed.
"""

from __future__ import annotations

import functools
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eyrie.config import StartupConfig

LANGUAGE_MODEL_ONLY_FLAG = "--language-model-only"
STARTUP_PLAN_ENV = "VLLM_ENABLE_STARTUP_PLAN"
CACHE_ROOT_ENV = "VLLM_CACHE_ROOT"
IPC_LOAD_FORMAT = "ipc_cache"
PRELOAD_SUBCOMMAND = "preload"
SNAPSHOT_SUBCOMMAND = "snapshot"
# Keys of config.json that mark a multimodal wrapper's non-text tower (beside its `text_config`).
TOWER_KEYS = ("vision_config", "vision_tower_config", "visual", "audio_config", "mm_projector_config")
# Folders a persistent cache must not be in: cleaned at reboot, or memory.
TEMPORARY_ROOTS = ("/tmp", "/var/tmp", "/dev/shm", "/run")

# Where each quantization method's layer methods live, under vLLM's model_executor/layers/quantization/ (several
# names: files move between versions). vLLM's IPC weight cache loads a layer only when its method declares
# `supports_pre_processed_weights = True` (weight_cache/protocol.py, check_ipc_quant_support); in vLLM 0.32.0
# fp8.py's linear and MoE methods do, modelopt.py's NVFP4 MoE method and mxfp4.py's MoE method do, and no
# compressed-tensors, AWQ, GPTQ or moe_wna16 method does. `read_facts` reads each method class's declaration from
# the installed source; a method not in this table is looked for as `<method>.py`.
QUANT_METHOD_FILES: dict[str, tuple[str, ...]] = {
    "fp8": ("fp8.py",),
    "fbgemm_fp8": ("fbgemm_fp8.py",),
    "compressed-tensors": ("compressed_tensors/",),
    "modelopt": ("modelopt.py",),
    "modelopt_fp4": ("modelopt.py",),
    "mxfp4": ("mxfp4.py",),
    "awq": ("awq.py", "auto_awq.py", "awq_marlin.py", "awq_triton.py"),
    "gptq": ("gptq.py", "auto_gptq.py", "gptq_marlin.py"),
    "moe_wna16": ("moe_wna16.py",),
    "quark": ("quark/",),
}
PREPROCESSED = re.compile(r"^    supports_pre_processed_weights\s*(?::\s*bool\s*)?=\s*(True|False)\b", re.M)
DYNAMIC = re.compile(r"^    def supports_pre_processed_weights\b", re.M)
CLASS = re.compile(r"^class (\w+)(?:\(([^)]*)\))?\s*:", re.M)

Status = Literal["applied", "off", "not applicable", "unavailable", "refused"]


@dataclass(frozen=True)
class VllmFacts:
    """What the installed vLLM offers, read from its source (`read_facts`): its server flags (explicit in
    engine/arg_utils.py, or derived by vLLM from an EngineArgs field), the variables of its `vllm.envs` registry,
    its CLI subcommands, its load formats, its quantization method classes (a `...Method` class of
    layers/quantization/) with whether each declares `supports_pre_processed_weights = True`, and whether it is the
    CPU build."""

    version: str
    flags: frozenset[str] = frozenset()
    env_vars: frozenset[str] = frozenset()
    subcommands: frozenset[str] = frozenset()
    load_formats: frozenset[str] = frozenset()
    # (file under layers/quantization/, method class, its supports_pre_processed_weights: None when a property)
    quant_methods: frozenset[tuple[str, str, bool | None]] = frozenset()
    cpu_build: bool = False


@dataclass(frozen=True)
class TargetFacts:
    """What of the target's config.json decides the levers."""

    multimodal: bool
    towers: tuple[str, ...]  # the config keys of its non-text towers
    quant_method: str | None  # quantization_config.quant_method (the wrapper's, else its text_config's)
    moe: bool = False  # routed experts in its text config


@dataclass(frozen=True)
class Lever:
    name: str
    status: Status
    reason: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    asked: bool = False  # the operator asked for it (a refusal then fails preflight)


@dataclass(frozen=True)
class Plan:
    """The levers of one server: each with its status and reason; `args`/`env` what is applied."""

    levers: tuple[Lever, ...] = field(default_factory=tuple)

    @property
    def args(self) -> list[str]:
        return [a for lever in self.levers if lever.status == "applied" for a in lever.args]

    @property
    def env(self) -> dict[str, str]:
        return {k: v for lever in self.levers if lever.status == "applied" for k, v in lever.env}

    @property
    def language_model_only(self) -> bool:
        return any(lv.name == "language-model-only" and lv.status == "applied" for lv in self.levers)

    @property
    def refused(self) -> list[Lever]:
        """Levers the operator asked for that cannot work: preflight refuses the run with their reasons."""
        return [lv for lv in self.levers if lv.asked and lv.status in ("refused", "unavailable")]

    def lines(self, server: str) -> list[str]:
        return [f"the {server} server: {lv.name} {lv.status}: {lv.reason}" for lv in self.levers]

    def as_dict(self) -> dict[str, dict]:
        return {lv.name: {"status": lv.status, "reason": lv.reason, "asked": lv.asked} for lv in self.levers}


# ---------------------------------------------------------------------------------------------------------------
# Facts


def read_facts(package: Path, version: str, cpu_build: bool = False) -> VllmFacts:
    """The installed vLLM's facts from its package folder `package` (…/site-packages/vllm), without importing it.
    A file a version lacks gives no facts of it: its levers are then unavailable."""

    def text(rel: str) -> str:
        try:
            return (package / rel).read_text(encoding="utf-8")
        except OSError:
            return ""

    args = text("engine/arg_utils.py")
    flags = set(re.findall(r"[\"'](--[a-z0-9][a-z0-9-]*)[\"']", args))
    # vLLM derives most flags from EngineArgs fields (`--` + the name with dashes): a field declared in the class.
    flags |= {"--" + name.replace("_", "-") for name in re.findall(r"^    ([a-z][a-z0-9_]*)\s*:", args, re.M)}
    envs = text("envs.py")
    env_vars = set(re.findall(r"^\s+[\"'](VLLM_[A-Z0-9_]+)[\"']\s*:", envs, re.M))
    cli = package / "entrypoints" / "cli"
    subcommands = {p.stem for p in cli.glob("*.py") if p.stem not in ("__init__", "main", "types")}
    loaders = text("model_executor/model_loader/__init__.py")
    table = re.search(r"_LOAD_FORMAT_TO_MODEL_LOADER[^=]*=\s*\{(.*?)\}", loaders, re.S)
    load_formats = set(re.findall(r"[\"']([a-z0-9_]+)[\"']\s*:", table.group(1))) if table else set()
    if not load_formats:  # the loaders' table elsewhere: the formats' Literal (LoadConfig's `LoadFormats`)
        literal = re.search(r"LoadFormats\s*=\s*Literal\[(.*?)\]", loaders, re.S)
        load_formats = set(re.findall(r"[\"']([a-z0-9_]+)[\"']", literal.group(1))) if literal else set()
    quant = package / "model_executor" / "layers" / "quantization"
    # class -> its file, its bases, its own declaration: "True", "False", "dynamic" (a property), None (none)
    declared: dict[str, tuple[str, list[str], str | None]] = {}
    for f in sorted(quant.rglob("*.py")):
        rel, source = f.relative_to(quant).as_posix(), f.read_text(encoding="utf-8")
        heads = list(CLASS.finditer(source))
        for head, nxt in zip(heads, [*heads[1:], None]):
            body = source[head.end() : nxt.start() if nxt else len(source)]
            bases = [b.strip().split(".")[-1] for b in (head.group(2) or "").split(",") if b.strip()]
            own = PREPROCESSED.search(body)
            kind = "dynamic" if DYNAMIC.search(body) else own.group(1) if own else None
            declared[head.group(1)] = (rel, bases, kind)

    def declares(cls: str, seen: frozenset = frozenset()) -> bool | None:
        """Its own declaration, else the first base's of this package that has one (Python's lookup), else vLLM's
        default (False); None: a property, decided per instance at load."""
        _, bases, own = declared[cls]
        if own is not None:
            return None if own == "dynamic" else own == "True"
        for b in bases:
            if b in declared and b not in seen:
                return declares(b, seen | {cls})
        return False

    methods = {  # the weights' methods: linear and MoE (a KV-cache method holds scales only)
        (rel, cls, declares(cls))
        for cls, (rel, bases, _) in declared.items()
        if (cls.endswith("Method") or any(b.endswith(("MethodBase", "Method")) for b in bases)) and "KVCache" not in cls
    }
    return VllmFacts(
        version=version,
        flags=frozenset(flags),
        env_vars=frozenset(env_vars),
        subcommands=frozenset(subcommands),
        load_formats=frozenset(load_formats),
        quant_methods=frozenset(methods),
        cpu_build=cpu_build,
    )


@functools.lru_cache(maxsize=4)
def _cached_facts(package: str, version: str, cpu_build: bool, stamp: float) -> VllmFacts:
    return read_facts(Path(package), version, cpu_build)


def installed_facts() -> VllmFacts | None:
    """The facts of the vLLM that runs the servers (`eyrie.run.vllm_python`: this interpreter's, or the one
    EYRIE_VLLM_PYTHON names), read from its package folder; None when none is installed or it cannot be found."""
    from eyrie.run.vllm_python import one_environment, vllm_cpu_build, vllm_environment, vllm_version

    version = vllm_version()
    if version is None:
        return None
    package = None
    if one_environment():
        import importlib.util

        spec = importlib.util.find_spec("vllm")  # its location; nothing of it is run
        if spec is not None and spec.origin:
            package = Path(spec.origin).parent
    else:
        for place in vllm_environment().get("watch", [])[1:]:
            if (Path(place) / "vllm" / "envs.py").exists():
                package = Path(place) / "vllm"
                break
    if package is None:
        return None
    envs = package / "envs.py"
    stamp = envs.stat().st_mtime if envs.exists() else 0.0
    return _cached_facts(str(package), version, vllm_cpu_build(), stamp)


def target_facts(cfg: dict) -> TargetFacts:
    towers = tuple(k for k in TOWER_KEYS if cfg.get(k))
    text = cfg.get("text_config") or cfg.get("language_config")
    multimodal = bool(text) and bool(towers)
    quant = cfg.get("quantization_config") or (text or {}).get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    body = text or cfg
    moe = any(body.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))
    return TargetFacts(multimodal=multimodal, towers=towers, quant_method=method, moe=moe)


# ---------------------------------------------------------------------------------------------------------------
# Decisions


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value given to `flag` in `args` (`--flag v` or `--flag=v`); vLLM takes the last."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def preprocessed_support(facts: VllmFacts, method: str | None, moe_target: bool = True) -> tuple[bool | None, str]:
    """Whether vLLM's IPC weight cache can load a target quantized with `method` (None: unquantized; `moe_target`:
    it has MoE layers), and why: False when no linear method of the method's family (every quantized linear layer
    has one), or for an MoE target no MoE method, declares `supports_pre_processed_weights`; True when every one
    does; None when some do (vLLM decides per layer at load)."""
    if method is None:
        return True, "an unquantized target (vLLM's unquantized linear and MoE methods load pre-processed weights)"
    files = QUANT_METHOD_FILES.get(method, (f"{method}.py",))
    ours = {
        (f, cls, ok)
        for f, cls, ok in facts.quant_methods
        if any(f == p or (p.endswith("/") and f.startswith(p)) for p in files)
    }
    where = f"model_executor/layers/quantization/{{{','.join(files)}}}"
    if not ours:
        return None, f"vLLM {facts.version} has no method classes for quantization method {method!r} in {where}"
    linear = {(cls, ok) for _, cls, ok in ours if "Linear" in cls}
    moe = {(cls, ok) for _, cls, ok in ours if "Linear" not in cls}
    declaring = sorted(cls for _, cls, ok in ours if ok)
    refusal = (
        f"its IPC loader refuses such a layer at load (UnsupportedQuantForIPCError), after the daemon has read "
        f"the weights ({where})"
    )
    if moe_target and moe and all(ok is False for _, ok in moe):
        names = ", ".join(sorted(c for c, _ in moe))
        return False, (
            f"no {method} MoE method of vLLM {facts.version} ({names}) declares supports_pre_processed_weights: "
            f"{refusal}"
        )
    if linear and all(ok is False for _, ok in linear):
        names = ", ".join(sorted(c for c, _ in linear))
        return False, (
            f"vLLM {facts.version}'s {method} linear method ({names}) does not declare "
            f"supports_pre_processed_weights: {refusal}"
        )
    if all(ok for _, _, ok in ours):
        return True, f"every {method} method of vLLM {facts.version} loads pre-processed weights"
    return None, (
        f"some {method} methods of vLLM {facts.version} load pre-processed weights ({', '.join(declaring)}) "
        "and others do not"
    )


def decide(
    facts: VllmFacts | None,
    target: TargetFacts,
    startup: StartupConfig,
    *,
    kind: str,
    tensor_parallel_size: int,
    server_args: list[str],
    environ: dict[str, str],
) -> Plan:
    """The levers of one server of `kind` (`extraction`, `serving`: target plus drafter, `target`: the baseline),
    from the installed vLLM's `facts` (None: unknown, nothing applied), the target's, the operator's choices
    (`extraction.startup`), the server's extra arguments and its environment (inherited plus server_env)."""
    version = facts.version if facts is not None else "?"
    levers: list[Lever] = []

    def unavailable(name: str, what: str, asked: bool = False) -> Lever:
        if facts is None:
            return Lever(name, "unavailable", "the installed vLLM's source could not be read", asked=asked)
        return Lever(name, "unavailable", f"unavailable in vLLM {version}: it has no {what}", asked=asked)

    # --language-model-only
    name = "language-model-only"
    if not startup.language_model_only:
        levers.append(Lever(name, "off", "extraction.startup.language_model_only is false"))
    elif not target.multimodal:
        why = "the target is no multimodal wrapper (no text_config beside a vision or audio config)"
        levers.append(Lever(name, "not applicable", why))
    elif facts is None or LANGUAGE_MODEL_ONLY_FLAG not in facts.flags:
        levers.append(unavailable(name, f"{LANGUAGE_MODEL_ONLY_FLAG} flag"))
    elif LANGUAGE_MODEL_ONLY_FLAG in server_args:
        levers.append(Lever(name, "not applicable", "extraction.server_args passes it already"))
    else:
        levers.append(
            Lever(
                name,
                "applied",
                f"a multimodal wrapper ({', '.join(target.towers)} beside its text_config) whose run sends text "
                "only: vLLM never builds its non-text towers",
                args=(LANGUAGE_MODEL_ONLY_FLAG,),
            )
        )

    # VLLM_ENABLE_STARTUP_PLAN=1
    name = "startup-plan"
    if not startup.startup_plan:
        levers.append(Lever(name, "off", "extraction.startup.startup_plan is false"))
    elif facts is None or STARTUP_PLAN_ENV not in facts.env_vars:
        levers.append(unavailable(name, f"{STARTUP_PLAN_ENV} variable (vllm.envs)"))
    elif STARTUP_PLAN_ENV in environ:
        levers.append(Lever(name, "not applicable", f"{STARTUP_PLAN_ENV}={environ[STARTUP_PLAN_ENV]} is set already"))
    else:
        levers.append(
            Lever(
                name,
                "applied",
                "a second start of the same server on this node reuses the memory-profiling result kept under "
                f"{CACHE_ROOT_ENV}/startup_plan/",
                env=((STARTUP_PLAN_ENV, "1"),),
            )
        )

    # VLLM_CACHE_ROOT on the node's persistent cache
    name = "compile-cache"
    root = cache_root(environ)
    if not startup.compile_cache:
        levers.append(Lever(name, "off", "extraction.startup.compile_cache is false"))
    elif facts is None or CACHE_ROOT_ENV not in facts.env_vars:
        levers.append(unavailable(name, f"{CACHE_ROOT_ENV} variable (vllm.envs)"))
    elif is_temporary(root):
        levers.append(
            Lever(
                name,
                "not applicable",
                f"{CACHE_ROOT_ENV} resolves to {root}, a temporary folder: a restart compiles again; set "
                f"{CACHE_ROOT_ENV} to the node's local disk (the worker unit uses /var/cache/eyrie/vllm)",
            )
        )
    else:
        levers.append(
            Lever(
                name,
                "applied",
                f"compile and AOT artifacts and the start-up plan kept in {root}, the node's vLLM cache",
                env=((CACHE_ROOT_ENV, str(root)),),
            )
        )

    # --load-format ipc_cache (with a `vllm preload` daemon)
    name = "weight-cache"
    in_args = _flag_value(server_args, "--load-format") == IPC_LOAD_FORMAT
    asked = startup.weight_cache or in_args
    if not asked:
        levers.append(Lever(name, "off", "not asked (extraction.startup.weight_cache)"))
    elif facts is None or IPC_LOAD_FORMAT not in facts.load_formats:
        levers.append(unavailable(name, f"--load-format {IPC_LOAD_FORMAT}", asked=True))
    elif PRELOAD_SUBCOMMAND not in facts.subcommands:
        levers.append(unavailable(name, f"`vllm {PRELOAD_SUBCOMMAND}` subcommand to hold the weights", asked=True))
    elif facts.cpu_build:
        levers.append(
            Lever(
                name,
                "refused",
                f"vLLM {version} is its CPU build, and the IPC weight cache maps CUDA memory (CUDA and ROCm only: "
                "check_ipc_platform_support)",
                asked=True,
            )
        )
    else:
        ok, why = preprocessed_support(facts, target.quant_method, target.moe)
        if ok is False:
            levers.append(Lever(name, "refused", why, asked=True))
        else:
            args = () if in_args else ("--load-format", IPC_LOAD_FORMAT)
            note = "" if ok else " (vLLM checks each layer when it loads)"
            levers.append(
                Lever(
                    name,
                    "applied",
                    f"{why}{note}; the node must run `vllm {PRELOAD_SUBCOMMAND}` for this model and parallelism "
                    "before the server starts",
                    args=args,
                    asked=True,
                )
            )

    # vllm snapshot
    name = "snapshot"
    if not startup.snapshot:
        levers.append(Lever(name, "off", "not asked (extraction.startup.snapshot)"))
    elif facts is None or SNAPSHOT_SUBCOMMAND not in facts.subcommands:
        levers.append(unavailable(name, f"`vllm {SNAPSHOT_SUBCOMMAND}` subcommand", asked=True))
    else:
        problems: list[str] = []
        if tensor_parallel_size != 1:
            problems.append(f"tensor parallel size {tensor_parallel_size} (a snapshot holds one rank: TP=1)")
        if kind in ("extraction", "serving"):
            method = "extract_hidden_states" if kind == "extraction" else "eagle3"
            problems.append(f"speculative decoding ({method})")
        reason = (
            f"vLLM {version}'s `vllm snapshot create` refuses " + " and ".join(problems)
            if problems
            else "Eyrie starts its servers with `vllm serve`: a snapshot restore is not wired into it"
        )
        levers.append(Lever(name, "refused", reason, asked=True))
    return Plan(tuple(levers))


def cache_root(environ: dict[str, str]) -> Path:
    """Where vLLM keeps its caches (vllm.envs: VLLM_CACHE_ROOT, else XDG_CACHE_HOME/vllm, else ~/.cache/vllm)."""
    from eyrie.vllm.loading import compile_cache_root

    return compile_cache_root(environ).absolute()


def is_temporary(path: Path) -> bool:
    roots = {*TEMPORARY_ROOTS, tempfile.gettempdir()}
    return any(path == Path(r) or Path(r) in path.parents for r in roots)


def _target_config(target) -> dict:
    """The target's config.json without asking the hub: a local folder's, else the hub cache's copy (preflight
    downloads it); {} when there is none (then no lever that needs the target applies)."""
    import json

    from eyrie.target.metadata import is_local_target

    if is_local_target(target):
        path: Path | str | None = Path(target.model) / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(target.model, "config.json", revision=target.revision)
    if not isinstance(path, (str, Path)):
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def plan_for(config, kind: str, environ: dict[str, str], cfg: dict | None = None) -> Plan:
    """The levers of the `kind` server of `config`, on the installed vLLM; `cfg`: the target's config.json (read
    when not given, from the folder or the hub cache)."""
    x = config.extraction
    return decide(
        installed_facts(),
        target_facts(_target_config(config.target) if cfg is None else cfg),
        x.startup,
        kind=kind,
        tensor_parallel_size=config.target.tensor_parallel_size,
        server_args=list(x.server_args),
        environ={**environ, **x.server_env},
    )
