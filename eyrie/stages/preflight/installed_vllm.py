"""Preflight's checks of the installed vLLM against what the config asks of it: its version, its server's
arguments (parsed by its own `vllm serve` parser), its environment variables."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib
import inspect
import io
import json
import os
import re
from dataclasses import replace

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from eyrie.config import PipelineConfig

# Where `vllm serve`'s parser factory lives, newest first (0.32 moved it from openai/ to launchers/).
# Where `make_arg_parser` lives, by vLLM version (0.33 moved it to vllm.entrypoints.common).
SERVE_PARSER_MODULES = (
    "vllm.entrypoints.launchers.cli_args",
    "vllm.entrypoints.openai.cli_args",
    "vllm.entrypoints.common.cli_args",
)
PLACEHOLDER_PORT = 8000  # parsing needs a port; the server gets a free one


class ServerArgumentError(Exception):
    """vLLM's server parser refused an argument (argparse would print its usage and exit)."""


@functools.lru_cache(maxsize=1)
def serve_parser():
    """The installed vLLM's own `vllm serve` parser, built in-process (no engine, no model; 0.3 s after preflight's
    other imports), raising instead of exiting; None when this vLLM keeps its factory in none of
    SERVE_PARSER_MODULES."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before the utils package split
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]
    for name in SERVE_PARSER_MODULES:
        try:
            make_arg_parser = importlib.import_module(name).make_arg_parser
        except (ImportError, AttributeError):
            continue

        class Parser(FlexibleArgumentParser):
            def error(self, message):
                raise ServerArgumentError(message)

        return make_arg_parser(Parser())
    return None


def parse_server_arguments(args: list[str]) -> argparse.Namespace:
    """`args` as the installed vLLM's server parses them; ServerArgumentError names what it refuses."""
    parser = serve_parser()
    assert parser is not None, "check serve_parser() first"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(list(args))
    except SystemExit:  # --help or --version print and exit
        raise ServerArgumentError("the parser exits (is --help or --version among the arguments?)") from None
    except (ValueError, TypeError) as err:  # vLLM's own checks while it rewrites the arguments
        raise ServerArgumentError(str(err)) from None


# What a server argument Eyrie passes itself is set from (by vLLM's name for it); anything else: Eyrie's own wiring.
EYRIE_SETS = {
    "model": "target.model",
    "revision": "target.revision",
    "trust_remote_code": "target.trust_remote_code",
    "tensor_parallel_size": "target.tensor_parallel_size",
    "dtype": "target.dtype",
    "max_model_len": "target.max_model_len",
    "host": "extraction.host",
    "port": "extraction.port",
    "enforce_eager": "extraction.enforce_eager",
    "gpu_memory_utilization": "extraction.gpu_memory_utilization",
    "speculative_config": "extraction.layer_ids and evaluate.num_speculative_tokens",
}


def _dests(args: list[str]) -> dict[str, str]:
    """vLLM's name (argparse dest) for each flag in `args` -> the flag as written (`--a.b` is part of `--a`)."""
    actions = serve_parser()._option_string_actions
    out = {}
    for arg in args:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            action = actions.get(flag.split(".", 1)[0].replace("_", "-"))
            if action is not None:
                out[action.dest] = flag
    return out


def _blame(message: str, server_args: list[str]) -> list[str]:
    """The flags of `server_args` that vLLM's message names (vLLM spells names with dashes)."""
    flags = [a.split("=", 1)[0] for a in server_args if a.startswith("--")]
    return [f for f in flags if re.search(re.escape(f.replace("_", "-")) + r"(?![\w-])", message)]


