"""One progress artifact per run of a sharded stage ("N of M shards", rows/s, time left), counted by the shards'
tasks and published from the flow's thread; a finished stage reads 100%. (Before: one artifact per shard, about
5,400 for a Kimi-sized run, and a finished shard left at 93% when its last update came from a worker thread.)"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from eyrie.errors import ExtractionError
from eyrie.stages.prepare import Shard
from flows.sharded import ShardedStage, run_sharded_stage
from tasks.progress import StageProgress, report_rows


def _shards(n: int, rows: int = 64) -> list[Shard]:
    return [Shard(index=i, start=i * rows, stop=(i + 1) * rows, fingerprint=f"f{i}", num_tokens=1) for i in range(n)]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_count_says_shards_rows_rate_and_time_left():
    shards, clock = _shards(4), Clock()
    p = StageProgress("extraction", shards, {"shard-00001", "shard-00002", "shard-00003"}, clock=clock, artifacts=False)
    assert p.text() == "extraction: 1 of 4 shards, 64 of 256 rows" and p.percent() == 25.0
    clock.now += 10
    threads = [threading.Thread(target=report_rows, args=("extraction", "shard-00001", d, 64)) for d in (10, 32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report_rows("extraction", "shard-00002", 64, 64)  # all its rows: finished, whatever the flow saw yet
    report_rows("regeneration", "shard-00003", 64, 64)  # another stage's count is not this one's
    assert p.text() == "extraction: 2 of 4 shards, 160 of 256 rows, 9.6 rows/s, about 10 s left"
    p.finish("shard-00003", ok=False)
    assert p.text().endswith("1 failed")
    p.finish("shard-00001")
    p.finish("shard-00003")
    assert p.percent() == 100.0 and p.text().startswith("extraction: 4 of 4 shards, 256 of 256 rows")
    p.close()
    report_rows("extraction", "shard-00001", 0, 64)  # closed: no longer counted
    assert p.percent() == 100.0


def test_regeneration_counts_conversations_in_the_shards_rows():
    p = StageProgress("regeneration", _shards(1, rows=10), {"shard-00000"}, artifacts=False)
    report_rows("regeneration", "shard-00000", 3, 6)
    assert p.done["shard-00000"] == 5 and p.finished == set()
    p.close()


class Server:
    def healthy(self):
        return True

    def start(self):
        return "http://server"

    def stop(self):
        pass

    def clean_staging(self):
        return 0

    def stop_unused(self):
        pass


@flow
def _stage_run(shards: list, fail: str | None = None):
    pool = ThreadPoolExecutor(2)
    complete: set[str] = set()

    def work(shard):
        for done in range(0, 65, 16):  # the task's own count, from a worker thread
            report_rows("extraction", shard.name, done, 64)
        if shard.name == fail:
            raise RuntimeError("connection refused")
        complete.add(shard.name)

    def submit(todo, url):
        return [(s, pool.submit(work, s)) for s in todo]

    stage = ShardedStage(
        name="extraction",
        shards=shards,
        pending={s.name for s in shards},
        server=Server(),
        submit=submit,
        is_complete=lambda s: s.name in complete,
        error=ExtractionError,
    )
    return run_sharded_stage(stage)


def _progress_artifacts(state) -> list:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    return [a for a in found if a.type == "progress"]


@pytest.mark.usefixtures("flow_api")
def test_a_stage_run_has_one_progress_artifact_and_ends_at_100():
    state = _stage_run(_shards(5), return_state=True)
    assert state.is_completed()
    [artifact] = _progress_artifacts(state)
    assert artifact.data == 100.0
    assert artifact.description.startswith("extraction: 5 of 5 shards, 320 of 320 rows")

    failed = _stage_run(_shards(3), fail="shard-00001", return_state=True)
    assert failed.is_failed()
    [artifact] = _progress_artifacts(failed)
    assert "2 of 3 shards" in artifact.description and "1 failed" in artifact.description
