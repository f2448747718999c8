"""The flows' shared wiring, in process on the session's Prefect server, without vLLM: the one sharded-stage skeleton
(flows/sharded.py), the one opening of a run (flows/opening.py) that the pipeline and the fan-out share, a shard task
that checks the disk before it needs a server, and task results stored as JSON (tasks/caching.py)."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import DEMO_DATA, HubDatasetRepo, config_dict
from prefect import flow
from prefect.cache_policies import NO_CACHE
from prefect.serializers import JSONSerializer
from prefect.tasks import Task
from test_server_lifecycle import fake, quiet  # noqa: F401 (`fake` is the fixture)

import tasks
from eyrie.config import parse_config
from eyrie.errors import ExtractionError, RegenerationError
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.folder import RunFolder
from eyrie.stages.prepare import Shard
from flows.sharded import ShardedStage, run_sharded_stage
from tasks.caching import folder_tag

pytestmark = pytest.mark.usefixtures("flow_api")


# ---------------------------------------------------------------------------------------------------------------
# The sharded-stage skeleton, with a stand-in server (what it starts, stops and cleans is recorded) and shard
# "tasks" that are plain futures: the skeleton's decisions are the subject here, vLLM's are tested elsewhere.


@dataclass
class FakeServer:
    alive: bool = False
    die_after_start: int = 0  # this many starts leave a server that dies under its shards
    events: list[str] = field(default_factory=list)

    def healthy(self) -> bool:
        return self.alive

    def start(self) -> str:
        self.events.append("start")
        starts = self.events.count("start")
        self.alive = starts > self.die_after_start
        return f"http://server-{starts}"

    def stop(self) -> None:
        self.events.append("stop")
        self.alive = False

    def clean_staging(self) -> int:
        self.events.append("clean")
        return 0

    def stop_unused(self) -> None:
        self.events.append("stop-unused")


class Done:
    def __init__(self, error: Exception | None = None):
        self.error = error

    def result(self):
        if self.error:
            raise self.error
        return {}


def shards(n: int) -> list[Shard]:
    return [Shard(index=i, start=i, stop=i + 1, fingerprint=f"f{i}", num_tokens=1) for i in range(n)]


def stage(server, pending, fail_on=lambda shard, url: False, **kw):
    complete: set[str] = set()
    submitted: list[tuple[str, str]] = []

    def submit(todo, url):
        out = []
        for s in todo:
            submitted.append((s.name, url))
            if fail_on(s, url):
                out.append((s, Done(RuntimeError("connection refused"))))
            else:
                complete.add(s.name)
                out.append((s, Done()))
        return out

    st = ShardedStage(
        name="extraction",
        shards=shards(3),
        pending=set(pending),
        server=server,
        submit=submit,
        is_complete=lambda s: s.name in complete,
        error=ExtractionError,
        **kw,
    )
    return st, submitted


@flow
def run_stage(st, keep_server: bool = False):
    return run_sharded_stage(st, keep_server=keep_server)


def test_nothing_pending_starts_no_server_and_submits_nothing():
    server = FakeServer()
    st, submitted = stage(server, pending=[])
    assert run_stage(st) is False
    assert server.events == [] and submitted == []


def test_only_the_pending_shards_are_submitted_and_the_server_stops_after():
    server = FakeServer()
    st, submitted = stage(server, pending=["shard-00001"])
    assert run_stage(st) is False
    assert submitted == [("shard-00001", "http://server-1")]
    assert server.events == [
        "stop-unused",
        "clean",
        "start",
        "stop",
        "clean",
    ]  # staging of a dead server, then after the stop


def test_kept_up_for_the_next_stage():
    server = FakeServer(alive=True)  # reused: its staging is its requests' and is not touched
    st, _ = stage(server, pending=["shard-00000"])
    assert run_stage(st, keep_server=True) is True
    assert server.events == ["stop-unused", "start"]


def test_a_dead_server_is_restarted_once_and_only_the_failed_shards_redone():
    server = FakeServer(die_after_start=1)
    # Under the first server, shards 0 and 2 fail (it died); shard 1 was answered before.
    st, submitted = stage(
        server, ["shard-00000", "shard-00001", "shard-00002"], lambda s, url: url.endswith("-1") and s.index != 1
    )
    run_stage(st)
    assert [n for n, url in submitted if url.endswith("-2")] == ["shard-00000", "shard-00002"]
    assert server.events.count("start") == 2


def test_a_server_dead_twice_fails_the_stage_naming_the_shards():
    server = FakeServer(die_after_start=2)
    st, _ = stage(server, ["shard-00000", "shard-00002"], lambda s, url: True)
    with pytest.raises(ExtractionError, match=r"2 of 3 shards .*shard-00000, shard-00002.*Run again"):
        run_stage(st)
    assert server.events.count("start") == 2 and server.events[-1] == "stop"


def test_a_live_server_is_not_restarted_and_kept_after_failure_when_asked():
    server = FakeServer()
    st, _ = stage(server, ["shard-00000"], lambda s, url: True, keep_server_after_failure=True)
    with pytest.raises(ExtractionError):
        run_stage(st)
    assert server.events == [
        "stop-unused",
        "clean",
        "start",
    ]  # alive: a shard's own failure is no reason to reload the target


# ---------------------------------------------------------------------------------------------------------------
# A shard task without a server: the disk decides (issue: a regeneration complete on disk, with no Prefect record of
# it, failed because its shards were sent with no server).


def test_a_regeneration_shard_complete_on_disk_needs_no_server(tmp_path):
    from eyrie.stages.regenerate.shard import shard_paths
    from tasks.regenerate import RegenerateShardJob, regenerate_shard_task

    shard = shards(1)[0]
    rows, manifest = shard_paths(tmp_path, shard)
    rows.parent.mkdir(parents=True)
    rows.write_bytes(b"rows")
    atomic_write_json(manifest, {"key": "k-1", "bytes": 4, "stats": {}})
    config = parse_config(config_dict(tmp_path / "target"))

    @flow
    def one(key: str):
        job = RegenerateShardJob(shard, key, str(tmp_path), str(tmp_path))
        return regenerate_shard_task(job, None, config)

    assert one("k-1")["key"] == "k-1"
    with pytest.raises(RegenerationError, match="no server was started"):
        one("k-2")  # not complete for this key: it needs a server, and says so


# ---------------------------------------------------------------------------------------------------------------
# Results as JSON


def all_tasks() -> list[Task]:
    found = []
    for info in pkgutil.iter_modules(tasks.__path__):
        module = importlib.import_module(f"tasks.{info.name}")
        found += [v for v in vars(module).values() if isinstance(v, Task) and v.__module__ == module.__name__]
    return found


def test_every_task_stores_json_or_nothing():
    found = all_tasks()
    assert len(found) >= 15
    for t in found:
        if t.persist_result:
            assert isinstance(t.result_serializer, JSONSerializer), t.name
            assert t.result_serializer.object_decoder is None, t.name  # a record names no class to import
        else:
            assert t.cache_policy == NO_CACHE, t.name


def test_a_stage_result_on_disk_is_json_and_still_a_cache_hit(tmp_path):
    from tasks.vocab import vocab_task

    torch.save({i: 10 - i for i in range(10)}, tmp_path / "token_freq.pt")
    out = tmp_path / "vocab"

    @flow
    def vocab_flow():
        state = vocab_task(str(tmp_path / "token_freq.pt"), 4, 10, str(out), "json-key", return_state=True)
        return state.name, state.result()

    name, first = vocab_flow()
    assert name == "Completed"
    record = Path(os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"]) / f"eyrie-vocab-json-key-{folder_tag(out)}"
    stored = json.loads(record.read_bytes())  # the whole record is JSON; no pickle anywhere in it
    assert stored["metadata"]["serializer"]["type"] == "json"
    assert json.loads(stored["result"]) == first
    name, again = vocab_flow()
    assert (name, again) == ("Cached", first)


def test_a_pickled_record_is_never_read(tmp_path):
    """A pickle in the shared result storage under a stage's cache key (an older Eyrie's record, or a planted one)
    is not unpickled, not even to check that it exists: the task runs and says what to delete."""
    import base64
    import pickle

    from tasks.vocab import vocab_task

    torch.save({i: 10 - i for i in range(10)}, tmp_path / "token_freq.pt")
    out = tmp_path / "vocab"
    canary = tmp_path / "unpickled"

    class Planted:
        def __reduce__(self):
            return (Path.touch, (canary,))

    # Under the key the task's result is read and written under (its stage folder's part included).
    record = Path(os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"]) / f"eyrie-vocab-planted-key-{folder_tag(out)}"
    payload = base64.b64encode(pickle.dumps(Planted())).decode()
    record.write_text(
        json.dumps(
            {
                "metadata": {"storage_key": str(record), "serializer": {"type": "pickle"}, "prefect_version": "3"},
                "result": payload,
            }
        )
    )

    @flow
    def vocab_flow():
        state = vocab_task(str(tmp_path / "token_freq.pt"), 4, 10, str(out), "planted-key", return_state=True)
        return state.name

    for _ in range(2):  # done on disk the second time: still not read
        assert vocab_flow() == "Completed"
        assert not canary.exists()
    record.unlink()


# ---------------------------------------------------------------------------------------------------------------
# One opening of a run: the fan-out opens a run as the pipeline does (it once pinned no revisions and cleaned no
# staging, so its nodes keyed a hub-sourced run on `main` instead of the commit the pipeline keys on).

COMMIT = "3" * 40


@pytest.fixture
def hub_run(tmp_path, tiny_llama):
    data = HubDatasetRepo({COMMIT: {"train.jsonl": DEMO_DATA.read_text()}})
    config = parse_config(config_dict(tiny_llama, source=data.repo, max_samples=16, shard_size=8))
    run = RunFolder(tmp_path / "run")
    run.ensure()
    stale = run.root / ".preflight.json.dead.eyrie-tmp"  # an atomic write's temporary, its writer long gone
    stale.write_text("{")
    yield config, run, stale
    data.remove()


def test_the_pipeline_opens_a_run_pinned_and_clean(hub_run):
    from flows.pipeline import pipeline_flow

    config, run, stale = hub_run
    pipeline_flow(config, str(run.root), until="prepare")
    assert not stale.exists()
    assert read_json(run.root / "preflight.json")["revisions"]["data"] == COMMIT


def test_the_fanout_opens_a_run_as_the_pipeline_does(hub_run, monkeypatch):
    import flows.fanout as fanout

    config, run, stale = hub_run
    sent = {}
    monkeypatch.setattr(fanout, "_check_queues", lambda *a: None)

    def run_deployment(name, parameters, work_queue_name, **kw):
        sent[work_queue_name] = parameters
        return SimpleNamespace(id=work_queue_name, name=work_queue_name)

    monkeypatch.setattr(fanout, "run_deployment", run_deployment)
    done = SimpleNamespace(is_completed=lambda: True)
    monkeypatch.setattr(
        fanout, "_wait", lambda children, log, on_poll=None: {q: SimpleNamespace(state=done) for q in children}
    )
    with pytest.raises(ExtractionError, match="lack a complete manifest"):  # nothing ran on the stand-in nodes
        fanout.extract_fanout_flow(config, str(run.root), ["q1", "q2"])
    assert not stale.exists()
    assert read_json(run.root / "preflight.json")["revisions"]["data"] == COMMIT
    assert set(sent) == {"q1", "q2"}
    for params in sent.values():  # what each node keys its shards on: the pinned commit
        assert params["config"]["data"]["revision"] == COMMIT


def test_no_flow_opens_a_run_by_hand():
    """The opening's steps are called in flows/opening.py alone."""
    for path in Path(__file__).resolve().parents[2].glob("flows/*.py"):
        if path.name == "opening.py":
            continue
        text = path.read_text()
        for step in ("pin_revisions(", "prepare_task(", "remove_staging(", "ensure_target("):
            assert step not in text, f"{path.name} calls {step}...): open the run with flows.opening.open_run"