def check_server_arguments(config: PipelineConfig, captured: list[int], serve: bool) -> tuple[list[str], list[str]]:
    """Every argument Eyrie would start vLLM with (its own and extraction.server_args), parsed by the installed
    vLLM's own parser: for the extraction server and, when `serve`, the target-plus-drafter one. Failures, warnings.
    The whole config: it builds the servers' specs (`eyrie.vllm.spec.ServerSpec.for_extraction`/`for_serving`),
    which read the fields `eyrie.run.identity`'s server declarations name across sections."""
    import vllm

    from eyrie.vllm.spec import ServerSpec

    if serve_parser() is None:  # a vLLM that moved its parser again: say so rather than guess
        modules = " or ".join(SERVE_PARSER_MODULES)
        return [], [
            f"the server arguments were not checked: vLLM {vllm.__version__} has no make_arg_parser in {modules}"
        ]
    specs: dict[str, ServerSpec] = {"extraction": ServerSpec.for_extraction(config, captured, "<staging>")}
    if serve:
        specs["export/evaluation"] = ServerSpec.for_serving(config, "<drafter>")
    failures = []
    # vLLM takes the later of two values, and Eyrie's checks and clients assume its own: one owner per setting.
    own = set(EYRIE_SETS).union(
        *(_dests(replace(s, server_args=[]).arguments(PLACEHOLDER_PORT)) for s in specs.values())
    )
    for dest, flag in _dests(config.extraction.server_args).items():
        if dest in EYRIE_SETS:
            failures.append(
                f"extraction.server_args sets {flag}, which Eyrie passes to vLLM from {EYRIE_SETS[dest]}: set "
                f"{EYRIE_SETS[dest]} instead and remove {flag} from server_args"
            )
        elif dest in own:
            failures.append(
                f"extraction.server_args sets {flag}, which Eyrie passes to vLLM itself for its own wiring (its "
                f"hidden-states connector, its client): remove {flag} from server_args"
            )
    refused: dict[str, list[str]] = {}  # vLLM's message -> the servers it refuses
    parsed = {}
    for label, spec in specs.items():
        try:
            parsed[label] = parse_server_arguments(spec.arguments(spec.port or PLACEHOLDER_PORT))
        except ServerArgumentError as err:
            refused.setdefault(str(err)[:400], []).append(label)
    for message, labels in refused.items():
        servers = " and ".join(labels) + (" servers" if len(labels) > 1 else " server")
        where = f"vLLM {vllm.__version__} refuses the arguments of the {servers}: {message}"
        flags = _blame(message, config.extraction.server_args)
        if flags:
            failures.append(
                f"{where}. {', '.join(flags)} in extraction.server_args: check the spelling against this vLLM "
                "(`python -m vllm.entrypoints.openai.api_server --help=<word>`), or install a vLLM that has it "
                "(flags are renamed between versions; target.vllm_version states the versions a preset needs)"
            )
        else:
            failures.append(
                f"{where}. Eyrie builds this argument from the config: check the setting behind it, and the "
                "installed vLLM against the versions pyproject's `cpu`/`gpu` extras pin (a flag may be missing)"
            )
    warnings = []
    seqs = getattr(parsed.get("extraction"), "max_num_seqs", None)
    if seqs and config.extraction.concurrency > seqs:
        warnings.append(
            f"extraction.concurrency {config.extraction.concurrency} is above the server's --max-num-seqs {seqs}: "
            f"the requests beyond it wait in vLLM's queue, their wait counted against request_timeout_s; set "
            f"extraction.concurrency to {seqs}"
        )
    # Regeneration sends its requests to the same server (the extraction server generates too).
    if seqs and config.regenerate.enabled and config.regenerate.concurrency > seqs:
        warnings.append(
            f"regenerate.concurrency {config.regenerate.concurrency} is above the extraction server's "
            f"--max-num-seqs {seqs}, which regeneration generates on: the requests beyond it wait in vLLM's queue, "
            f"their wait counted against regenerate.request_timeout_s; set regenerate.concurrency to {seqs}"
        )
    return failures, warnings


