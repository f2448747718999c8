"""Several nodes on one run folder, without a server: node folders, the shard split, and a server recorded by another
host, which must never be signalled from here (its pid means nothing on this host). The real thing runs in
tests/test_production.py."""

from __future__ import annotations

import os

import pytest

from eyrie.errors import ExtractionError
from eyrie.server import ExtractionServer, node_name, server_folder, server_folders
from eyrie.status import format_status, run_status
from eyrie.store import RunFolder, atomic_write_json


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
    server = ExtractionServer(folder)
    assert not server.healthy()
    assert server.stop(log=lambda *_: None) is False
    assert (folder / "server.json").exists()  # left for its own host to stop
    status = run_status(run)
    assert status["server"] == "not running"
    assert status["node_servers"]["other-node"].startswith("recorded on host some-other-host")
    assert "extraction server of node other-node: recorded on host some-other-host" in format_status(status)
