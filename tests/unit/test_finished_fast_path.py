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


def test_an_input_changed_while_the_run_went_on_is_not_recorded(done, capsys):
    """The inputs are taken before the flow: data appended after prepare read it is not recorded as seen (it was,
    when the state was taken at the end), and the line names it."""
    config, run = done
    begun = finished.begin(config, str(run), "evaluate")
    with open(run.parent / "data.jsonl", "a") as f:  # appended while the run went on
        f.write('{"messages": [{"role": "user", "content": "late"}]}\n')
    with RunFolder(str(run)).lock():
        pass
    assert not finished.record(config, str(run), "evaluate", OUTPUTS, begun)
    assert "data.jsonl (a file or folder the config names) changed while the run went on" in capsys.readouterr().out
    assert finished.finished_outputs(config, str(run), "evaluate") is None


def test_a_path_the_run_makes_and_the_promotion_folder_it_writes_are_taken_at_the_end(done, tmp_path):
    """A fresh clone's first run builds its tiny target (missing when the run began) and a promotion folder is
    written by the run: neither is a change that keeps the record away."""
    config, run = done
    config = config.model_copy(
        update={
            "target": config.target.model_copy(update={"model": str(tmp_path / "built/target")}),
            "promotion": config.promotion.model_copy(update={"dir": "drafters"}),
        }
    )
    (tmp_path / "drafters").mkdir()
    begun = finished.begin(config, str(run), "evaluate")
    assert begun is not None and finished.state(config, str(run), "evaluate") is None  # not there yet
    (tmp_path / "built" / "target").mkdir(parents=True)
    (tmp_path / "built" / "target" / "config.json").write_text("{}")
    (tmp_path / "drafters" / "history.jsonl").write_text("{}\n")
    with RunFolder(str(run)).lock():
        pass
    assert finished.record(config, str(run), "evaluate", OUTPUTS, begun)
    assert finished.finished_outputs(config, str(run), "evaluate") == OUTPUTS


