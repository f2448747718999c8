"""Hugging Face hub revisions pinned to commits.

A branch such as `main` moves: keyed on the branch name, a weekly retraining against a grown dataset or an updated
target would find every stage cached and retrain nothing. So a run resolves each hub revision (the target's and the
dataset's) to the commit it points at now, once, at its start, and works on that commit throughout: the stage keys
change exactly when a commit does, and the run's config records which commits it used.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from eyrie.config import DataConfig, TargetConfig
from eyrie.errors import ConfigError


def hub_commit(repo_id: str, repo_type: str, revision: str | None) -> str:
    """The commit `revision` (None: the default branch) of a hub repo points at now: asked of the hub, or read
    from the local hub cache when offline (HF_HUB_OFFLINE=1)."""
    from huggingface_hub import HfApi, snapshot_download

    try:
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            path = snapshot_download(repo_id, repo_type=repo_type, revision=revision, local_files_only=True)
            return os.path.basename(path)
        sha = HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision).sha
    except Exception as err:  # the hub client raises many types; all mean "cannot resolve this revision"
        raise ConfigError(
            f"cannot resolve {repo_type} {repo_id!r} at revision {revision or 'main'!r} to a commit "
            f"({type(err).__name__}: {err}): check the id and revision, or download it first when "
            "offline"
        ) from None
    if not sha:
        raise ConfigError(f"the hub gave no commit for {repo_type} {repo_id!r} at {revision or 'main'!r}")
    return sha


class Pinned(NamedTuple):
    """The target and data sections with their hub revisions pinned (`PipelineConfig.model_copy(update=
    pinned._asdict())` puts them back in a run's config)."""

    target: TargetConfig
    data: DataConfig


def pin_revisions(target: TargetConfig, data: DataConfig, is_hub_target: bool, is_hub_data: bool) -> Pinned:
    """`target` and `data` with a hub target's and hub dataset's revisions replaced by the commits they resolve
    to."""
    if is_hub_target:
        target = target.model_copy(update={"revision": hub_commit(target.model, "model", target.revision)})
    if is_hub_data:
        data = data.model_copy(update={"revision": hub_commit(data.source, "dataset", data.revision)})
    return Pinned(target, data)
