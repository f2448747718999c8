"""The pipeline flow end to end on tiny-llama, run as a user runs it (`python -m flows.cli run`, a subprocess).

One run folder serves every test here (vLLM starts once): the first run is SIGKILLed once some but not all shards
are done, a second run resumes it, then the tests check what the resume kept, what `eyrie status` says, that a
third run does no work and starts no vLLM, and that speculators' own training loader reads the output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, eyrie_run, register_server_folder, stop_server, write_config

from eyrie.run.folder import RunFolder
from eyrie.stages.extract.checks import load_checked
from eyrie.vllm.process import VllmServer, _alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.usefixtures("flow_api")]

NUM_SAMPLES, SHARD_SIZE, NUM_LAYERS, HIDDEN = 48, 8, 4, 64  # 3 aux layers + the last layer's output
NUM_SHARDS = NUM_SAMPLES // SHARD_SIZE


def flow_cmd(config: Path, run: Path) -> list[str]:
    # Through extraction only: the later stages have their own tests (test_pipeline.py).
    return eyrie_run(config, run, "extract")


def run_flow(config: Path, run: Path, timeout: float) -> subprocess.CompletedProcess:
    """One flow run to its end; on a timeout its whole session goes (Prefect's server too, not vLLM's, which has a
    session of its own and is stopped by the fixture)."""
    proc = subprocess.Popen(
        flow_cmd(config, run),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the flow run took more than {timeout:.0f} s:\n{_tail(out)}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def status_text(run: Path) -> str:
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["status", "--run-dir", str(run)]) == 0
    return buf.getvalue()


def starts_in_log(run: Path) -> int:
    log = run / "extract" / "server.log"
    return log.read_text(errors="replace").count("eyrie: starting vLLM") if log.exists() else 0


def file_ids(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


@dataclass
class Resumed:
    root: Path
    config: Path
    run: Path
    killed_after_s: float
    done_at_kill: dict  # shard name -> (inode, mtime_ns, bytes) of its manifest
    samples_at_kill: dict  # hs file name -> (inode, mtime_ns)
    status_at_kill: str
    server_at_kill: dict
    server_healthy_after_kill: bool
    resume: subprocess.CompletedProcess
    resume_s: float


def _tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, tiny_llama) -> Resumed:
    root = tmp_path_factory.mktemp("flow")
    run = root / "run"
    # concurrency 1: a shard takes a few seconds, so the run can be caught between its first and last shard.
    config, _ = write_config(
        root / "config.yaml",
        tiny_llama,
        "tiny-llama",
        max_samples=NUM_SAMPLES,
        shard_size=SHARD_SIZE,
        layer_ids=[2, 4, 5],
        concurrency=1,
    )
    register_server_folder(run / "extract")
    manifests = run / "extract" / "shards"
    first = None
    try:
        t0 = time.monotonic()
        with open(root / "run1.log", "wb") as log1:
            # Its own session, so the Prefect server it starts can be cleaned up after the kill; the vLLM server
            # it starts has a session of its own and is not touched.
            first = subprocess.Popen(
                flow_cmd(config, run),
                cwd=REPO,
                stdout=log1,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            while True:
                if first.poll() is not None:
                    pytest.fail(
                        f"the first run ended (rc {first.returncode}) before it could be killed:\n"
                        + _tail((root / "run1.log").read_text(errors="replace"))
                    )
                done = sorted(p.stem for p in manifests.glob("shard-*.json")) if manifests.exists() else []
                if done:
                    break
                if time.monotonic() - t0 > 1000:
                    pytest.fail("no shard finished within 1000 s:\n" + _tail((root / "run1.log").read_text()))
                time.sleep(0.02)
            first.send_signal(signal.SIGKILL)  # the flow process only
            first.wait(timeout=30)
        killed_after = time.monotonic() - t0
        server = VllmServer(run / "extract")
        server_state = server.state or {}
        healthy = server.healthy()
        with contextlib.suppress(ProcessLookupError):  # orphans of the flow's own session (its Prefect server)
            os.killpg(first.pid, signal.SIGKILL)

        done = sorted(p.stem for p in manifests.glob("shard-*.json"))
        assert 1 <= len(done) < NUM_SHARDS, f"killed too late: {len(done)} of {NUM_SHARDS} shards done"
        done_at_kill = {
            name: (*file_ids(manifests / f"{name}.json"), (manifests / f"{name}.json").read_bytes()) for name in done
        }
        samples_at_kill = {p.name: file_ids(p) for p in (run / "extract" / "hidden_states").glob("hs_*")}
        status_at_kill = status_text(run)

        t1 = time.monotonic()
        resume = run_flow(config, run, timeout=1200)
        (root / "run2.log").write_text(resume.stdout)
        yield Resumed(
            root,
            config,
            run,
            killed_after,
            done_at_kill,
            samples_at_kill,
            status_at_kill,
            server_state,
            healthy,
            resume,
            time.monotonic() - t1,
        )
    finally:
        if first is not None and first.poll() is None:
            first.kill()
        if first is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(first.pid, signal.SIGKILL)
        stop_server(run / "extract")


def _rows(run: Path) -> list[list[int]]:
    from datasets import load_from_disk

    return load_from_disk(str(run / "prepare" / "dataset")).with_format(None)["input_ids"]


def test_resume_after_kill(resumed: Resumed):
    r, run = resumed, resumed.run
    out = r.resume.stdout
    assert r.resume.returncode == 0, _tail(out)
    print(
        f"first run killed after {r.killed_after_s:.0f} s with {len(r.done_at_kill)} of {NUM_SHARDS} shards "
        f"done; the resume took {r.resume_s:.0f} s"
    )

    # The kill left the detached vLLM server up, and the resume reused it: one start in its log.
    assert r.server_healthy_after_kill, "the vLLM server died with the flow process"
    pid = r.server_at_kill["pid"]
    assert f"reusing vLLM server pid {pid}" in out
    assert "started vLLM server" not in out
    assert starts_in_log(run) == 1
    # The resume finished the extraction and so stopped the server.
    assert VllmServer(run / "extract").state is None and not _alive(pid)

    # No completed shard was recomputed: its manifest and its samples are the very same files.
    manifests = run / "extract" / "shards"
    hidden = run / "extract" / "hidden_states"
    for name, (ino, mtime, data) in r.done_at_kill.items():
        path = manifests / f"{name}.json"
        assert file_ids(path) == (ino, mtime) and path.read_bytes() == data, f"{name} was rewritten"
        for idx in json.loads(data)["files"]:
            assert file_ids(hidden / f"hs_{idx}.safetensors") == r.samples_at_kill[f"hs_{idx}.safetensors"]
    # Samples of unfinished shards that were whole at the kill were kept, not sent again.
    for name, (ino, mtime) in r.samples_at_kill.items():
        assert file_ids(hidden / name) == (ino, mtime), f"{name} was rewritten"
    for path in sorted(manifests.glob("shard-*.json")):
        m = json.loads(path.read_text())
        if path.stem in r.done_at_kill:
            continue
        kept = sum(f"hs_{i}.safetensors" in r.samples_at_kill for i in range(*m["rows"]))
        assert m["reused_samples"] == kept and m["extracted_samples"] == SHARD_SIZE - kept, (path.stem, m)
    # A shard whose every sample was on disk at the kill (killed between its last file and its manifest) gets its
    # manifest from disk without the server: it is not counted as to extract.
    on_disk = {
        path.stem
        for path in manifests.glob("shard-*.json")
        if all(f"hs_{i}.safetensors" in r.samples_at_kill for i in range(*json.loads(path.read_text())["rows"]))
    }
    assert f"{NUM_SHARDS} shards, {NUM_SHARDS - len(on_disk | set(r.done_at_kill))} to extract" in out

    # Exactly one valid file per sample, and nothing half-written or orphaned anywhere in the run folder.
    rows = _rows(run)
    assert len(rows) == NUM_SAMPLES
    files = sorted(hidden.iterdir())
    assert sorted(p.name for p in files) == sorted(f"hs_{i}.safetensors" for i in range(NUM_SAMPLES))
    for i, ids in enumerate(rows):
        load_checked(hidden / f"hs_{i}.safetensors", ids, NUM_LAYERS, HIDDEN)
    assert len(list(manifests.glob("shard-*.json"))) == NUM_SHARDS
    # (.eyrie.lock is the run folder's flock file: it stays, and holds no lock once its process is gone.)
    leftovers = [
        p
        for p in run.rglob("*")
        if p.name != ".eyrie.lock" and (p.name.endswith((".tmp", ".eyrie-tmp", ".lock")) or ".staging-" in p.name)
    ]
    assert leftovers == []
    # Requests in flight at the kill were answered into the server's staging folder for a client that was gone;
    # the resumed run removes them once its own extraction is done.
    staging = run / "extract" / "staging"
    assert not staging.exists() or list(staging.iterdir()) == [], "orphaned staging files after the resume"
    with RunFolder(run).lock():  # the killed run's lock died with it
        pass


def test_status_reports_stages_and_shards(resumed: Resumed):
    # At the kill: some shards done, the extraction part-way, the detached server still running.
    at_kill = resumed.status_at_kill
    assert re.search(r"^\s+prepare\s+done$", at_kill, re.M)
    assert re.search(rf"^\s+extract\s+{len(resumed.done_at_kill)}/{NUM_SHARDS} shards$", at_kill, re.M)
    for name in resumed.done_at_kill:
        assert re.search(rf"^\s+{name}\s+done$", at_kill, re.M)
    states = re.findall(r"^\s+(shard-\d{5})\s+(.+)$", at_kill, re.M)
    assert len(states) == NUM_SHARDS
    assert all(s == "done" or s == "pending" or re.fullmatch(rf"partial \d/{SHARD_SIZE}", s) for _, s in states)
    assert f"extraction server: running pid {resumed.server_at_kill['pid']}" in at_kill

    # After the resume: every stage listed, the first two done, every shard done, no server.
    text = status_text(resumed.run)
    for stage in ("prepare", "extract", "vocab", "train", "export", "evaluate"):
        assert re.search(rf"^\s+{stage}\s+\S", text, re.M), f"{stage} missing from:\n{text}"
    assert re.search(r"^\s+prepare\s+done$", text, re.M) and re.search(r"^\s+extract\s+done$", text, re.M)
    assert re.findall(r"^\s+(shard-\d{5})\s+done$", text, re.M) == [f"shard-{i:05d}" for i in range(NUM_SHARDS)]
    assert "extraction server: not running" in text

    # The same through the console entry point, as a user types it.
    cli = subprocess.run(
        [sys.executable, "-m", "flows.cli", "status", "--run-dir", str(resumed.run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0 and cli.stdout.strip() == text.strip()


def test_rerun_of_finished_extraction_starts_no_vllm(resumed: Resumed):
    run = resumed.run
    hidden = run / "extract" / "hidden_states"
    before = {p.name: file_ids(p) for p in sorted(hidden.iterdir())}
    manifests_before = {p.name: file_ids(p) for p in (run / "extract" / "shards").iterdir()}
    log_before = (run / "extract" / "server.log").read_bytes()
    t0 = time.monotonic()
    rerun = run_flow(resumed.config, run, timeout=900)
    out = rerun.stdout
    (resumed.root / "run3.log").write_text(out)
    print(f"re-run of the finished run took {time.monotonic() - t0:.0f} s")
    assert rerun.returncode == 0, _tail(out)
    assert f"{NUM_SHARDS} shards, 0 to extract" in out
    assert "vLLM server" not in out  # neither started nor reused
    assert "start-server" not in out  # the task did not even run
    assert (run / "extract" / "server.log").read_bytes() == log_before  # vLLM wrote nothing: it never started
    assert starts_in_log(run) == 1
    assert not (run / "extract" / "server.json").exists()
    assert "Task run 'extract-shard-" not in out  # complete shards need no task (a cached run stays cheap)
    assert re.search(r"Task run 'prepare-[^']*' - Finished in state Cached", out)
    assert {p.name: file_ids(p) for p in sorted(hidden.iterdir())} == before
    assert {p.name: file_ids(p) for p in (run / "extract" / "shards").iterdir()} == manifests_before

    # The same command as a user types it (the fast path on): nothing changed since the flow above recorded its
    # finish, so its outputs are printed without Prefect (flows/finished.py), and nothing is touched.
    env = {k: v for k, v in os.environ.items() if k != "EYRIE_ALWAYS_FLOW"}
    fast = subprocess.run(flow_cmd(resumed.config, run), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert fast.returncode == 0 and "Nothing to do" in fast.stdout, _tail(fast.stdout + fast.stderr)
    assert "Task run" not in fast.stdout + fast.stderr  # no Prefect flow ran
    assert {p.name: file_ids(p) for p in sorted(hidden.iterdir())} == before
    assert starts_in_log(run) == 1

    # A moved run folder is reused whole: the fast path prints its outputs where it is now, and the flow (on by
    # the tests' EYRIE_ALWAYS_FLOW) extracts nothing and starts no vLLM server there.
    moved = run.with_name("moved")
    run.rename(moved)
    try:
        fast = subprocess.run(flow_cmd(resumed.config, moved), cwd=REPO, env=env, capture_output=True, text=True)
        assert fast.returncode == 0 and "Nothing to do" in fast.stdout, _tail(fast.stdout + fast.stderr)
        assert f"{moved}/extract/hidden_states" in fast.stdout and f"{run}/" not in fast.stdout, fast.stdout
        t0 = time.monotonic()
        again = run_flow(resumed.config, moved, timeout=900)
        print(f"the flow on the moved run folder took {time.monotonic() - t0:.0f} s")
        assert again.returncode == 0 and f"{NUM_SHARDS} shards, 0 to extract" in again.stdout, _tail(again.stdout)
        assert "vLLM server" not in again.stdout and starts_in_log(moved) == 1
    finally:
        moved.rename(run)


def test_speculators_training_loader_reads_the_output(resumed: Resumed):
    import torch
    from hs_connectors import FileTransfer
    from safetensors.torch import load_file
    from speculators.train.data import ArrowDataset, CollateFn

    run = resumed.run
    hidden = run / "extract" / "hidden_states"
    ds = ArrowDataset(
        max_len=256, datapath=str(run / "prepare" / "dataset"), transfer=FileTransfer(hidden), on_missing="raise"
    )
    assert len(ds) == NUM_SAMPLES
    rows = _rows(run)
    items = []
    for i in range(len(ds)):
        item = ds[i]
        assert isinstance(item, dict), f"sample {i} unavailable: {item}"
        t = len(rows[i])
        assert item["input_ids"].tolist() == rows[i]
        assert tuple(item["hidden_states"].shape) == (t, 3 * HIDDEN)
        assert tuple(item["verifier_last_hidden_states"].shape) == (t, HIDDEN)
        assert tuple(item["loss_mask"].shape) == (t,) and 0 < int(item["loss_mask"].sum()) < t
        assert item["lengths"].tolist() == [t]
        raw = load_file(str(hidden / f"hs_{i}.safetensors"))["hidden_states"]
        assert torch.equal(item["hidden_states"], raw[:, :3].flatten(1))  # aux layers, low to high
        assert torch.equal(item["verifier_last_hidden_states"], raw[:, 3])  # the last layer's output
        items.append(item)
    # ...and its collate function packs them into a training batch.
    batch = CollateFn(max_len=256, hidden_size=HIDDEN)(items[:3])
    assert tuple(batch["hidden_states"].shape) == (1, 256, 3 * HIDDEN)
    lengths = [len(rows[i]) for i in range(3)]
    assert sum(lengths) < 256
    doc = batch["document_ids"][0]
    assert torch.bincount(doc[doc >= 0]).tolist() == lengths  # three documents packed, the rest padding
    first = items[0]["hidden_states"].to(batch["hidden_states"].dtype)
    assert torch.equal(batch["hidden_states"][0, : lengths[0]], first)
    assert (run / "prepare" / "dataset" / "token_freq.pt").exists()


def test_a_changed_input_redoes_through_eyrie_run_exactly_the_work_it_shapes(resumed: Resumed, tiny_llama):
    """Issue 35's outcome, end to end through `eyrie run` on a copy of the finished run (the plan-level proof over
    every declared input is tests/unit/test_reuse_outcomes.py): other aux layers of the same count leave every row's
    tokens alone, yet every shard is extracted again by a new server and every file records the new key, while
    prepare is reused; then a scheduling-only change (the client's concurrency) redoes nothing and starts no vLLM."""
    import shutil

    from eyrie.hidden_states.keyed import file_key

    copy = resumed.root / "mutated"
    shutil.copytree(resumed.run, copy, symlinks=True)
    register_server_folder(copy / "extract")
    hidden = copy / "extract" / "hidden_states"
    keys_before = {p.name: file_key(p) for p in hidden.glob("hs_*")}
    prepared = {p: file_ids(p) for p in (copy / "prepare").rglob("*") if p.is_file()}
    assert keys_before and None not in keys_before.values()
    common = dict(max_samples=NUM_SAMPLES, shard_size=SHARD_SIZE, concurrency=1)
    try:
        layers, _ = write_config(resumed.root / "layers.yaml", tiny_llama, "tiny-llama", layer_ids=[1, 3, 5], **common)
        out = run_flow(layers, copy, timeout=1200).stdout
        (resumed.root / "run-layers.log").write_text(out)
        assert f"{NUM_SHARDS} shards, {NUM_SHARDS} to extract" in out, _tail(out)
        assert starts_in_log(copy) == 2  # a new server, for the new layers
        assert prepared and {p: file_ids(p) for p in (copy / "prepare").rglob("*") if p.is_file()} == prepared
        keys_after = {p.name: file_key(p) for p in hidden.glob("hs_*")}
        assert keys_after.keys() == keys_before.keys()
        assert all(keys_after[n] != keys_before[n] for n in keys_before), (keys_before, keys_after)

        common["concurrency"] = 2
        sched, _ = write_config(resumed.root / "sched.yaml", tiny_llama, "tiny-llama", layer_ids=[1, 3, 5], **common)
        again = run_flow(sched, copy, timeout=900).stdout
        assert f"{NUM_SHARDS} shards, 0 to extract" in again and "vLLM server" not in again, _tail(again)
        assert starts_in_log(copy) == 2
        assert {p.name: file_key(p) for p in hidden.glob("hs_*")} == keys_after
    finally:
        stop_server(copy / "extract")
