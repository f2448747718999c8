"""Several nodes on one run folder, without a server: node folders, the shard split, and a server recorded by another
host, which must never be signalled from here (its pid means nothing on this host). The real thing runs in
tests/e2e/test_production.py."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import REPO

from eyrie.errors import ExtractionError
from eyrie.ops.status import format_status, run_status
from eyrie.run.files import atomic_write_json
from eyrie.run.folder import RunFolder, node_name, server_folder, server_folders
from eyrie.vllm.process import VllmServer


def test_node_name_and_folders(tmp_path, monkeypatch):
    monkeypatch.delenv("EYRIE_NODE_NAME", raising=False)
    assert node_name() is None and node_name("host-a") == "host-a"
    monkeypatch.setenv("EYRIE_NODE_NAME", "gpu-node-2")
    assert node_name("host-a") == "gpu-node-2"
    for bad in ("../x", "a/b", ".hidden", "a b"):
        monkeypatch.setenv("EYRIE_NODE_NAME", bad)
        with pytest.raises(ExtractionError, match="node name"):
            node_name()
    extract = tmp_path / "extract"
    assert server_folder(extract, None) == extract
    assert server_folder(extract, "n1") == extract / "nodes" / "n1"
    assert server_folders(extract) == [extract]
    (extract / "nodes" / "n2").mkdir(parents=True)
    (extract / "nodes" / "n1").mkdir()
    assert server_folders(extract) == [extract, extract / "nodes" / "n1", extract / "nodes" / "n2"]


def test_split_shards_is_balanced_and_complete():
    from flows.fanout import split_shards

    names = [f"shard-{i:05d}" for i in range(5)]
    shares = split_shards(names, ["q1", "q2"])
    assert shares == {"q1": ["shard-00000", "shard-00002", "shard-00004"], "q2": ["shard-00001", "shard-00003"]}
    assert split_shards(names[:1], ["q1", "q2", "q3"]) == {"q1": ["shard-00000"]}  # no run for an empty share
    assert split_shards([], ["q1"]) == {}


def test_a_server_recorded_by_another_host_is_never_signalled(tmp_path):
    run = RunFolder(tmp_path / "run")
    folder = server_folder(run.extract, "other-node")
    # A pid that is alive here (this very process): stopping must not touch it.
    atomic_write_json(
        folder / "server.json",
        {"pid": os.getpid(), "host": "127.0.0.1", "port": 1, "fingerprint": "x", "hostname": "some-other-host"},
    )
    server = VllmServer(folder)
    assert not server.healthy()
    assert server.stop(log=lambda *_: None) is False
    assert (folder / "server.json").exists()  # left for its own host to stop
    status = run_status(run)
    assert status["server"] == "not running"
    assert status["node_servers"]["other-node"].startswith("recorded on host some-other-host")
    assert "extraction server of node other-node: recorded on host some-other-host" in format_status(status)


# ---------------------------------------------------------------------------------------------------------------
# The GPU nodes are declared once, in deployments/prefect.yaml (`definitions.gpu_nodes`). Everything else that names
# a node derives it (setup.py's queues and pool limit, prefect.yaml's queues through YAML aliases, the worker's
# systemd instance, the image's EYRIE_WORK_QUEUE) or is checked against it here.

PREFECT_YAML = REPO / "deployments" / "prefect.yaml"
UNIT = REPO / "infra" / "eyrie-worker.service"
IMAGE = REPO / "infra" / "Dockerfile.gpu-worker"
# Where nodes are named as examples or as test fixtures: every such name must be a declared node.
NAMING_FILES = [
    REPO / "README.md",
    REPO / "docs" / "operations" / "setup.md",  # the operator's guide (infra/README.md points to it)
    *sorted(p for p in (REPO / "infra").iterdir() if p.is_file()),
    *sorted(p for p in (REPO / "deployments").iterdir() if p.is_file()),  # not its __pycache__
    *sorted((REPO / "flows").glob("*.py")),
    REPO / "tests" / "e2e" / "test_production.py",
]


def _code(path) -> str:
    """A file without its comment lines (#), where a node name would be a setting rather than an example."""
    return "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))


def test_the_declaration_is_the_only_list_of_nodes():
    from deployments.setup import gpu_nodes, work_pools

    nodes = gpu_nodes()
    assert len(nodes) >= 2
    # prefect.yaml spells each name once: the deployments' queue and the fan-out's `queues` are aliases of the list.
    code = _code(PREFECT_YAML)
    assert {n: code.count(n) for n in nodes} == {n: 1 for n in nodes}
    # setup.py derives the queues and the pool's limit; it names no node itself.
    assert not [n for n in nodes if n in (REPO / "deployments" / "setup.py").read_text()]
    pools = work_pools(nodes)
    assert list(pools["eyrie-gpu"]["queues"]) == nodes and pools["eyrie-gpu"]["concurrency_limit"] == len(nodes)
    assert {limit for limit, _ in pools["eyrie-gpu"]["queues"].values()} == {1}


def test_the_worker_unit_and_image_take_the_node_from_the_declaration():
    """The unit is a template whose instance is the node; the image takes it from EYRIE_WORK_QUEUE, with no default.
    Both refuse a node that is not declared before the worker starts."""
    from deployments.setup import gpu_nodes

    nodes = gpu_nodes()
    unit = _code(UNIT)
    assert not [n for n in nodes if n in unit], "the unit names a node outside its comments: use %i"
    exec_start = " ".join(re.search(r"^ExecStart=(.*?[^\\])$", unit, re.M | re.S).group(1).split())
    assert "--pool eyrie-gpu --work-queue %i --limit 1" in exec_start and "--name %i" in exec_start, exec_start
    assert re.search(r"^Environment=EYRIE_NODE_NAME=%i$", unit, re.M)
    assert re.search(r'^ExecStartPre=\S+/python -m deployments\.setup --check-node "%i"$', unit, re.M)

    image = _code(IMAGE)
    assert not [n for n in nodes if n in image], "the image names a node outside its comments"
    assert not re.search(r"^\s*EYRIE_WORK_QUEUE=", image, re.M), "no default node in the image's ENV"
    cmd = " ".join(json.loads(re.search(r"^CMD (\[.*\])$", image, re.M).group(1)))
    assert "${EYRIE_WORK_QUEUE:?" in cmd
    assert cmd.index('--check-node "$EYRIE_WORK_QUEUE" || exit 1') < cmd.index("exec prefect worker start")
    assert '--pool eyrie-gpu --work-queue "$EYRIE_WORK_QUEUE" --limit 1' in cmd


def test_every_node_named_elsewhere_is_declared():
    """Docs, comments, the production test and the flows name nodes as examples or fixtures: a node renamed or taken
    off the list must not linger there. A name is recognised where a worker, queue or unit instance is named, and by
    the declared names' own pattern (`gpu-node-<n>` for `gpu-node-1`)."""
    from deployments.setup import gpu_nodes

    nodes = gpu_nodes()
    families = {re.sub(r"\d+$", "", n) for n in nodes if re.search(r"\d$", n)}
    patterns = [
        r"--work-queue[ =]([\w.-]+)",
        r"EYRIE_WORK_QUEUE=([\w.-]+)",
        r"eyrie-worker@([A-Za-z0-9][\w.-]*?)(?:\.service)?(?![\w.-])",
        r"\bworker\(\"([\w.-]+)\"",
        r"\bwait_idle\(\"([\w.-]+)\"",
        *(rf"(?<![\w.-])({re.escape(f)}\d+)(?![\w.-])" for f in families),
    ]
    found = {
        (os.path.relpath(path, REPO), name)
        for path in NAMING_FILES
        for pattern in patterns
        for name in re.findall(pattern, path.read_text())
    }
    assert any(name in nodes for _, name in found)  # the patterns still find the examples
    stray = sorted((where, name) for where, name in found if name not in (*nodes, "control"))
    assert not stray, f"nodes named but not declared in deployments/prefect.yaml definitions.gpu_nodes: {stray}"


def test_check_node(capsys):
    """What the unit's ExecStartPre and the image run before the worker: no server, the file only."""
    from deployments.setup import gpu_nodes, main

    nodes = gpu_nodes()
    assert all(main(["--check-node", n]) == 0 for n in nodes)
    assert main(["--check-node", "gpu-node-99"]) == 1
    assert f"'gpu-node-99' is not a GPU node of {PREFECT_YAML} ({', '.join(nodes)})" in capsys.readouterr().err
    assert main(["--check-node", ""]) == 1  # the unit installed without its `@`: an empty instance


def test_adding_a_node_is_one_line(tmp_path):
    """One line in `definitions.gpu_nodes` gives the node its queue (limit 1), a slot in the GPU pool's limit, a
    share of every fan-out, and a worker that may start; nothing else in prefect.yaml changes."""
    from deployments.setup import load_prefect_file, main, work_pools

    text = PREFECT_YAML.read_text()
    nodes, deployments = load_prefect_file(PREFECT_YAML)
    last = f"    - {nodes[-1]}\n"
    grown = tmp_path / "prefect.yaml"
    grown.write_text(text.replace(last, last + "    - gpu-node-3\n"))
    assert len(grown.read_text().splitlines()) == len(text.splitlines()) + 1

    nodes3, deployments3 = load_prefect_file(grown)
    assert nodes3 == [*nodes, "gpu-node-3"]
    pools = work_pools(nodes3)
    assert pools["eyrie-gpu"]["concurrency_limit"] == len(nodes) + 1
    assert pools["eyrie-gpu"]["queues"]["gpu-node-3"][0] == 1
    fanout = next(d for d in deployments3 if d["entrypoint"] == "flows/fanout.py:extract_fanout_flow")
    assert fanout["parameters"]["queues"] == nodes3
    # Every other deployment setting is as before (the GPU flows keep the first node's queue by default).
    for before, after in zip(deployments, deployments3):
        if after is not fanout:
            assert after == before
    assert main(["--check-node", "gpu-node-3", "--prefect-file", str(grown)]) == 0
    assert main(["--check-node", "gpu-node-3"]) == 1


def test_the_fan_out_parent_counts_every_nodes_shards_from_the_run_folder():
    from eyrie.stages.prepare import Shard
    from flows.fanout import SharesDone

    shards = [Shard(i, 10 * i, 10 * i + 10, f"shard-{i:05d}", 0) for i in range(4)]
    on_disk = {"shard-00000"}  # complete before the parent began: not in any share
    shares = {"gpu-a": ["shard-00001", "shard-00002"], "gpu-b": ["shard-00003"]}
    checked: list[str] = []

    def done(shard):
        checked.append(shard.name)
        return shard.name in on_disk

    parent = SharesDone(shards, shares, done, artifacts=False)
    parent.start("extract")
    parent.poll()
    assert parent.progress.text().startswith("extract: 1 of 4 shards, 10 of 40 rows")
    assert "shard-00000" not in checked  # only the shards the nodes were sent are looked at
    on_disk |= {"shard-00001", "shard-00003"}  # two nodes' manifests written
    parent.poll()
    assert parent.progress.text().startswith("extract: 3 of 4 shards, 30 of 40 rows")
    checked.clear()
    parent.poll()
    assert checked == ["shard-00002"]  # a shard seen done is not checked again
    on_disk.add("shard-00002")
    parent.close()  # the last count, as the nodes left the folder
    assert parent.progress.percent() == 100.0 and "4 of 4 shards" in parent.progress.text()
