"""The cache policy of Eyrie's tasks: keyed on what determines a stage's output, and trusted only while the stage's
manifest on disk says it is done (`eyrie.run.manifest.finished_manifest`: that key, every listed file there with its
size).

Every task is made by `eyrie_task` (or `stage_task`, `keyed_task` on top of it), so its results are JSON.

Prefect's default policy (inputs + task source + run id) never reuses work across flow runs and throws hours away on
a comment edit. Here a task's identity is its `key` argument: fingerprints of the target and revision, layer ids,
the data's content and the format version, computed by the library. A cache record that outlived its files is never
trusted: while the stage is not done, the task runs (and the stage reuses whatever of its work is whole).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect._internal.compatibility.blocks import call_explicitly_sync_block_method
from prefect.cache_policies import NO_CACHE, CachePolicy
from prefect.results import get_default_result_storage, get_result_store
from prefect.serializers import JSONSerializer

from eyrie.run.manifest import finished_manifest


@dataclass
class KeyedOn(CachePolicy):
    """Cache on the value of one task argument (a fingerprint string), namespaced by task name. Sharded stages use
    it as is: their flow checks every shard's files once (a stat per file) and refreshes the pending ones."""

    argument: str = "key"  # or "job.key": the `key` field of the task's `job` argument

    def record_key(self, task_ctx, inputs: dict[str, Any]) -> str | None:
        """The result record's key: the task's name and the argument's value (None: no caching)."""
        value = key_of(inputs, self.argument)
        return f"eyrie-{task_ctx.task.name}-{value}" if value else None

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kw) -> str | None:
        cache_key = self.record_key(task_ctx, inputs)
        if cache_key is None:
            return None
        if record_serializer(cache_key) in (None, "json"):
            return cache_key
        # A record that is not JSON (a pickle: from an Eyrie before JSON results, or planted in the shared result
        # storage) is never read: Prefect would unpickle it, even only to check that it exists. The task runs
        # under a key of this run alone; the stage reuses whatever of its work is whole on disk.
        get_run_logger().warning(
            f"the cached result {cache_key!r} in Prefect's result storage is not JSON and is not used: delete it "
            "(an Eyrie before JSON results wrote it, or someone else did)"
        )
        return f"{cache_key}-untrusted-{uuid.uuid4().hex}"


def record_serializer(key: str) -> str | None:
    """The serializer a stored result record names (its type: json, pickle, ...), read as plain JSON without
    deserializing it (Prefect's own `exists` and `read` unpickle a pickle record); None when there is no record,
    "unreadable" when the file is not a record."""
    store = get_result_store()
    meta_storage = getattr(store, "metadata_storage", None)
    storage = meta_storage or getattr(store, "result_storage", None) or get_default_result_storage(_sync=True)
    try:
        content = call_explicitly_sync_block_method(storage, "read_path", (key,), {})
    except (OSError, ValueError):
        return None  # no such record (local storage raises ValueError for a missing path)
    try:
        record = json.loads(content)
        meta = record if meta_storage is not None else record["metadata"]
        return str(meta["serializer"]["type"])
    except (ValueError, KeyError, TypeError):
        return "unreadable"


def folder_tag(folder: Path) -> str:
    """A stage folder's part of its result records' keys (`StageDone`)."""
    return hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:12]


def key_of(inputs: dict[str, Any], argument: str) -> Any:
    """`inputs[argument]`, or with a dotted name (`job.key`) that argument's attribute."""
    head, *attrs = argument.split(".")
    value = inputs.get(head)
    for attr in attrs:
        value = getattr(value, attr, None)
    return value


@dataclass
class StageDone(KeyedOn):
    """`KeyedOn`, while the manifest at `manifest` (formatted with the task's arguments) is done with that key."""

    manifest: str = "{out_dir}/manifest.json"  # or "{job.out_dir}/manifest.json"

    def record_key(self, task_ctx, inputs: dict[str, Any]) -> str | None:
        # Per folder: a result names its stage's paths, so a moved run folder (or another folder of the same key)
        # runs the task, which finds its stage done on disk and names the paths where they are now. (The record
        # checked for a pickle is this one, the key the task's result is read and written under.)
        cache_key = super().record_key(task_ctx, inputs)
        return cache_key and f"{cache_key}-{folder_tag(Path(self.manifest.format(**inputs)).parent)}"

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kw) -> str | None:
        cache_key = super().compute_key(task_ctx, inputs, flow_parameters, **kw)
        if cache_key is None or "-untrusted-" in cache_key:
            return cache_key
        if finished_manifest(Path(self.manifest.format(**inputs)), key_of(inputs, self.argument)) is not None:
            return cache_key
        # Not done, yet Prefect holds a result for this key: it outlived its files. A key of this run alone makes
        # the task run without it; done again, the stage's output is what that record describes.
        return f"{cache_key}-redo-{uuid.uuid4().hex}" if get_result_store().exists(cache_key) else cache_key


def encode_failure(obj: Any) -> Any:
    """What JSON cannot hold of a task's outcome: the exception a failed task stores as its result, kept as its type
    and message. Anything else is an error (a result that is not plain JSON must fail loudly, not come back as
    something else on a cache hit)."""
    if isinstance(obj, BaseException):
        return {"exception": type(obj).__name__, "message": str(obj)}
    raise TypeError(f"a task result must be JSON: {type(obj).__name__} is not")


# Task results as JSON, never pickles: result storage is shared by every GPU node, and unpickling a planted record at
# the next cache hit would run its code there. Eyrie's results are JSON-shaped (manifests, reports, paths as strings);
# no object decoder either, so a record can name no class to import.
JSON_RESULTS = JSONSerializer(object_encoder="tasks.caching.encode_failure", object_decoder=None)


def eyrie_task(name: str, cache_policy: CachePolicy | None = None, **options):
    """Prefect's `task` as every Eyrie task uses it: with a `cache_policy`, its results are persisted as JSON
    (`JSON_RESULTS`); without one, nothing is persisted and nothing is cached (a check such as preflight, or the
    server's start, must run each time it is called, even twice with the same arguments in one flow run)."""
    if cache_policy is None:
        return task(name=name, cache_policy=NO_CACHE, persist_result=False, **options)
    return task(name=name, cache_policy=cache_policy, result_serializer=JSON_RESULTS, **options)


def keyed_task(name: str, argument: str = "key", **options):
    """An Eyrie task cached on one argument's value alone (`KeyedOn`): a shard of a sharded stage, whose flow checks
    every shard's files once and refreshes the pending ones."""
    return eyrie_task(name, cache_policy=KeyedOn(argument=argument), **options)


def stage_task(name: str, manifest: str = "{out_dir}/manifest.json", argument: str = "key", **options):
    """An Eyrie task for a stage: cached on its `key` argument (`argument`) while its manifest is done (see
    StageDone)."""
    return eyrie_task(name, cache_policy=StageDone(argument=argument, manifest=manifest), **options)
