"""Preflight covers the run, not only the target: the data source opened and a sample of its rows read as prepare
reads them, the run folder writable, and this host's GPUs judged where the run runs here (and said to be not
judged where it does not)."""

from __future__ import annotations

import json
import tempfile

import pytest
from conftest import config_dict

from eyrie.config import DataConfig, parse_config
from eyrie.stages.preflight import run_preflight
from eyrie.stages.preflight.node import judge_host
from eyrie.stages.preflight.report import report_markdown, report_text
from eyrie.stages.preflight.run_inputs import check_data_sample, check_run_folder

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_missing_data_file_is_refused(tmp_path):
    [msg], _, _ = check_data_sample(DataConfig(source=str(tmp_path / "nope.jsonl")))
    assert "nope.jsonl does not exist" in msg


def test_data_in_another_layout_is_refused_naming_the_layouts_read(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "response": "hello"}] * 5)
    [msg], warnings, _ = check_data_sample(DataConfig(source=str(data)))
    assert "none of the first 5 rows" in msg and "no_conversation_field" in msg and "`messages`" in msg
    assert warnings == []


def test_some_unusable_rows_are_a_warning_and_good_data_passes(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [CHAT, CHAT, {"messages": [{"role": "user", "content": "only"}]}])
    failures, [warning], _ = check_data_sample(DataConfig(source=str(data)))
    assert failures == [] and "1 of the first 3 rows" in warning and "no_assistant_turn" in warning
    assert check_data_sample(DataConfig(source=str(_jsonl(tmp_path / "ok.jsonl", [CHAT])))) == ([], [], [])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    [msg], _, _ = check_data_sample(DataConfig(source=str(empty)))
    assert "holds no rows" in msg


def test_a_hub_dataset_is_noted_not_downloaded():
    failures, warnings, [note] = check_data_sample(DataConfig(source="org/some-chat-dataset"))
    assert failures == warnings == [] and "checked when prepare reads it" in note


def test_a_run_folder_that_is_a_file_or_cannot_be_written_is_refused(tmp_path, monkeypatch):
    assert check_run_folder(tmp_path / "run") == []  # not there yet, its parent writable
    (tmp_path / "file").write_text("x")
    [msg] = check_run_folder(tmp_path / "file")
    assert "is a file" in msg
    [msg] = check_run_folder(tmp_path / "file" / "run")
    assert "a file" in msg and str(tmp_path / "file") in msg

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)  # root writes through permissions; a ro mount it cannot
    [msg] = check_run_folder(tmp_path / "run")
    assert "cannot be written" in msg and "Read-only file system" in msg


def _config(**train):
    return parse_config({"target": {"model": "m"}, "data": {"source": "d"}, "train": train})


def test_cuda_without_a_gpu_is_refused_where_the_run_runs_and_not_judged_elsewhere():
    cuda = _config(device="cuda")
    [msg], [] = judge_host(cuda.train, cuda.target, runs_here=True, gpus=0)
    assert "train.device is cuda but no GPU is visible" in msg
    [], [said] = judge_host(cuda.train, cuda.target, runs_here=False, gpus=0)
    assert "train.device cuda" in said and "not judge" not in said and "the run's own preflight" in said
    assert judge_host(cuda.train, cuda.target, runs_here=True, gpus=1) == ([], [])
    assert judge_host(_config(device="cpu").train, cuda.target, runs_here=True, gpus=0) == ([], [])
    auto = _config()  # auto on one device: a CPU run here
    assert judge_host(auto.train, auto.target, runs_here=True, gpus=0) == ([], [])
    many = _config(devices=8)
    [], [said] = judge_host(many.train, many.target, runs_here=True, gpus=0)
    assert "train.devices 8" in said


def test_the_whole_preflight_refuses_bad_data_and_folder_and_says_what_it_cannot_judge(
    tiny_llama, tmp_path, monkeypatch
):
    import eyrie.stages.preflight.node as node

    monkeypatch.setattr(node, "gpu_count", lambda: 0)
    bad = _jsonl(tmp_path / "bad.jsonl", [{"text": "no conversation"}] * 3)
    (tmp_path / "taken").write_text("a file where the run folder goes")
    config = parse_config(config_dict(tiny_llama, source=bad, train={"device": "cuda"}))
    report = run_preflight(config, tmp_path / "taken", raise_on_failure=False, serve=False, runs_here=True)
    text = "\n".join(report.failures)
    assert "none of the first 3 rows" in text and "is a file" in text and "train.device is cuda" in text
    assert report_text(report).startswith(f"preflight FAILED ({len(report.failures)})")

    good = parse_config(config_dict(tiny_llama, train={"device": "cuda"}))
    report = run_preflight(good, tmp_path / "run", raise_on_failure=False, serve=False)  # `eyrie preflight`
    assert report.failures == [] and report.unjudged
    first = report_text(report).splitlines()
    assert first[0].startswith("preflight passed") and "cannot judge" in first[0]
    assert first[1].startswith("  not judged on this host: the GPUs (train.device cuda)")
    assert "not judged on this host" in report_markdown(report).splitlines()[0]


@pytest.mark.parametrize("source", ["missing.jsonl"])
def test_eyrie_preflight_refuses_a_missing_data_file(tiny_llama, tmp_path, source, capsys):
    from flows.cli import main

    config = tmp_path / "c.yaml"
    import yaml

    config.write_text(yaml.safe_dump(config_dict(tiny_llama, source=tmp_path / source)))
    assert main(["preflight", "--config", str(config), "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("preflight FAILED (1)") and "missing.jsonl does not exist" in err


def test_a_presets_default_ids_on_another_layer_count_are_a_warning():
    from eyrie.stages.preflight.target import foreign_default_layer_ids

    # The Kimi preset's [2, 30, 58] are the default of a 61-layer target: on 80 layers, a warning naming both.
    said = foreign_default_layer_ids([2, 30, 58], 80)
    assert "default ids of a 61-layer target" in said and "80 layers (its default: [2, 40, 77])" in said
    assert foreign_default_layer_ids([2, 30, 58], 61) is None  # on the target they were made for
    assert foreign_default_layer_ids([3, 30, 58], 80) is None  # ids chosen otherwise: the user's choice
    assert foreign_default_layer_ids(None, 80) is None  # absent: the default of this target (2, L//2, L-3)
