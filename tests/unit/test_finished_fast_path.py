"""`eyrie run`'s "nothing to do" fast path (flows/finished.py): it fires only when nothing any stage could read
changed since the run that finished the folder; any change to the config, `--until`, a file a config value names,
the run folder, the code or the environment makes the flow run. In-process, no Prefect."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from eyrie.config import load_config
from eyrie.run.folder import RunFolder
from eyrie.run.lock import LOCK
from flows import finished

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUTS = {"run_dir": "x", "drafter": "x/export/drafter", "acceptance_length": 2.5, "warnings": []}


@pytest.fixture
def done(tmp_path, monkeypatch):
    """A demo config on its own data and target folder copies, and a run folder a (pretend) flow finished."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    shutil.copy(os.path.join(ROOT, "eyrie/data/demo_chat.jsonl"), tmp_path / "data.jsonl")
    config = load_config(os.path.join(ROOT, "configs/demo.yaml"))
    config = config.model_copy(
        update={
            "target": config.target.model_copy(update={"model": "target"}),
            "data": config.data.model_copy(update={"source": "data.jsonl"}),
        }
    )
    run = tmp_path / "run"
    (run / "prepare").mkdir(parents=True)
    (run / "prepare" / "manifest.json").write_text('{"key": "k"}')
    _linked_weights(run)
    with RunFolder(str(run)).lock():  # what the flow holds, in this process
        pass
    assert finished.record(config, str(run), "evaluate", OUTPUTS)
    return config, run


def test_fires_when_nothing_changed(done):
    config, run = done
    assert finished.finished_outputs(config, str(run), "evaluate") == OUTPUTS
    assert finished.finished_outputs(config, str(run), "evaluate") == OUTPUTS  # checking changes nothing


def test_any_config_field_or_until_turns_it_off(done):
    config, run = done
    changed = config.model_copy(update={"data": config.data.model_copy(update={"max_length": 128})})
    assert finished.finished_outputs(changed, str(run), "evaluate") is None
    changed = config.model_copy(update={"train": config.train.model_copy(update={"log_every_steps": 7})})
    assert finished.finished_outputs(changed, str(run), "evaluate") is None
    assert finished.finished_outputs(config, str(run), "train") is None
    assert finished.finished_outputs(config, str(run), "evaluate") == OUTPUTS  # the record itself is kept


def test_files_it_names_and_the_run_folder_turn_it_off(done):
    config, run = done
    data = run.parent / "data.jsonl"
    text = data.read_text()
    with open(data, "r+") as f:  # the same size, the same inode: a rewrite in place
        f.write(text.replace("apple", "appel", 1))
    assert finished.finished_outputs(config, str(run), "evaluate") is None


def _linked_weights(run, rewrite=False):
    elsewhere = run.parent / "elsewhere.safetensors"
    if rewrite:
        elsewhere.write_bytes(b"new weights!")  # the same size, in place
    else:
        elsewhere.write_bytes(b"old weights!")
        (run.parent / "target" / "model.safetensors").symlink_to(elsewhere)


@pytest.mark.parametrize(
    "change",
    [
        lambda run: (run / "prepare" / "manifest.json").unlink(),  # `eyrie verify` removed a damaged stage
        lambda run: (run / "prepare" / "extra.bin").write_bytes(b"1"),
        lambda run: (run.parent / "target" / "config.json").write_text('{"a": 1}'),  # the target's files
        lambda run: _linked_weights(run, rewrite=True),  # a weight file linked from elsewhere, rewritten there
    ],
)
def test_a_change_on_disk_turns_it_off(done, change):
    config, run = done
    change(run)
    assert finished.finished_outputs(config, str(run), "evaluate") is None


def test_the_environment_turns_it_off_and_is_not_written(done, monkeypatch):
    """A variable that reaches Eyrie's libraries or children turns the fast path off; a new shell's own (no child
    sees it) and a secret (never passed on, never written) do not."""
    config, run = done
    monkeypatch.setenv("SSH_CLIENT", "10.0.0.9 51234 22")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    assert finished.finished_outputs(config, str(run), "evaluate") == OUTPUTS
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TORCH_SDPA")
    assert finished.finished_outputs(config, str(run), "evaluate") is None
    with RunFolder(str(run)).lock():
        pass
    assert finished.record(config, str(run), "evaluate", OUTPUTS)
    assert "hf_secret_value" not in (run / finished.RECORD).read_text()
    assert finished.finished_outputs(config, str(run), "evaluate") == OUTPUTS
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the tests run with 1 (conftest)
    assert finished.finished_outputs(config, str(run), "evaluate") is None


