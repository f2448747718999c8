"""Hub revisions pinned to commits, offline, on the hub cache's own layout: a dataset whose `main` moves from one
snapshot to another gets a new prepare key and its new rows; a pinned run reads the commit it pinned."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import HubDatasetRepo, config_dict

from eyrie.config import DataConfig, parse_config
from eyrie.errors import ConfigError
from eyrie.stages.prepare import is_hub_source, iter_rows, source_fingerprint
from eyrie.target.hub import hub_commit, pin_revisions

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def _row(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]}


@pytest.fixture
def hub_dataset():
    """A dataset repo in the hub cache with two snapshots; yields (repo id, function that points `main` at a
    commit)."""
    rows = {COMMIT_A: ["one", "two"], COMMIT_B: ["one", "two", "three"]}
    repo = HubDatasetRepo(
        {c: {"train.jsonl": "".join(json.dumps(_row(r)) + "\n" for r in texts)} for c, texts in rows.items()}
    )
    yield repo.repo, repo.point_main_at
    repo.remove()


def test_a_moving_main_changes_the_key_and_the_rows(hub_dataset):
    repo, point_main_at = hub_dataset
    data = DataConfig(source=repo)
    assert is_hub_source(data)
    assert hub_commit(repo, "dataset", None) == COMMIT_A
    before = source_fingerprint(data)
    assert [r["messages"][0]["content"] for r in iter_rows(data)] == ["one", "two"]
    assert source_fingerprint(data) == before  # stable while main stays

    point_main_at(COMMIT_B)  # the weekly snapshot grew
    assert hub_commit(repo, "dataset", "main") == COMMIT_B
    assert source_fingerprint(data) != before
    assert [r["messages"][0]["content"] for r in iter_rows(data)] == ["one", "two", "three"]
    # A pinned commit keeps its key and its rows whatever main does.
    pinned = DataConfig(source=repo, revision=COMMIT_A)
    assert source_fingerprint(pinned) == before
    assert len(list(iter_rows(pinned))) == 2


def test_a_run_pins_the_commit_main_points_at(hub_dataset, tmp_path):
    repo, point_main_at = hub_dataset
    config = parse_config(config_dict(tmp_path / "target", source=repo))
    pinned = pin_revisions(config.target, config.data, is_hub_target=False, is_hub_data=True)
    assert pinned.data.revision == COMMIT_A and config.data.revision is None
    assert pinned.target == config.target
    point_main_at(COMMIT_B)
    assert pin_revisions(config.target, config.data, False, True).data.revision == COMMIT_B


def test_an_unknown_revision_is_a_clear_error(hub_dataset):
    repo, _ = hub_dataset
    with pytest.raises(ConfigError, match="cannot resolve dataset .* at revision 'v9'"):
        hub_commit(repo, "dataset", "v9")


def test_local_target_identity_follows_its_weights(tmp_path, tiny_llama):
    """Same file names, sizes and shapes (a fine-tune of the same architecture): a new identity, so no hidden state
    extracted from the old weights is reused."""
    import torch
    from safetensors.torch import load_file, save_file

    from eyrie.config import TargetConfig
    from eyrie.target.metadata import target_identity

    folder = tmp_path / "target"
    shutil.copytree(tiny_llama, folder)
    target = TargetConfig(model=str(folder))
    before = target_identity(target)
    assert target_identity(target) == before
    weights = load_file(str(folder / "model.safetensors"))
    save_file(
        {k: v + torch.finfo(v.dtype).eps * 4 if v.is_floating_point() else v for k, v in weights.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    assert (folder / "model.safetensors").stat().st_size == (tiny_llama / "model.safetensors").stat().st_size
    assert target_identity(target) != before