def check_server_env(env: dict[str, str]) -> list[str]:
    """Every VLLM_* variable in extraction.server_env must be one the installed vLLM reads (its `vllm.envs`
    registry; vLLM itself only warns, 'Unknown vLLM environment variable', and ignores it), with a value it can
    read. Other names (NCCL_*, HF_*, ...) are other libraries' and pass."""
    import vllm
    from vllm import envs

    known = envs.environment_variables
    failures = []
    for name, value in env.items():
        if not name.startswith("VLLM_"):
            continue
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            failures.append(
                f"extraction.server_env sets {name}, which vLLM {vllm.__version__} does not know (not in "
                "vllm.envs): vLLM would ignore it. "
                + (f"Did you mean {close[0]}? " if close else "")
                + "Fix the name, or install a vLLM that has it"
            )
            continue
        saved = os.environ.get(name)
        os.environ[name] = value  # the registry's readers read os.environ: int(...), a choice check, ...
        try:
            known[name]()
        except Exception as err:
            failures.append(
                f"extraction.server_env {name}={value!r}: vLLM {vllm.__version__} cannot read this value "
                f"({type(err).__name__}: {err}): see its definition in vllm/envs.py"
            )
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved
    return failures


def check_vllm_version(required: str | None, installed: str) -> list[str]:
    """target.vllm_version (a PEP 440 specifier) against the installed vLLM."""
    if not required:
        return []
    try:
        ok = SpecifierSet(required).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        return [
            f"target.vllm_version asks for vLLM {required}, and the installed vLLM's version {installed!r} cannot "
            "be compared with it: install a released vLLM"
        ]
    if ok:
        return []
    return [
        f"target.vllm_version asks for vLLM {required}, and vLLM {installed} is installed: install a vLLM that "
        "meets it (pyproject's `gpu` and `cpu` extras pin the tested ones)"
    ]


# ---------------------------------------------------------------------------------------------------------------
# The model runner each server will use

# vLLM's runner switch, read up to 0.33 (0.34 has no V1 runner and no switch).
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


class _Facts:
    """What vLLM's runner rule reads of one config section, before any load: the facts given (from config.json and
    the server's parsed arguments, vLLM's own names), else the parsed argument of that name. Anything else raises
    AttributeError naming it, so a rule that reads more than preflight can know says so instead of guessing."""

    def __init__(self, section: str, facts: dict, parsed: argparse.Namespace | None = None):
        self._section, self._facts, self._parsed = section, facts, parsed

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._facts:
            return self._facts[name]
        if self._parsed is not None and hasattr(self._parsed, name):
            return getattr(self._parsed, name)
        raise AttributeError(f"{self._section}.{name}")


class _ConfigView:
    """A stand-in for vLLM's VllmConfig on which its own `use_v2_model_runner` rule runs: the sections given as
    `_Facts`; the rule's helper methods and properties taken from the installed VllmConfig itself; a setting the
    server's arguments name (`--ec-transfer-config`) as parsed; any other section (`cache_config`, ...) read from the
    parsed arguments of the same names (vLLM's engine arguments are its config fields)."""

    def __init__(self, sections: dict, parsed: argparse.Namespace):
        self.__dict__.update(sections)
        self._parsed = parsed

    def __getattr__(self, name: str):
        from vllm.config import VllmConfig

        if name.startswith("__"):
            raise AttributeError(name)
        member = inspect.getattr_static(VllmConfig, name, None)
        if isinstance(member, property) and member.fget is not None:
            return member.fget(self)
        if inspect.isfunction(member):
            return member.__get__(self, _ConfigView)
        if hasattr(self._parsed, name):
            return getattr(self._parsed, name)
        if name.endswith("_config"):
            return _Facts(name, {}, self._parsed)
        raise AttributeError(f"VllmConfig.{name}")


