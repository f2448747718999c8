"""`eyrie status`: each stage's and each shard's state, read from the manifests on disk (no Prefect, no vLLM)."""

from __future__ import annotations

from eyrie.prepare import load_shards
from eyrie.server import ExtractionServer, server_folders
from eyrie.store import RunFolder, read_json

STAGES = ("prepare", "extract", "vocab", "train", "export", "evaluate")


def run_status(run: RunFolder) -> dict:
    out: dict = {"run_dir": str(run.root), "stages": {}, "shards": {}}
    shards = load_shards(run.prepare)
    for stage in STAGES:
        if stage == "extract":
            done = 0
            for s in shards:
                if read_json(run.shard_manifests / f"{s.name}.json"):
                    done += 1
                    out["shards"][s.name] = "done"
                    continue
                partial = sum((run.hidden_states / f"hs_{i}.safetensors").exists() for i in range(s.start, s.stop))
                out["shards"][s.name] = f"partial {partial}/{s.stop - s.start}" if partial else "pending"
            out["stages"][stage] = ("not started" if not shards else
                                    "done" if done == len(shards) else f"{done}/{len(shards)} shards")
        else:
            out["stages"][stage] = "done" if read_json(run.manifest(stage)) else "not started"
    out["server"] = _server_status(ExtractionServer(run.extract))
    # Nodes sharing the run folder (fanned-out extraction) each have their own server.
    out["node_servers"] = {f.name: _server_status(ExtractionServer(f)) for f in server_folders(run.extract)[1:]}
    return out


def _server_status(server: ExtractionServer) -> str:
    state = server.state
    if state and not server.local(state):
        return f"recorded on host {state['hostname']} (pid {state['pid']}): ask `eyrie status` there"
    return f"running pid {state['pid']} at {server.url(state)}" if state and server.healthy(state) else "not running"


def format_status(status: dict) -> str:
    lines = [f"run folder: {status['run_dir']}"]
    lines += [f"  {stage:<9} {state}" for stage, state in status["stages"].items()]
    if status["shards"]:
        lines.append("shards:")
        lines += [f"  {name}  {state}" for name, state in status["shards"].items()]
    lines.append(f"extraction server: {status['server']}")
    lines += [f"extraction server of node {node}: {state}" for node, state in status.get("node_servers", {}).items()]
    return "\n".join(lines)
