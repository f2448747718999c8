"""Faults during a real run (tiny-llama, vLLM's CPU build, Prefect): the extraction server killed mid-run, and a
second run started on a folder that is in use. Neither may end as a success with samples missing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests
from conftest import REPO, eyrie_run, register_server_folder, stop_server, write_config

from eyrie.errors import RunFolderError
from eyrie.run.files import read_json
from eyrie.run.folder import RunFolder, sample_path
from eyrie.stages.extract.checks import load_checked
from eyrie.stages.prepare import load_dataset_rows, load_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.usefixtures("flow_api")]


SECRET = "eyrie-test-secret-5f3a9c"  # the extraction server's API key in the first test


def flow(config: Path, run: Path) -> subprocess.Popen:
    return subprocess.Popen(
        eyrie_run(config, run, "extract"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, EYRIE_TEST_API_KEY=SECRET),
    )


def files_holding(text: str, *folders: Path) -> list[str]:
    needle = text.encode()
    return [str(p) for folder in folders for p in folder.rglob("*") if p.is_file() and needle in p.read_bytes()]


def check_every_route_refuses_strangers(base: str, run: Path) -> None:
    """Issue 22, item 5, on the running server: every route it lists (its own /openapi.json, read with the key) and
    the routes outside that list (/metrics, the docs) answer 401 without the key; and with it, a request whose
    `request_id`, X-Request-Id and `hidden_states_path` point outside the run still gets a file the connector named,
    in its staging folder."""
    from eyrie.stages.extract.answered import _wait_and_release

    auth = {"Authorization": f"Bearer {SECRET}"}
    schema = requests.get(base + "/openapi.json", headers=auth, timeout=10).json()
    routes = [(m.upper(), p.replace("{", "").replace("}", "")) for p, ops in schema["paths"].items() for m in ops]
    routes += [("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"), ("OPTIONS", "/invocations")]
    assert ("POST", "/invocations") in routes and len(routes) > 20
    answered = {(m, p): requests.request(m, base + p, timeout=10).status_code for m, p in routes}
    assert {k: v for k, v in answered.items() if v != 401} == {}
    body = {
        "model": "target",
        "prompt": [1, 2, 3, 4],
        "max_tokens": 1,
        "request_id": "../../../../escape-body",
        "kv_transfer_params": {"hidden_states_path": str(run.parent / "escape-path.safetensors")},
    }
    r = requests.post(
        base + "/v1/completions", json=body, headers={**auth, "X-Request-Id": "../../../escape-header"}, timeout=60
    )
    assert r.status_code == 200, r.text
    path = Path(r.json()["kv_transfer_params"]["hidden_states_path"])
    assert path.parent == run / "extract" / "staging" and path.name.startswith("eyrie-"), path
    _wait_and_release(str(path))
    path.unlink()
    assert not [p for p in run.parent.rglob("escape*")]


def test_server_killed_mid_run_is_restarted_once_and_only_missing_samples_are_redone(tmp_path, tiny_llama):
    # The server requires an API key here (as it does off loopback); the key must survive the restart and must
    # never be written down.
    config, _ = write_config(
        tmp_path / "config.yaml",
        tiny_llama,
        max_samples=48,
        shard_size=8,
        concurrency=1,
        layer_ids=[2, 4, 5],
        extraction={"api_key_env": "EYRIE_TEST_API_KEY"},
    )
    run = tmp_path / "run"
    register_server_folder(run / "extract")
    proc = flow(config, run)
    deadline, done = time.monotonic() + 900, {}
    while time.monotonic() < deadline and proc.poll() is None:
        done = {p.name: p.stat().st_mtime_ns for p in (run / "extract" / "shards").glob("*.json")}
        if done:
            break
        time.sleep(0.2)
    assert done and proc.poll() is None, "no shard finished while the flow ran"
    server = read_json(run / "extract" / "server.json")
    url = f"http://{server['host']}:{server['port']}/v1/models"
    assert requests.get(url, timeout=10).status_code == 401
    assert requests.get(url, timeout=10, headers={"Authorization": f"Bearer {SECRET}"}).status_code == 200
    check_every_route_refuses_strangers(f"http://{server['host']}:{server['port']}", run)
    kept = {p.name: p.stat().st_mtime_ns for p in (run / "extract" / "hidden_states").glob("hs_*.safetensors")}
    os.killpg(read_json(run / "extract" / "server.json")["pid"], signal.SIGKILL)  # the server and its engine
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert "restarting it once" in out
    log = (run / "extract" / "server.log").read_text(errors="replace")
    assert log.count("eyrie: starting vLLM") == 2
    # Finished shards and samples written before the kill were not redone.
    for name, mtime in done.items():
        assert (run / "extract" / "shards" / name).stat().st_mtime_ns == mtime
    for name, mtime in kept.items():
        assert (run / "extract" / "hidden_states" / name).stat().st_mtime_ns == mtime
    # And nothing is missing: exactly one valid file per sample.
    rf = RunFolder(run)
    shards = load_shards(rf.prepare)
    files = list(rf.hidden_states.glob("hs_*.safetensors"))
    assert len(files) == shards[-1].stop
    for shard in shards:
        for offset, ids in enumerate(load_dataset_rows(rf.prepare, shard.start, shard.stop)):
            load_checked(sample_path(rf.hidden_states, shard.start + offset), ids, 4, 64)
    # The key is in no log, manifest or state file of the run, nor in Prefect's database (logs, artifacts, states).
    assert SECRET not in out
    assert files_holding(SECRET, run, Path(os.environ["PREFECT_HOME"])) == []


def test_second_run_on_a_folder_in_use_is_refused(tmp_path, tiny_llama):
    config, _ = write_config(tmp_path / "config.yaml", tiny_llama, max_samples=8, shard_size=8)
    run = RunFolder(tmp_path / "run")
    with run.lock():
        out = subprocess.run(
            eyrie_run(config, run.root, "prepare"),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert out.returncode != 0
    assert f"run folder {run.root} is in use by pid {os.getpid()}" in out.stdout + out.stderr
    assert not (run.root / "prepare").exists()  # it did nothing before refusing


def test_the_extraction_deployment_takes_the_run_folders_lock(tmp_path, tiny_llama):
    """eyrie-extract/production's flow, started on a folder a pipeline run holds, is refused before it reads or
    starts anything (its body runs here without the Prefect engine: the lock is what is tested)."""
    from flows.extract import extract_run_flow

    _, config = write_config(tmp_path / "config.yaml", tiny_llama, max_samples=8, shard_size=8)
    run = RunFolder(tmp_path / "run")
    with run.lock():
        with pytest.raises(RunFolderError, match=f"run folder {run.root} is in use by pid {os.getpid()}"):
            extract_run_flow.fn(config, str(run.root))
    assert not run.extract.exists()


def _fill(folder: Path) -> Path:
    """Take every free byte of `folder`'s filesystem, as another job on a shared node would."""
    filler = folder / "filler.bin"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            block = b"\0" * chunk
            try:
                while True:
                    f.write(block)
            except OSError:
                pass
    return filler