def _text_facts(cfg: dict) -> dict:
    from eyrie.target.metadata import text_config

    text = text_config(cfg)
    experts = next((text.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts") if text.get(k)), 0)
    return {"is_moe": bool(experts), "use_mla": bool(text.get("kv_lora_rank"))}


def server_model_runner(parsed: argparse.Namespace, cfg: dict, env: dict[str, str]) -> tuple[str, str]:
    """The model runner ("V1", "V2" or "unknown") a server started with `parsed` arguments and `env` would use for the
    target of config.json `cfg`, decided by the installed vLLM's own rule (`VllmConfig.use_v2_model_runner`) on what
    preflight knows before any load, and why. A vLLM without the rule has one runner (`runner_without_rule`): V1
    before V2 was selectable, V2 once V1 is gone (0.34); neither the rule nor the reasons a server stays on V1 are
    asked of it."""
    from vllm.config import VllmConfig

    rule = inspect.getattr_static(VllmConfig, "use_v2_model_runner", None)
    if not isinstance(rule, property) or rule.fget is None:
        return runner_without_rule(_version(), has_v1_runner(), env)
    from vllm.config import vllm as vllm_config_module
    from vllm.model_executor.models.registry import _ModelInfo

    from eyrie.stages.preflight.target import resolve_vllm_class

    archs = cfg.get("architectures") or []
    cls = resolve_vllm_class(archs[0]) if archs else None
    info = _ModelInfo.from_model_cls(cls) if cls is not None else None
    spec = json.loads(parsed.speculative_config) if isinstance(parsed.speculative_config, str) else None
    spec = spec if spec is not None else (parsed.speculative_config or None)
    model = {
        "runner_type": "generate",
        "architectures": archs,
        "is_hybrid": bool(info and info.is_hybrid),
        "is_attention_free": bool(info and info.is_attention_free),
        "is_diffusion": False,
        **_text_facts(cfg),
    }
    spec_facts = None
    if spec:
        method = spec.get("method")
        spec_facts = _Facts(
            "speculative_config",
            {
                "method": method,
                "parallel_drafting": bool(spec.get("parallel_drafting", False)),
                "use_heterogeneous_vocab": False,
                "enable_adaptive_verification": bool(spec.get("enable_adaptive_verification", False)),
                "draft_model_config": None,
                "use_dspark": lambda: method == "dspark",
            },
        )
    view = _ConfigView(
        {
            "model_config": _Facts("model_config", model, parsed),
            "speculative_config": spec_facts,
            "parallel_config": _Facts(
                "parallel_config", {"use_ubatching": bool(getattr(parsed, "enable_dbo", False))}, parsed
            ),
            "compilation_config": _Facts(
                "compilation_config", {"mode": None, "pass_config": _Facts("pass_config", {"enable_sp": False})}
            ),
            "attention_config": _Facts("attention_config", {"hisparse_config": None}),
            "scheduler_config": _Facts("scheduler_config", {}, parsed),
            "watermark_config": None,
        },
        parsed,
    )
    saved = os.environ.get(RUNNER_ENV)
    if RUNNER_ENV in env:
        os.environ[RUNNER_ENV] = env[RUNNER_ENV]
    else:
        os.environ.pop(RUNNER_ENV, None)
    try:
        v2 = bool(rule.fget(view))
        if RUNNER_ENV in env:
            why = f"{RUNNER_ENV}={env[RUNNER_ENV]} in the server's environment"
        elif not getattr(vllm_config_module, "HAS_TRITON", True):
            why = "this vLLM has no Triton (its CPU build), and Model Runner V2 needs it"
        else:
            unsupported = view._get_v2_model_runner_unsupported_features() if not v2 else []
            why = (
                "vLLM's default for this target and these flags"
                if v2 or not unsupported
                else f"Model Runner V2 does not support {', '.join(unsupported)}"
            )
            if not v2 and not unsupported:
                why = "vLLM keeps this target on V1 (not one of its default-V2 models: MoE, hybrid or non-generating)"
        return ("V2" if v2 else "V1"), why
    except AttributeError as err:
        return "unknown", f"vLLM {_version()}'s runner rule reads {err}, which preflight cannot know before the load"
    finally:
        if saved is None:
            os.environ.pop(RUNNER_ENV, None)
        else:
            os.environ[RUNNER_ENV] = saved


# V1's runner module: 0.34 removed it with Model Runner V1, leaving V2 the only runner.
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def has_v1_runner() -> bool:
    """Whether the installed vLLM has Model Runner V1's module (looked up, not imported: it pulls in the runner)."""
    import importlib.util

    try:
        return importlib.util.find_spec(V1_RUNNER_MODULE) is not None
    except ModuleNotFoundError:  # a parent package is missing too
        return False


def runner_without_rule(version: str, v1_runner: bool, env: dict[str, str]) -> tuple[str, str]:
    """The runner of a vLLM without a V2 selection rule, and why: one that still has V1's runner predates V2's
    selection (V1); one without it has only Model Runner V2 (0.34 on), whatever RUNNER_ENV says, which it no longer
    reads."""
    if v1_runner:
        return "V1", f"vLLM {version} has no Model Runner V2 rule (VllmConfig.use_v2_model_runner)"
    why = f"vLLM {version} has no V1 runner ({V1_RUNNER_MODULE} is gone): Model Runner V2 is its only one"
    if RUNNER_ENV in env:
        why += f"; {RUNNER_ENV}={env[RUNNER_ENV]} in the server's environment " + (
            "is redundant" if env[RUNNER_ENV] == "1" else "makes it refuse to start"
        )
    return "V2", why


def runner_switch_refusal(v1_runner: bool, env: dict[str, str]) -> str | None:
    """Why a vLLM without V1 would refuse to start a server with `env`, or None: 0.34 raises at its config for any
    RUNNER_ENV but 1 ('no longer supported: Model Runner V1 has been removed', `Platform.validate_environ`)."""
    if v1_runner or RUNNER_ENV not in env or env[RUNNER_ENV] == "1":
        return None
    return (
        f"{RUNNER_ENV}={env[RUNNER_ENV]} is set for it, and vLLM {_version()} has no Model Runner V1: it refuses to "
        f"start with that variable set to anything but 1. Unset {RUNNER_ENV} (extraction.server_env, or the "
        "environment the flow runs in)"
    )


def _version() -> str:
    import vllm

    return vllm.__version__


def check_model_runners(
    config: PipelineConfig, captured: list[int], serve: bool, cfg: dict, eagle3_path: str
) -> tuple[dict[str, dict], list[str]]:
    """Each server's model runner by the installed vLLM's rule ({label: {"runner", "why"}}), and the failures: a
    target on Eyrie's compatibility layer whose runner's hook this vLLM lacks (`compat.missing_hooks`), refused
    before any load instead of failing after it with 'Model does not support EAGLE3 interface'; and a server whose
    environment asks a vLLM without V1 for V1 (`runner_switch_refusal`), which that vLLM refuses at start."""
    from eyrie.vllm.plugin.compat import HOOKS, missing_hooks
    from eyrie.vllm.spec import ServerSpec

    specs: dict[str, ServerSpec] = {"extraction": ServerSpec.for_extraction(config, captured, "<staging>")}
    if serve:
        specs["export/evaluation"] = ServerSpec.for_serving(config, "<drafter>")
    runners: dict[str, dict] = {}
    failures = []
    for label, spec in specs.items():
        try:
            parsed = parse_server_arguments(spec.arguments(spec.port or PLACEHOLDER_PORT))
        except (ServerArgumentError, AssertionError):
            continue  # check_server_arguments reports it
        env = {**os.environ, **spec.server_env}
        runner, why = server_model_runner(parsed, cfg, env)
        runners[label] = {"runner": runner, "why": why}
        if runner == "V2" and (refusal := runner_switch_refusal(has_v1_runner(), env)):
            failures.append(f"the {label} server would not start: {refusal}")
        if eagle3_path != "compat":
            continue
        asked = set(HOOKS) if runner == "unknown" else {runner}
        for r, reason in missing_hooks(asked).items():
            failures.append(
                f"the {label} server would run on model runner {r} ({why}), and {reason}: vLLM would load the "
                "target and then fail with 'Model does not support EAGLE3 interface'. Fix: a vLLM whose class "
                f"implements SupportsEagle3, or one Eyrie's compatibility layer supports on {r}"
            )
    return runners, failures