def test_what_a_library_writes_into_the_flows_environment_keeps_the_record_and_reaches_no_child(
    tmp_path, monkeypatch, capsys
):
    """Importing vLLM sets TORCHINDUCTOR_COMPILE_THREADS=1 (and more) in the flow's process: the second run of
    `eyrie run` then went through the flow (49.6 s on the demo) and the trainer compiled on one thread. The run's
    children and its record get the environment of its start."""
    import types

    from eyrie.run.environment import child_environment

    monkeypatch.delenv("EYRIE_ALWAYS_FLOW", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    cfg = _cli_config(tmp_path, monkeypatch)
    seen = []

    def pipeline_flow(config, run_dir, until):
        with RunFolder(run_dir).lock():
            monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # what `import vllm` does
            seen.append(child_environment().get("TORCHINDUCTOR_COMPILE_THREADS"))
        return dict(OUTPUTS, run_dir=run_dir)

    monkeypatch.setitem(sys.modules, "flows.pipeline", types.SimpleNamespace(pipeline_flow=pipeline_flow))
    from flows.cli import main

    assert main(["run", "--config", str(cfg), "--run-dir", "run"]) == 0 and seen == [None]
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")  # the next process starts without it
    assert main(["run", "--config", str(cfg), "--run-dir", "run"]) == 0 and seen == [None]
    assert "Nothing to do: run finished" in capsys.readouterr().out


def _cli_config(tmp_path, monkeypatch) -> Path:
    import yaml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    shutil.copy(os.path.join(ROOT, "eyrie/data/demo_chat.jsonl"), tmp_path / "data.jsonl")
    raw = yaml.safe_load(open(os.path.join(ROOT, "configs/demo.yaml")))
    raw["target"]["model"], raw["data"]["source"] = "target", "data.jsonl"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


def test_a_moved_run_folder_is_reused_and_its_outputs_printed_where_it_is(done, capsys):
    config, run = done
    outputs = {**OUTPUTS, "run_dir": str(run), "drafter": str(run / "export" / "drafter"), "promotion": None}
    with RunFolder(str(run)).lock():
        pass
    assert finished.record(config, str(run), "evaluate", outputs)
    assert str(run) not in (run / finished.RECORD).read_text()  # relative to the folder
    moved = run.with_name("moved")
    run.rename(moved)
    assert finished.finished_outputs(config, str(moved), "evaluate") == {
        **outputs,
        "run_dir": str(moved),
        "drafter": str(moved / "export" / "drafter"),
    }
    # A record of absolute paths (written before they were kept relative), its folder moved: the flow, once.
    import json

    recorded = json.loads((moved / finished.RECORD).read_text())
    old = {"state": recorded["state"], "outputs": outputs}  # no format: absolute, naming the old place
    (moved / finished.RECORD).write_text(json.dumps(old))
    assert finished.finished_outputs(config, str(moved), "evaluate") is None
    assert f"was finished at {run}" in capsys.readouterr().out
    moved.rename(run)  # back where it was recorded: read as it is
    assert finished.finished_outputs(config, str(run), "evaluate") == outputs


@pytest.mark.parametrize("source", ["squad", "org/chats"])
def test_a_hub_dataset_and_a_moving_revision_are_pinned_like_the_flow_pins_them(done, monkeypatch, source):
    """A bare hub id such as `squad` was no path (no `/`) and the fast path vouched for it unpinned; an `org/name`
    turned the fast path off. Both are resolved to the commit they point at now: a moved `main` runs the flow."""
    import eyrie.target.hub as hub

    config, run = done
    commits = {"main": "1" * 40}
    asked = []

    def hub_commit(repo_id, repo_type, revision):
        asked.append((repo_id, repo_type, revision))
        return commits[revision or "main"]

    monkeypatch.setattr(hub, "hub_commit", hub_commit)
    config = config.model_copy(update={"data": config.data.model_copy(update={"source": source})})
    with RunFolder(str(run)).lock():
        pass
    assert finished.record(config, str(run), "evaluate", OUTPUTS)
    assert (source, "dataset", None) in asked
    assert finished.finished_outputs(config, str(run), "evaluate") == OUTPUTS
    commits["main"] = "2" * 40  # main moved
    assert finished.finished_outputs(config, str(run), "evaluate") is None


def test_a_link_loop_is_walked_once_and_a_cache_folder_is_not_walked(done, tmp_path, monkeypatch):
    config, run = done
    (tmp_path / "target" / "loop").symlink_to(".")  # target/loop/loop/... until the kernel's link limit
    tree = finished._tree(tmp_path / "target")
    assert len(tree) < 10, len(tree)
    cache = tmp_path / "hf"
    (cache / "hub").mkdir(parents=True)
    (cache / "hub" / "blob").write_bytes(b"x")
    server_env = {**config.extraction.server_env, "HF_HOME": str(cache)}
    config = config.model_copy(update={"extraction": config.extraction.model_copy(update={"server_env": server_env})})
    with RunFolder(str(run)).lock():
        pass
    assert finished.record(config, str(run), "evaluate", OUTPUTS)
    assert finished.state(config, str(run), "evaluate")["paths"][str(cache)][1][1] == "a cache"
    (cache / "hub" / "another").write_bytes(b"y")  # vLLM or the hub writes its cache during every run
    assert finished.finished_outputs(config, str(run), "evaluate") == OUTPUTS


def test_a_hub_target_at_a_revision_is_pinned_and_its_revision_is_no_path(done, monkeypatch):
    """A hub target turned the fast path off (an `org/name` that is no path), and so would a revision such as
    `refs/pr/1`: both are resolved to the commit the revision points at now."""
    import eyrie.target.hub as hub

    config, run = done
    commits = {"refs/pr/1": "1" * 40}
    monkeypatch.setattr(hub, "hub_commit", lambda repo_id, repo_type, revision: commits[revision])
    target = config.target.model_copy(update={"model": "org/model", "revision": "refs/pr/1"})
    config = config.model_copy(update={"target": target})
    with RunFolder(str(run)).lock():
        pass
    assert finished.record(config, str(run), "evaluate", OUTPUTS)
    assert finished.finished_outputs(config, str(run), "evaluate") == OUTPUTS
    commits["refs/pr/1"] = "2" * 40  # the pull request got a new commit
    assert finished.finished_outputs(config, str(run), "evaluate") is None


def test_bytecode_written_into_site_packages_during_the_run_keeps_the_record(done, tmp_path, monkeypatch):
    """A fresh clone's first run imports top-level modules whose bytecode uv did not install: Python writes
    site-packages/__pycache__ during the run, and torch's first compile imports setuptools, which puts
    site-packages/setuptools/_vendor on sys.path. Neither changes what is installed (each once left the first
    `make demo` unrecorded, so the second went through the flow); a new distribution's metadata does."""
    config, run = done
    site = tmp_path / "venv" / "lib" / "site-packages"
    (site / "torch-2.0.dist-info").mkdir(parents=True)
    (site / "six.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    (site / "setuptools" / "_vendor" / "x-1.0.dist-info").mkdir(parents=True)
    begun = finished.begin(config, str(run), "evaluate")
    (site / "__pycache__").mkdir()
    (site / "__pycache__" / "six.cpython-311.pyc").write_bytes(b"")
    monkeypatch.syspath_prepend(str(site / "setuptools" / "_vendor"))  # what importing setuptools does
    with RunFolder(str(run)).lock():
        pass
    assert finished.record(config, str(run), "evaluate", OUTPUTS, begun)
    assert finished.finished_outputs(config, str(run), "evaluate") is not None

    begun = finished.begin(config, str(run), "evaluate")
    (site / "torch-2.0.dist-info").rename(site / "torch-2.1.dist-info")  # upgraded while the run went on
    with RunFolder(str(run)).lock():
        pass
    assert not finished.record(config, str(run), "evaluate", OUTPUTS, begun)
