"""`eyrie status`: each stage's and each shard's state, read from the manifests on disk (no Prefect, no vLLM), and
every vLLM server recorded under the run folder: extraction's (and each node's), export's and evaluation's."""

from __future__ import annotations

import time

from eyrie.prepare import load_shards
from eyrie.server import VllmServer, server_folders, serving_server_folders
from eyrie.stages import RUN_FOLDER_STAGES
from eyrie.store import RunFolder, read_json


def run_status(run: RunFolder) -> dict:
    out: dict = {"run_dir": str(run.root), "stages": {}, "shards": {}}
    shards = load_shards(run.prepare)
    for stage in RUN_FOLDER_STAGES:
        if stage == "extract":
            done = 0
            for s in shards:
                if read_json(run.shard_manifests / f"{s.name}.json"):
                    done += 1
                    out["shards"][s.name] = "done"
                    continue
                partial = sum((run.hidden_states / f"hs_{i}.safetensors").exists() for i in range(s.start, s.stop))
                out["shards"][s.name] = f"partial {partial}/{s.stop - s.start}" if partial else "pending"
            out["stages"][stage] = (
                "not started" if not shards else "done" if done == len(shards) else f"{done}/{len(shards)} shards"
            )
        else:
            out["stages"][stage] = "done" if read_json(run.manifest(stage)) else "not started"
    out["server"] = server_status(VllmServer(run.extract))
    # Nodes sharing the run folder (fanned-out extraction) each have their own server.
    out["node_servers"] = {f.name: server_status(VllmServer(f)) for f in server_folders(run.extract)[1:]}
    # Target plus drafter, for export and evaluation: `<stage>/server-*`, keyed by that path in the run folder.
    out["serving_servers"] = {
        f.relative_to(run.root).as_posix(): server_status(VllmServer(f)) for f in serving_server_folders(run.root)
    }
    return out


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
        return f"starting: pid {pid}, loading for {time.time() - state.get('started_at', time.time()):.0f} s"
    if server.healthy(state):
        return f"running pid {pid} at {url}"
    return f"not answering: pid {pid} is alive but {url}/health failed repeatedly"


def format_status(status: dict) -> str:
    lines = [f"run folder: {status['run_dir']}"]
    lines += [f"  {stage:<9} {state}" for stage, state in status["stages"].items()]
    if status["shards"]:
        lines.append("shards:")
        lines += [f"  {name}  {state}" for name, state in status["shards"].items()]
    lines.append(f"extraction server: {status['server']}")
    lines += [f"extraction server of node {node}: {state}" for node, state in status.get("node_servers", {}).items()]
    lines += [f"serving server {where}: {state}" for where, state in status.get("serving_servers", {}).items()]
    return "\n".join(lines)
