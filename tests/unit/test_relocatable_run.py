"""A run folder is relocatable: the train and export manifests keep their paths relative to their own folder, and
what reads them gets the paths under the folder's current place; a manifest written before (absolute paths) still
reads, or, where its path is gone, is written again once with a line that says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyrie.config import parse_config
from eyrie.run.files import atomic_write_json, located, portable, read_json
from eyrie.run.manifest import files_under, list_files
from eyrie.stages import export as export_stage
from eyrie.stages.train import trainer

CONFIG = parse_config({"target": {"model": "m"}, "data": {"source": "d.jsonl"}})


def test_a_path_in_the_run_folder_is_kept_relative_and_one_outside_absolute(tmp_path):
    run = tmp_path / "run"
    assert portable(run / "train" / "k" / "checkpoints" / "3", run / "train") == "k/checkpoints/3"
    assert portable(run / "train" / "k" / "checkpoints" / "3", run / "export") == "../train/k/checkpoints/3"
    assert portable(tmp_path / "drafters" / "v1", run / "export") == str(tmp_path / "drafters" / "v1")
    moved = tmp_path / "moved"
    assert located("../train/k/checkpoints/3", moved / "export") == str(moved / "train" / "k" / "checkpoints" / "3")
    assert located("/elsewhere/v1", moved / "export") == "/elsewhere/v1" and located(None, moved) is None


def _trained(out_dir: Path) -> Path:
    checkpoint = out_dir / "k" / "checkpoints" / "2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"w" * 8)
    (out_dir / "k" / "train.log").write_text("log\n")
    return checkpoint


def test_a_moved_train_stage_is_reused_and_names_its_checkpoint_where_it_is(tmp_path):
    out = tmp_path / "run" / "train"
    checkpoint = _trained(out)
    manifest = {
        "stage": "train",
        "key": "k",
        "checkpoint": portable(checkpoint, out),
        "log": portable(out / "k" / "train.log", out),
        "resumed_from": None,
        "files": list_files(out, files_under(checkpoint)),
    }
    atomic_write_json(out / "manifest.json", manifest)
    assert str(tmp_path) not in (out / "manifest.json").read_text()
    (tmp_path / "run").rename(tmp_path / "moved")
    moved = tmp_path / "moved" / "train"
    done = trainer.run_training(CONFIG, moved, "k", None, [])  # returned before anything reads the data
    assert done["checkpoint"] == str(moved / "k" / "checkpoints" / "2")
    assert Path(done["log"]).read_text() == "log\n"


def test_a_train_manifest_of_absolute_paths_whose_folder_moved_is_written_again_with_a_line(tmp_path, monkeypatch):
    out = tmp_path / "run" / "train"
    checkpoint = _trained(out)
    old = {
        "stage": "train",
        "key": "k",
        "checkpoint": str(checkpoint),
        "files": list_files(out, files_under(checkpoint)),
    }
    atomic_write_json(out / "manifest.json", old)
    assert trainer.run_training(CONFIG, out, "k", None, [])["checkpoint"] == str(checkpoint)  # not moved: as it is
    (tmp_path / "run").rename(tmp_path / "moved")
    lines = []

    class Resumed(Exception):
        pass

    def resume(*args, **kwargs):
        raise Resumed

    monkeypatch.setattr(trainer, "adopt_lineage", resume)  # where training (resuming its checkpoints) would go on
    with pytest.raises(Resumed):
        trainer.run_training(CONFIG, tmp_path / "moved" / "train", "k", None, [], log=lines.append)
    assert lines == [f"the train manifest names {checkpoint}, which is not there (the run folder moved): written again"]


def test_a_moved_export_is_reused_without_serving_and_names_its_drafter_where_it_is(tmp_path, monkeypatch):
    run = tmp_path / "run"
    checkpoint = _trained(run / "train")
    (checkpoint / "config.json").write_text("{}")
    served = []

    def export_drafter(checkpoint, out_dir, *args):
        (out_dir / "drafter").mkdir(parents=True)
        (out_dir / "drafter" / "model.safetensors").write_bytes(b"d" * 8)
        files = list_files(out_dir, files_under(out_dir / "drafter"))
        return {"key": "e", "drafter": str(out_dir / "drafter"), "checkpoint": str(checkpoint), "files": files}

    monkeypatch.setattr(export_stage, "export_drafter", export_drafter)
    monkeypatch.setattr(export_stage, "prove_servable", lambda client, probe: {"completion": "ok"})

    def serve(drafter):
        served.append(drafter)

    made = export_stage.export_and_prove(checkpoint, run / "export", "m", [1], 64, "e", serve, [])
    assert served == [str(run / "export" / "drafter")] and made["drafter"] == served[0]
    recorded = read_json(run / "export" / "manifest.json")
    assert recorded["drafter"] == "drafter" and recorded["checkpoint"] == "../train/k/checkpoints/2"
    assert recorded["seconds"] >= 0  # the stage's own time, for `eyrie status`
    run.rename(tmp_path / "moved")
    moved = tmp_path / "moved"
    again = export_stage.export_and_prove(checkpoint, moved / "export", "m", [1], 64, "e", serve, [])
    assert len(served) == 1  # no server started
    assert again["drafter"] == str(moved / "export" / "drafter")
    assert again["checkpoint"] == str(moved / "train" / "k" / "checkpoints" / "2")
    # A manifest of absolute paths (written before they were kept relative): the drafter is where its files are.
    atomic_write_json(moved / "export" / "manifest.json", {**recorded, "drafter": str(run / "export" / "drafter")})
    assert export_stage.export_and_prove(checkpoint, moved / "export", "m", [1], 64, "e", serve, [])["drafter"] == (
        str(moved / "export" / "drafter")
    )
    assert json.loads((moved / "export" / "manifest.json").read_text())["drafter"] == str(run / "export" / "drafter")
