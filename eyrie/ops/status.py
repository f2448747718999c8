"""`eyrie status`: each stage's and each shard's state, read from the manifests on disk (no Prefect, no vLLM), and
every vLLM server recorded under the run folder: extraction's (and each node's), export's and evaluation's."""

from __future__ import annotations

import re
import time

from eyrie import FORMAT_VERSION, __version__
from eyrie.ops.verify import Listed, shard_files
from eyrie.run.files import located, read_json
from eyrie.run.folder import STAMP, RunFolder, sample_path, server_folders, serving_server_folders
from eyrie.run.manifest import file_problem, problems
from eyrie.stages import RUN_FOLDER_STAGES
from eyrie.stages.prepare import load_shards
from eyrie.stages.regenerate import extraction_source
from eyrie.stages.regenerate import stage_status as regenerate_progress
from eyrie.vllm import phases
from eyrie.vllm.process import VllmServer


def run_status(run: RunFolder) -> dict:
    """Each stage's and shard's state. A manifest counts only with the files it lists: each is stat'ed (present,
    and of its recorded size where the manifest records one); nothing is read or hashed (`eyrie verify` does)."""
    out: dict = {"run_dir": str(run.root), "stages": {}, "shards": {}}
    stamp = read_json(run.root / STAMP)
    if isinstance(stamp, dict) and stamp.get("format_version") != FORMAT_VERSION:
        # Its manifests hold keys of another recipe: none is reused by this Eyrie, and none is reported as done.
        out["format"] = (
            f"made by Eyrie {stamp.get('eyrie_version')} (format {stamp.get('format_version')}); this Eyrie "
            f"{__version__} reads format {FORMAT_VERSION} and will not run on it: use a new --run-dir, or the "
            "Eyrie version that made it"
        )
    shards = load_shards(extraction_source(run))  # the regenerated data's, when that is what was extracted
    online = (read_json(run.root / "preflight.json") or {}).get("hidden_states") == "online"
    for stage in RUN_FOLDER_STAGES:
        if stage == "extract" and online:
            out["stages"][stage] = "not used (train.hidden_states: online: the trainer asks the extraction server)"
        elif stage == "extract":
            done = damaged = 0
            for s in shards:
                path = run.shard_manifests / f"{s.name}.json"
                m = read_json(path)
                if m:
                    listed = shard_files(run, path, m)
                    bad = _stat_problems(listed)
                    if bad:
                        damaged += 1
                        out["shards"][s.name] = (
                            f"damaged: {len(bad)} of {len(listed)} listed files missing or of another size "
                            f"({bad[0]}); the next run extracts them again"
                        )
                    else:
                        done += 1
                        out["shards"][s.name] = "done"
                    continue
                # Packed storage too: a shard's samples are files until its pack and manifest are written.
                partial = sum(sample_path(run.hidden_states, i).exists() for i in range(s.start, s.stop))
                out["shards"][s.name] = f"partial {partial}/{s.stop - s.start}" if partial else "pending"
            out["stages"][stage] = (
                "not started"
                if not shards
                else "done"
                if done == len(shards)
                else f"{done}/{len(shards)} shards" + (f" ({damaged} damaged)" if damaged else "")
            )
        elif stage == "regenerate" and not read_json(run.manifest(stage)):
            out["stages"][stage] = regenerate_progress(run)
        elif stage == "train" and not read_json(run.manifest(stage)):
            out["stages"][stage] = train_status(run)
        else:
            out["stages"][stage] = _stage_state(run, stage)
    if out.get("format"):
        old = f"format {stamp.get('format_version')}: not reused by this Eyrie"  # type: ignore[union-attr]
        out["stages"] = {stage: old for stage in out["stages"]}
        out["shards"] = {}
    out["server"] = server_status(VllmServer(run.extract))
    _waiting_for_server(run, out)
    # Nodes sharing the run folder (fanned-out extraction) each have their own server.
    out["node_servers"] = {f.name: server_status(VllmServer(f)) for f in server_folders(run.extract)[1:]}
    # Target plus drafter, for export and evaluation: `<stage>/server-*`, keyed by that path in the run folder.
    out["serving_servers"] = {
        f.relative_to(run.root).as_posix(): server_status(VllmServer(f)) for f in serving_server_folders(run.root)
    }
    out["times"] = stage_times(run)
    out["headline"] = headline(run) if out["stages"].get("evaluate") == "done" else None
    return out


