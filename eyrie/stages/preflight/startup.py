"""Preflight's check of the vLLM start-up levers (`eyrie.vllm.levers`): for each server the run starts, every lever
applied and every lever not applied with the reason, recorded in the report; a lever the operator asked for that
cannot work for this target and this vLLM refused before any load."""

from __future__ import annotations

from eyrie.config import PipelineConfig
from eyrie.vllm.levers import Plan, plan_for


def server_plans(config: PipelineConfig, serve: bool, cfg: dict, environ: dict[str, str]) -> dict[str, Plan]:
    """The levers of each server the run starts: extraction's (it regenerates too) and, when `serve`, export's and
    evaluation's (target plus drafter) and evaluation's baseline (the target alone)."""
    plans = {"extraction": plan_for(config, "extraction", environ, cfg)}
    if serve:
        plans["export/evaluation"] = plan_for(config, "serving", environ, cfg)
        plans["evaluation baseline"] = plan_for(config, "target", environ, cfg)
    return plans


def check_startup_levers(
    config: PipelineConfig, serve: bool, cfg: dict, environ: dict[str, str]
) -> tuple[dict[str, dict], list[str], list[str]]:
    """{server: {lever: {status, reason, asked}}}, the notes (each lever applied, and a compile cache a restart
    loses) and the failures (each lever asked for that cannot work, with the reason; once
    for the servers it concerns alike). Applied variables are checked against the installed vLLM's own registry
    (`vllm.envs`)."""
    from vllm import envs

    plans = server_plans(config, serve, cfg, environ)
    failures: list[str] = []
    applied: dict[str, list[str]] = {}  # "lever (what): reason" -> the servers it is applied to
    lost: dict[str, list[str]] = {}  # a compile cache a restart loses: reason -> servers
    refusals: dict[str, list[str]] = {}  # "lever: reason" -> the servers it refuses
    for label, plan in plans.items():
        for lever in plan.levers:
            if lever.status == "applied":
                applied.setdefault(f"{lever.name} ({_what(lever)}): {lever.reason}", []).append(label)
            elif lever.name == "compile-cache" and lever.status == "not applicable":
                lost.setdefault(lever.reason, []).append(label)
        for lever in plan.refused:
            refusals.setdefault(f"{lever.name} ({lever.status}): {lever.reason}", []).append(label)
        for name in plan.env:
            if name not in envs.environment_variables:
                failures.append(
                    f"the {label} server would be started with {name}, which the installed vLLM does not know (not "
                    "in vllm.envs): Eyrie's reading of its source disagrees with it; set extraction.startup's "
                    "lever off and report it"
                )
    notes = [f"start-up lever for the {_servers(labels)}: {what}" for what, labels in applied.items()]
    # A compile cache a restart loses costs start-up time only, never a result: a note, not a run warning.
    notes += [
        f"start-up lever compile-cache not applied for the {_servers(labels)}: {why}" for why, labels in lost.items()
    ]
    for why, labels in refusals.items():
        servers = _servers(labels)
        failures.append(
            f"extraction.startup asks for a start-up lever the {servers} cannot use: {why}. Fix: set it off "
            "(extraction.startup, or remove --load-format ipc_cache from extraction.server_args)"
        )
    return {label: plan.as_dict() for label, plan in plans.items()}, notes, failures


def _servers(labels: list[str]) -> str:
    return ", ".join(labels) + (" servers" if len(labels) > 1 else " server")


def _what(lever) -> str:
    parts = [*lever.args, *(f"{k}={v}" for k, v in lever.env)]
    return " ".join(parts) or lever.name
