"""The cache policy of Eyrie's tasks: keyed on what determines a stage's output, and trusted only while the stage's
manifest on disk says it is done (`eyrie.run.manifest.done`: that key, every listed file there with its size).

Prefect's default policy (inputs + task source + run id) never reuses work across flow runs and throws hours away on
a comment edit. Here a task's identity is its `key` argument: fingerprints of the target and revision, layer ids,
the data's content and the format version, computed by the library. A cache record that outlived its files is never
trusted: while the stage is not done, the task runs (and the stage reuses whatever of its work is whole).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import CachePolicy
from prefect.results import get_result_store

from eyrie.run.manifest import done


@dataclass
class KeyedOn(CachePolicy):
    """Cache on the value of one task argument (a fingerprint string), namespaced by task name. Sharded stages use
    it as is: their flow checks every shard's files once (a stat per file) and refreshes the pending ones."""

    argument: str = "key"

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kw) -> str | None:
        value = inputs.get(self.argument)
        return f"eyrie-{task_ctx.task.name}-{value}" if value else None


BY_KEY = KeyedOn()


@dataclass
class StageDone(KeyedOn):
    """`KeyedOn`, while the manifest at `manifest` (formatted with the task's arguments) is done with that key."""

    manifest: str = "{out_dir}/manifest.json"

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kw) -> str | None:
        cache_key = super().compute_key(task_ctx, inputs, flow_parameters, **kw)
        if cache_key is None or done(Path(self.manifest.format(**inputs)), inputs[self.argument]) is not None:
            return cache_key
        # Not done, yet Prefect holds a result for this key: it outlived its files. A key of this run alone makes
        # the task run without it; done again, the stage's output is what that record describes.
        return f"{cache_key}-redo-{uuid.uuid4().hex}" if get_result_store().exists(cache_key) else cache_key


def stage_task(name: str, manifest: str = "{out_dir}/manifest.json", **options):
    """Prefect's `task` for a stage: cached on its `key` argument while its manifest is done (see StageDone)."""
    return task(name=name, cache_policy=StageDone(manifest=manifest), **options)