def train_status(run: RunFolder) -> str:
    """The train stage before its manifest: the newest training under `train/` (by its trainer's record, metrics
    and checkpoints), whether its trainer runs, its epoch, step and loss, and its last whole checkpoint
    (eyrie/stages/train/progress.py)."""
    from eyrie.stages.train.progress import METRICS, TRAINER, describe

    def seen(work) -> float:
        times = [p.stat().st_mtime for p in (work / TRAINER, work / METRICS, work / "checkpoints") if p.exists()]
        return max(times, default=0.0)

    stage = run.stage("train")
    works = [w for w in stage.iterdir() if w.is_dir() and seen(w)] if stage.is_dir() else []
    if not works:
        return "not started"
    return describe(max(works, key=seen))


# The phases a start goes through, in order (eyrie/vllm/phases.py): the first one not measured yet is the one a
# server still starting is in.
LOADING = ("imports", "engine start", "weights", "engine init", "API server")


def loading_phase(measured: dict[str, float]) -> str:
    return next((p for p in LOADING if p not in measured), "API server")


def _waiting_for_server(run: RunFolder, out: dict) -> None:
    """A stage that has not started because the extraction server it needs is loading says so: regeneration's
    (when its folder exists) or else extraction's, the first of them not done."""
    server = out["server"]
    if server.startswith("starting"):
        phase = re.search(r"now in ([a-zA-Z ]+?)(?: \(|$)", server)
        waiting = "waiting for the extraction server, loading" + (f" ({phase.group(1)})" if phase else "")
    elif server.startswith("running"):
        waiting = "starting: the extraction server is up, no shard finished yet"
    else:
        return
    for stage in ("regenerate", "extract"):
        state = out["stages"].get(stage)
        if stage == "regenerate" and not run.stage(stage).is_dir():
            continue
        if state == "not started":
            out["stages"][stage] = waiting
        if state != "done":
            return


def _shard_seconds(folder) -> tuple[int, float]:
    n, seconds = 0, 0.0
    for path in folder.glob("*.json") if folder.is_dir() else ():
        m = read_json(path)
        if isinstance(m, dict) and isinstance(m.get("seconds"), (int, float)):
            n, seconds = n + 1, seconds + m["seconds"]
    return n, seconds


def stage_times(run: RunFolder) -> dict[str, str]:
    """Time per stage, where the run folder records it, in the stages' order: a stage's own seconds in its manifest
    (the last time it ran), the shards' own seconds (extraction's and regeneration's, summed over shards, so workers
    in parallel add up), and the trainer's time since its launch."""
    from eyrie.stages.train.progress import TRAINER, trainer_running

    out = {}
    for stage in RUN_FOLDER_STAGES:
        seconds = (read_json(run.manifest(stage)) or {}).get("seconds")
        if isinstance(seconds, (int, float)):
            out[stage] = _duration(seconds)
    for stage, folder in (("regenerate", run.stage("regenerate") / "shards"), ("extract", run.shard_manifests)):
        n, seconds = _shard_seconds(folder)
        if n:
            out[stage] = f"{_duration(seconds)} of shard work over {n} shards"
    train = run.stage("train")
    for work in sorted(train.iterdir()) if train.is_dir() else []:
        plan = read_json(work / TRAINER)
        if isinstance(plan, dict) and isinstance(plan.get("started_at"), (int, float)):
            if trainer_running(work):
                out["train"] = f"{_duration(time.time() - plan['started_at'])} since the trainer's launch"
            elif isinstance(plan.get("seconds"), (int, float)):
                out["train"] = f"{_duration(plan['seconds'])} (the last launch)"
    return {stage: out[stage] for stage in RUN_FOLDER_STAGES if stage in out}


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.0f} s"
        if seconds < 120
        else f"{seconds / 60:.0f} min"
        if seconds < 7200
        else f"{seconds / 3600:.1f} h"
    )


