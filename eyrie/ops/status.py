"""`eyrie status`: each stage's and each shard's state, read from the manifests on disk (no Prefect, no vLLM), and
every vLLM server recorded under the run folder: extraction's (and each node's), export's and evaluation's."""

from __future__ import annotations

import time

from eyrie import FORMAT_VERSION, __version__
from eyrie.ops.verify import Listed, shard_files
from eyrie.run.files import read_json
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
        else:
            out["stages"][stage] = _stage_state(run, stage)
    if out.get("format"):
        old = f"format {stamp.get('format_version')}: not reused by this Eyrie"  # type: ignore[union-attr]
        out["stages"] = {stage: old for stage in out["stages"]}
        out["shards"] = {}
    out["server"] = server_status(VllmServer(run.extract))
    # Nodes sharing the run folder (fanned-out extraction) each have their own server.
    out["node_servers"] = {f.name: server_status(VllmServer(f)) for f in server_folders(run.extract)[1:]}
    # Target plus drafter, for export and evaluation: `<stage>/server-*`, keyed by that path in the run folder.
    out["serving_servers"] = {
        f.relative_to(run.root).as_posix(): server_status(VllmServer(f)) for f in serving_server_folders(run.root)
    }
    return out


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
        so_far = phases.summary(phases.phases(_log(server)))
        loading = f"loading for {time.time() - state.get('started_at', time.time()):.0f} s"
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
    return "\n".join(lines)