def test_no_record_after_another_holder_or_for_hub_inputs(done):
    config, run = done
    (run / LOCK).write_text("pid 1 on elsewhere\n")  # another run held the folder after our flow
    assert not finished.record(config, str(run), "evaluate", OUTPUTS)
    assert finished.finished_outputs(config, str(run), "evaluate") is None  # the old record went too
    with RunFolder(str(run)).lock():
        pass
    hub = config.model_copy(update={"target": config.target.model_copy(update={"model": "org/model"})})
    assert finished.state(hub, str(run), "evaluate") is None  # a moving revision: the flow pins it
    assert not finished.record(hub, str(run), "evaluate", OUTPUTS)


def test_the_fast_path_imports_no_prefect_or_torch():
    import subprocess

    code = (
        "import sys; from flows import finished; from eyrie.config import load_config; "
        "finished.finished_outputs(load_config('configs/demo.yaml'), 'runs/none-such', 'evaluate'); "
        "print([m for m in ('prefect', 'torch', 'transformers', 'vllm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_flows_and_status_import_no_torch():
    """A flow process whose stages are done (a cached re-run, a resumed one) pays Prefect's import, not torch's
    (2.3 s of CPU here): the modules that read hidden-state files import torch where they read them."""
    import subprocess

    code = (
        "import sys, flows.cli, flows.pipeline, flows.extract, flows.regenerate, flows.fanout, eyrie.ops.status; "
        "print([m for m in ('torch', 'transformers', 'vllm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_eyrie_run_takes_it_only_while_nothing_changed(tmp_path, monkeypatch, capsys):
    """The command's wiring, with a stand-in for the flow (counting its runs): the second run prints the outputs
    without the flow; a config field edited, --always-flow or EYRIE_ALWAYS_FLOW=1, and the flow runs again."""
    import types

    import yaml

    from flows.cli import main

    monkeypatch.delenv("EYRIE_ALWAYS_FLOW", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    shutil.copy(os.path.join(ROOT, "eyrie/data/demo_chat.jsonl"), tmp_path / "data.jsonl")
    raw = yaml.safe_load(open(os.path.join(ROOT, "configs/demo.yaml")))
    raw["target"]["model"], raw["data"]["source"] = "target", "data.jsonl"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    flows_run = []

    def pipeline_flow(config, run_dir, until):
        with RunFolder(run_dir).lock():
            (Path(run_dir) / "done.txt").write_text(str(config.data.max_length))
        flows_run.append(config.data.max_length)
        return dict(OUTPUTS, run_dir=run_dir)

    monkeypatch.setitem(sys.modules, "flows.pipeline", types.SimpleNamespace(pipeline_flow=pipeline_flow))
    argv = ["run", "--config", str(cfg), "--run-dir", "run"]
    assert main(argv) == 0 and flows_run == [256]
    assert main(argv) == 0 and flows_run == [256]
    assert "Nothing to do: run finished" in capsys.readouterr().out
    raw["data"]["max_length"] = 128
    cfg.write_text(yaml.safe_dump(raw))
    assert main(argv) == 0 and flows_run == [256, 128]
    assert main(argv) == 0 and flows_run == [256, 128]
    assert main([*argv, "--always-flow"]) == 0 and flows_run == [256, 128, 128]
    monkeypatch.setenv("EYRIE_ALWAYS_FLOW", "1")
    assert main(argv) == 0 and flows_run == [256, 128, 128, 128]


@pytest.mark.parametrize("given, waits", [(None, 180), ("45", 45)])
def test_the_eyrie_command_waits_for_prefects_temporary_server_longer_than_prefects_20_s(tmp_path, given, waits):
    """Without the Makefile too: the temporary server's first start migrates its database, 15-23 s on a loaded
    2-core machine, past Prefect's default wait of 20 s. An operator's value wins."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    if given:
        env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = given
    code = (
        f"from flows.cli import main; main(['status', '--run-dir', {str(tmp_path / 'none')!r}]); "
        "from prefect.settings import get_current_settings; "
        "print(get_current_settings().server.ephemeral.startup_timeout_seconds)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(waits)
