"""A cache policy keyed on what determines a stage's output, computed by the library.

Prefect's default policy (inputs + task source + run id) never reuses work across flow runs and throws hours away on
a comment edit. Here a task's identity is its `key` argument: fingerprints of the target and revision, layer ids,
the data's content and the format version. The manifest on disk stays the truth: flows pass `refresh_cache=True`
for work whose manifest is missing, so a cache record that outlived its files is never trusted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy

from eyrie.store import read_json


@dataclass
class KeyedOn(CachePolicy):
    """Cache on the value of one task argument (a fingerprint string), namespaced by task name."""

    argument: str = "key"

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kw) -> str | None:
        value = inputs.get(self.argument)
        return f"eyrie-{task_ctx.task.name}-{value}" if value else None


BY_KEY = KeyedOn()


def unless_missing(task, manifest_path: Path, key: str):
    """`task`, told to recompute when the manifest on disk does not record `key` (the files are the truth)."""
    manifest = read_json(Path(manifest_path))
    return task if manifest and manifest.get("key") == key else task.with_options(refresh_cache=True)