def headline(run: RunFolder) -> str | None:
    """A finished run's outcome: the trained drafter's acceptance length beside its baselines', the drafter's path,
    and every warning the run raised (as the run summary lists them; from `finished.json` when `eyrie run` recorded
    it, else from the stages' manifests)."""
    record = read_json(run.root / "finished.json") or {}
    outputs = record.get("outputs")
    if isinstance(outputs, dict):  # paths under the folder kept relative to it (flows/finished.py)
        outputs = {k: located(v, run.root) if k in (record.get("relative") or []) else v for k, v in outputs.items()}
    else:
        evaluate, export, train = (read_json(run.manifest(s)) or {} for s in ("evaluate", "export", "train"))
        results = evaluate.get("results") or {}
        if "trained" not in results:
            return None
        outputs = {
            "acceptance_length": results["trained"].get("acceptance_length"),
            **{f"{k}_acceptance_length": r.get("acceptance_length") for k, r in results.items() if k != "trained"},
            "drafter": located(export.get("drafter"), run.export),
            "warnings": [*train.get("warnings", []), *evaluate.get("warnings", [])],
        }
    others = [
        f"{k.removesuffix('_acceptance_length')} {v:.2f}"
        for k, v in outputs.items()
        if k.endswith("_acceptance_length") and isinstance(v, (int, float))
    ]
    accepted = outputs.get("acceptance_length")
    line = f"acceptance length {accepted:.2f}" if isinstance(accepted, (int, float)) else "acceptance length unknown"
    line += f" ({', '.join(others)})" if others else ""
    line += f"; drafter {outputs.get('drafter')}"
    promotion = outputs.get("promotion")
    if isinstance(promotion, dict) and promotion.get("promoted"):
        line += f"; promoted to {promotion.get('current')}"
    warnings = outputs.get("warnings") or []
    line += f"; {len(warnings)} warning(s)" if warnings else "; no warnings"
    return "\n".join([line, *(f"  warning: {w}" for w in warnings)])


def _stat_problems(listed: list[Listed]) -> list[str]:
    return [f"{item.path.name} {problem}" for item in listed if (problem := file_problem(item.path, item.size))]


def _stage_state(run: RunFolder, stage: str) -> str:
    m = read_json(run.manifest(stage))
    if not m:
        return "not started"
    bad = problems(run.stage(stage), m)
    if not bad:
        return "done"
    return (
        f"damaged: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; `eyrie verify --run-dir {run.root}` "
        "removes its manifest, so the next run redoes the stage"
    )


def _log(server: VllmServer) -> str:
    try:
        return server.log_path.read_text(errors="replace")
    except OSError:
        return ""


def server_status(server: VllmServer) -> str:
    """One line on the server recorded in a folder. A recorded pid that is now another process (reused, or from
    before a reboot) is "not running"; a server that never answered yet is "starting"; one that answered before
    counts as not answering only after several failed probes."""
    state = server.state
    if not state:
        return "not running"
    if not server.local(state):
        return f"recorded on host {state['hostname']} (pid {state['pid']}): ask `eyrie status` there"
    if not server.owns(state):
        orphans = server.orphans(state)
        if orphans:
            return (
                f"not running, but {len(orphans)} process(es) of its group outlived it (pids "
                f"{', '.join(map(str, orphans[:8]))}): `eyrie stop-server` ends them"
            )
        return "not running"
    pid, url = state["pid"], server.url(state)
    if not state.get("ready_at"):
        if server.probe(state):
            return f"running pid {pid} at {url}"
        measured = phases.phases(_log(server))
        so_far = phases.summary(measured)
        loading = (
            f"loading for {time.time() - state.get('started_at', time.time()):.0f} s, now in {loading_phase(measured)}"
        )
        return f"starting: pid {pid}, {loading}" + (f" ({so_far} so far)" if so_far else "")
    if server.healthy(state):
        measured = state.get("phases") or phases.phases(_log(server), state["ready_at"])
        where = phases.summary(measured)  # empty when the log names no phase (not vLLM's, or worded otherwise)
        started = f"; started in {measured['total']:.0f} s: {where}" if where and "total" in measured else ""
        started = started or (f"; {where}" if where else "")
        if started and not phases.first_answer_recorded(state):  # recorded by Eyrie's client when it comes
            started += f"; no request answered in the {time.time() - state['ready_at']:.0f} s since it became ready"
        return f"running pid {pid} at {url}{started}"
    return f"not answering: pid {pid} is alive but {url}/health failed repeatedly"


def format_status(status: dict) -> str:
    lines = [f"run folder: {status['run_dir']}"]
    if status.get("format"):
        lines.append(f"  {status['format']}")
    lines += [f"  {stage:<10} {state}" for stage, state in status["stages"].items()]
    if status["shards"]:
        lines.append("shards:")
        lines += [f"  {name}  {state}" for name, state in status["shards"].items()]
    lines.append(f"extraction server: {status['server']}")
    lines += [f"extraction server of node {node}: {state}" for node, state in status.get("node_servers", {}).items()]
    lines += [f"serving server {where}: {state}" for where, state in status.get("serving_servers", {}).items()]
    if status.get("times"):
        lines.append("time per stage:")
        lines += [f"  {stage:<10} {t}" for stage, t in status["times"].items()]
    if status.get("headline"):
        lines.append(f"result: {status['headline']}")
    return "\n".join(lines)