# ---------------------------------------------------------------------------------------------------------------
# GPUs free when a GPU stage starts: the run's servers that stage does not use are stopped (fake vLLM processes, as
# tests/unit/test_server_lifecycle.py starts them).


def test_before_a_gpu_stage_the_servers_it_does_not_use_are_stopped(tmp_path, fake):  # noqa: F811
    from eyrie.vllm.process import VllmServer, _alive
    from tasks.serving import stop_unused_servers_task

    run = RunFolder(tmp_path / "run")
    folders = {
        "extract": run.extract,
        "node": run.extract / "nodes" / "n1",
        "trained": run.export / "server-trained",
        "current": run.evaluate / "server-current",
    }
    pids = {}
    for name, folder in folders.items():
        spec = fake.spec(drafter=None if name in ("extract", "node") else f"/drafters/{name}")
        pids[name] = VllmServer(fake.folder(folder)).launch(spec, log=quiet)[0]["pid"]

    @flow
    def before(keep: list[str], stage: str) -> list[str]:
        return stop_unused_servers_task(str(run.root), keep, stage)

    # A sharded stage keeps every extraction server (each node's own), stops the serving ones.
    assert sorted(before([str(run.extract)], "extract")) == sorted(str(folders[n]) for n in ("trained", "current"))
    assert _alive(pids["extract"]) and _alive(pids["node"]) and not _alive(pids["current"])
    # Export keeps only its own.
    pids["trained"] = VllmServer(folders["trained"]).launch(fake.spec(drafter="/drafters/trained"), log=quiet)[0]["pid"]
    assert sorted(before([str(folders["trained"])], "export")) == sorted(str(folders[n]) for n in ("extract", "node"))
    assert _alive(pids["trained"]) and not _alive(pids["extract"]) and not _alive(pids["node"])
    assert before([], "train") == [str(folders["trained"])] and before([], "train") == []