@pytest.fixture
def small_disk(tmp_path):
    """A real 48 MiB filesystem (tmpfs) at <run>/extract; needs root, as CI has."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (CI runs as root)")
    RunFolder(tmp_path / "run").ensure()  # stamped first: Eyrie adopts only an empty or stamped folder
    extract = tmp_path / "run" / "extract"
    extract.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(extract)], check=True)
    try:
        yield extract
    finally:
        stop_server(extract)
        subprocess.run(["umount", "-l", str(extract)], check=False)


def test_disk_full_mid_shard_is_a_clear_error_and_loses_nothing(tmp_path, tiny_llama, small_disk):
    config, _ = write_config(
        tmp_path / "config.yaml",
        tiny_llama,
        max_samples=96,  # 12 shards: the disk fills while most are still to write, however fast the machine
        shard_size=8,
        concurrency=1,
        layer_ids=[2, 4, 5],
        extraction={"min_free_disk_gib": 0},
    )
    run, extract = tmp_path / "run", small_disk
    register_server_folder(extract)
    proc = flow(config, run)
    deadline, done = time.monotonic() + 900, []
    while time.monotonic() < deadline and proc.poll() is None and not done:
        done = sorted((extract / "shards").glob("*.json")) if (extract / "shards").exists() else []
        time.sleep(0.2)
    assert done and proc.poll() is None, "no shard finished while the flow ran"
    filler = _fill(extract)
    out, _ = proc.communicate(timeout=900)

    assert proc.returncode != 0, "a run that could not write its samples ended as a success"
    assert "is full" in out and "free space and run again" in out, out[-4000:]
    rf = RunFolder(tmp_path / "run")
    shards = load_shards(rf.prepare)
    finished = {p.stem: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (extract / "shards").glob("*.json")}
    assert 0 < len(finished) < len(shards), finished
    # What finished before the disk filled is intact (checksums), and no partial file passes as a sample.
    from eyrie.stages.extract.manifest import shard_complete

    keys = {p.stem: read_json(p)["key"] for p in (extract / "shards").glob("*.json")}
    for name in finished:
        assert shard_complete(extract / "shards" / f"{name}.json", keys[name], rf.hidden_states, True), name
    rows = {s.start + i: ids for s in shards for i, ids in enumerate(load_dataset_rows(rf.prepare, s.start, s.stop))}
    for p in rf.hidden_states.glob("hs_*.safetensors"):
        idx = int(p.stem.split("_")[1])
        load_checked(p, rows[idx], 4, 64)

    filler.unlink()  # the operator frees space and runs again
    rerun = flow(config, run)
    out, _ = rerun.communicate(timeout=900)
    assert rerun.returncode == 0 and "reusing vLLM server" in out, out[-4000:]
    for name, ids in finished.items():
        p = extract / "shards" / f"{name}.json"
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == ids, f"{name} was redone"
    assert sorted(p.name for p in rf.hidden_states.iterdir()) == sorted(f"hs_{i}.safetensors" for i in rows)
    for idx, ids in rows.items():
        load_checked(sample_path(rf.hidden_states, idx), ids, 4, 64)
