"""The one skeleton of a sharded stage (regeneration, extraction, and each node's share of a fanned-out extraction):
start or reuse the stage's vLLM server, submit the pending shards, restart the server once when it died under them
and redo only the shards that failed, recheck what ran against the disk, stop the server.

With nothing pending it starts no server and submits nothing: every shard was found complete on disk, whatever
Prefect's cache holds (a new PREFECT_HOME or result storage has no records of it). The stage's plan says which shards
are pending and how a shard is checked; the stage's flow says how one shard is submitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prefect import get_run_logger

from eyrie.errors import EyrieError
from eyrie.stages.extract import clean_staging
from eyrie.stages.prepare import Shard
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec
from tasks.progress import StageProgress
from tasks.serving import start_server_task, stop_server_task, stop_unused_servers_task


class StageServer(Protocol):
    """What the skeleton does with the stage's server (a real one: `ShardServer`)."""

    def healthy(self) -> bool: ...
    def start(self) -> str: ...  # start or reuse it; its base URL
    def stop(self) -> None: ...
    def clean_staging(self) -> int: ...  # files left in the connector's staging folder, removed; how many
    def stop_unused(self) -> None: ...  # stop the run's other servers, which this stage does not use


@dataclass
class ShardServer:
    """The stage's vLLM server: the extraction server, in `folder`, writing into `staging` (regeneration uses the
    very same server, so the target loads once for both stages)."""

    spec: ServerSpec
    folder: Path
    staging: Path
    startup_timeout_s: float
    run_root: Path
    stage_folder: Path  # the servers this stage may use (each node's, when nodes share the run): kept

    @classmethod
    def of(cls, plan, startup_timeout_s: float) -> ShardServer:
        """The server of an extraction or regeneration plan (its spec, server folder and staging folder)."""
        run = plan.run
        return cls(plan.spec, plan.server_dir, plan.staging, startup_timeout_s, run.root, run.extract)

    def healthy(self) -> bool:
        return VllmServer(self.folder).healthy()

    def start(self) -> str:
        return start_server_task(self.spec, str(self.folder), self.startup_timeout_s)

    def stop(self) -> None:
        stop_server_task(str(self.folder))

    def clean_staging(self) -> int:
        return clean_staging(self.staging)

    def stop_unused(self) -> None:
        stop_unused_servers_task(str(self.run_root), [str(self.stage_folder)], "a sharded stage")


@dataclass
class ShardedStage:
    """One sharded stage's run. `submit(shards, url)` submits one task per shard against the server at `url` and
    returns (shard, future) pairs; `is_complete(shard)` checks a shard on disk (its manifest and files)."""

    name: str  # "extraction", "regeneration": what the messages call it
    shards: list[Shard]
    pending: set[str]
    server: StageServer
    submit: Callable[[list[Shard], str], Iterable[tuple[Shard, object]]]
    is_complete: Callable[[Shard], bool]
    error: type[EyrieError]
    keep_server_after_failure: bool = False


def _ended(fut) -> bool:
    """Whether a shard's future has ended, without asking the Prefect API (its wrapped future, in this process)."""
    wrapped = getattr(fut, "wrapped_future", None)
    done = getattr(wrapped if wrapped is not None else fut, "done", None)
    return bool(done()) if callable(done) else True


def _wait(fut, seconds: float) -> None:
    wait = getattr(fut, "wait", None)  # a Prefect future's: returns after `seconds` at most
    if callable(wait):
        wait(seconds)
    elif isinstance(fut, futures.Future):
        futures.wait([fut], timeout=seconds)


def shard_failures(submitted: Iterable[tuple[Shard, object]], progress: StageProgress | None = None) -> dict[str, str]:
    """Wait for every (shard, future) pair; each shard fails on its own, and all their errors are reported. With
    `progress`, this thread (the flow's) publishes the stage's progress while it waits and as each shard ends."""
    out = {}
    for shard, fut in submitted:
        if progress is not None:
            while not _ended(fut):
                _wait(fut, progress.every_s)
                progress.publish()
        try:
            fut.result()  # type: ignore[attr-defined]
        except Exception as err:
            out[shard.name] = f"{shard.name}: {err}"
        if progress is not None:
            progress.finish(shard.name, ok=shard.name not in out)
            progress.publish()
    return out


def run_sharded_stage(stage: ShardedStage, keep_server: bool = False) -> bool:
    """Run `stage`'s pending shards on its server (see the module's docstring); raises `stage.error` when a shard is
    left incomplete. Returns whether the server is left up (`keep_server`: one this run used stays up for the next
    stage to reuse)."""
    if not stage.pending:
        return False  # no server, no task: every shard is complete on disk
    log = get_run_logger()
    stage.server.stop_unused()  # GPU memory held by servers this stage does not use (export's, evaluation's)
    # A server that does not run leaves staging files nobody will read.
    removed = stage.server.clean_staging() if not stage.server.healthy() else 0
    if removed:
        log.info(f"removed {removed} orphaned staging files")
    todo = [s for s in stage.shards if s.name in stage.pending]
    url = stage.server.start()
    # One progress artifact for this stage run, its shards' rows counted by their tasks, published from here.
    progress = StageProgress(stage.name, stage.shards, stage.pending)
    try:
        failed = shard_failures(stage.submit(todo, url), progress)
        if failed and not stage.server.healthy():
            # Killed or OOM under the shards: start it once more and redo only those (their finished work on disk
            # is kept; only what is missing is sent again).
            log.warning(f"the vLLM server died ({len(failed)} shards failed); restarting it once")
            failed = shard_failures(stage.submit([s for s in todo if s.name in failed], stage.server.start()), progress)
    finally:
        progress.close()
    # A success must never leave work missing: the shards that ran are checked again against the disk. The others
    # were found complete when the stage began and nothing here wrote to them.
    missing = [s.name for s in todo if not stage.is_complete(s)]
    if failed or missing:
        if not stage.keep_server_after_failure:
            stage.server.stop()
        reasons = list(failed.values())
        raise stage.error(
            f"{stage.name} incomplete: {len(missing)} of {len(stage.shards)} shards lack a complete manifest "
            f"({', '.join(missing[:10])}); failures: {'; '.join(reasons[:5])}. Run again (or retry the flow run): "
            "finished shards are kept."
        )
    if keep_server:
        return True
    stage.server.stop()
    # Every request of this run has been answered and moved out of staging, and the server is down: what is left
    # there was written for a client that died (a killed earlier run whose server this run reused).
    removed = stage.server.clean_staging()
    if removed:
        log.info(f"removed {removed} orphaned staging files")
    return False