def test_a_failed_export_proof_stops_its_server(tmp_path, fake, monkeypatch):  # noqa: F811
    import tasks.export as export
    from eyrie.vllm.process import VllmServer, _alive

    def failing_proof(checkpoint, out, target_model, aux_ids, hidden_size, key, serve_drafter, probe):
        serve_drafter(str(out / "drafter"))
        raise RuntimeError("vLLM did not load the drafter as eagle3")

    monkeypatch.setattr(export, "export_and_prove", failing_proof)
    out = tmp_path / "export"
    folder = fake.folder(out / "server-trained")
    job = export.ExportJob(
        str(tmp_path / "ckpt"), str(out), "fake-target", [2], 64, "k", fake.spec(drafter="x"), [], 30
    )

    @flow
    def export_flow():
        return export.export_task.with_options(retries=0)(job)

    with pytest.raises(RuntimeError, match="eagle3"):
        export_flow()
    state = VllmServer(folder).state
    assert not state or not _alive(state["pid"])


def test_a_server_a_task_starts_leaves_its_start_up_phases_as_an_artifact(tmp_path, fake):  # noqa: F811
    from prefect.client.orchestration import get_client

    from tasks.serving import start_server_task

    folder = fake.folder(tmp_path / "extract")

    @flow
    def start_twice():
        start_server_task.with_options(retries=0)(fake.spec("--vllm-log"), str(folder), 30)
        start_server_task.with_options(retries=0)(fake.spec("--vllm-log"), str(folder), 30)  # reused: no new one

    start_twice()

    async def artifacts():
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        async with get_client() as c:
            return await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["server-start"])))

    found = [a for a in asyncio.run(artifacts()) if str(folder) in (a.description or "")]
    assert len(found) == 1, found  # the reused server made none
    rows = json.loads(found[0].data) if isinstance(found[0].data, str) else found[0].data
    phases = {row["phase"] for row in rows}
    assert {"engine init", "total"} <= phases and "weights" in found[0].description, found[0]
