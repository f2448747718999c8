"""Run tracking (eyrie.ops.tracking): a finished run folder exported to a local MLflow store (sqlite, in tmp_path;
no server), once; off by default; a tracker down or missing said as it should be."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import sys
from pathlib import Path

import pytest
import yaml
from prefect import flow

from eyrie.config import PipelineConfig, parse_config
from eyrie.errors import ConfigError
from eyrie.ops import tracking
from eyrie.ops.tracking import IDENTITY_TAG, RECORD, check, enabled, track
from eyrie.run.files import atomic_write_json
from eyrie.run.folder import RunFolder
from eyrie.stages.train.progress import METRICS, MetricsFile
from flows.pipeline import completion
from tasks.tracking import track_run_task

TRAIN_KEY = "37a2bed29fbcc94a70be4804"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _log_metrics(path: Path, rows: list[tuple[int, dict]]) -> None:
    """The trainer's metrics file, written by the handler the trainer uses (speculators' records)."""
    handler = MetricsFile(path)
    for step, record in rows:
        rec = logging.LogRecord("speculators.metrics", logging.INFO, __file__, 0, record, None, None)
        rec.step = step
        handler.emit(rec)


def finished_run(root: Path) -> RunFolder:
    """A run folder as a finished run leaves it: preflight's report, the stages' manifests, the trainer's metrics,
    the exported drafter (config and weights) and the evaluation."""
    import numpy as np
    from safetensors.numpy import save_file

    run = RunFolder(root)
    run.ensure()
    atomic_write_json(
        run.root / "preflight.json",
        {"architecture": "LlamaForCausalLM", "aux_layer_ids": [2, 4, 5], "revisions": {"target": REVISION}},
    )
    for stage in ("prepare", "vocab", "train", "export", "evaluate"):
        run.stage(stage).mkdir(parents=True, exist_ok=True)
    atomic_write_json(run.manifest("prepare"), {"stage": "prepare", "key": "5b0c31943b3f656b", "files": {}})
    atomic_write_json(run.manifest("vocab"), {"stage": "vocab", "key": "a03784d635600bf7"})
    work = run.train / TRAIN_KEY
    work.mkdir()
    train_row = {
        "train": {"loss": 13.6, "full_acc_0": 0.10, "full_acc_1": 0.0},
        "profile": {"tokens_per_s": 307.7},
        "epoch": 0,
        "lr": 0.0,
        "global_step": 0,
    }
    _log_metrics(
        work / METRICS,
        [
            (0, train_row),
            (22, {"val": {"loss_epoch": 0.55, "full_acc_0_epoch": 0.81}, "epoch": 0}),
            (30, {**train_row, "train": {"loss": 0.4, "full_acc_0": 0.9, "full_acc_1": 0.7}, "epoch": 1}),
            # a resume logged step 30 again: the export keeps its last value
            (30, {**train_row, "train": {"loss": 0.3, "full_acc_0": 0.9, "full_acc_1": 0.7}, "epoch": 1}),
            (44, {"val": {"loss_epoch": 0.13, "full_acc_0_epoch": 0.86}, "epoch": 1}),
        ],
    )
    atomic_write_json(
        run.manifest("train"),
        {
            "stage": "train",
            "key": TRAIN_KEY,
            "global_step": 44,
            "checkpoint": f"{TRAIN_KEY}/checkpoints/1",
            "history": [
                {"epoch": 0, "global_step": 22, "predicted_acceptance_length": 2.97},
                {"epoch": 1, "global_step": 44, "predicted_acceptance_length": 3.14},
            ],
            "val_metrics": {"full_acc_0_epoch": 0.86, "loss_epoch": 0.13},
            "files": {},
            "warnings": [],
        },
    )
    drafter = run.export / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    save_file({"fc.weight": np.zeros((4, 4), dtype=np.float32)}, str(drafter / "model.safetensors"))
    atomic_write_json(run.manifest("export"), {"stage": "export", "key": "2af0a3d723fbc2ed", "drafter": "drafter"})
    atomic_write_json(
        run.manifest("evaluate"),
        {
            "results": {
                "trained": {
                    "key": "0db5256a8111e058",
                    "acceptance_length": 3.209,
                    "per_position_acceptance": [0.7819, 0.7452, 0.6819],
                    "served_under": {"model_runner": "gpu_model_runner (V1)", "vllm_version": "0.33.0"},
                },
                "untrained": {"key": "1d", "acceptance_length": 1.0, "per_position_acceptance": [0.0, 0.0, 0.0]},
            },
            "warnings": [],
        },
    )
    return run


def config_for(tmp_path: Path, **tracking_section):
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text('{"model_type": "llama"}')
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    return parse_config(
        {
            "name": "tracked",
            "target": {"model": str(target)},
            "data": {"source": str(data)},
            "train": {"lr": 3e-4, "epochs": 2},
            "tracking": tracking_section,
        }
    )


OUTPUTS = {"drafter": "export/drafter", "acceptance_length": 3.209, "warnings": ["training was still improving"]}
SUMMARY = "# Eyrie run `tracked`\n\n| drafter | acceptance length |\n|---|---|\n| trained | 3.209 |"


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow sqlite database with its tables made, once per module (making them takes seconds)."""
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    _client(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def store(tmp_path, empty_store):
    """A local MLflow store of the test's own: a copy of the empty database, in `tmp_path/mlflow/`."""
    (tmp_path / "mlflow").mkdir()
    shutil.copy(empty_store, tmp_path / "mlflow" / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _runs(uri: str, experiment: str = "eyrie"):
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def _artifacts(client, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for f in client.list_artifacts(run_id, path):
        out |= _artifacts(client, run_id, f.path) if f.is_dir else {f.path}
    return out


def test_a_finished_run_is_exported_with_its_params_metrics_provenance_and_drafter(tmp_path, store):
    run = finished_run(tmp_path / "run")
    config = config_for(tmp_path, mlflow=True, mlflow_tracking_uri=store, mlflow_experiment="eyrie")
    tracked = track(run, config, OUTPUTS, SUMMARY)
    assert tracked.warnings == []
    [mlrun] = _runs(store)
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "tracked"
    client = _client(store)
    run_id = mlrun.info.run_id

    params = mlrun.data.params
    assert params["train.lr"] == "0.0003" and params["train.epochs"] == "2"
    assert params["target.model"] == str(tmp_path / "target") and params["extraction.server_args"] == "[]"
    assert not [k for k in params if k.startswith("tracking.")]  # where it goes is no parameter of the run

    def history(key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    assert history("train/loss") == [(0, 13.6), (30, 0.3)]  # the resumed step once, at its last value
    assert history("train/full_acc_1") == [(0, 0.0), (30, 0.7)]
    assert history("val/full_acc_0_epoch") == [(22, 0.81), (44, 0.86)]
    assert history("val/predicted_acceptance_length") == [(22, 2.97), (44, 3.14)]
    assert history("validation/full_acc_0_epoch") == [(44, 0.86)]
    assert history("lr") == [(0, 0.0), (30, 0.0)] and history("epoch") == [(0, 0.0), (22, 0.0), (30, 1.0), (44, 1.0)]
    assert history("eval/trained/acceptance_length") == [(0, 3.209)]
    assert history("eval/untrained/acceptance_length") == [(0, 1.0)]
    assert history("eval/trained/acceptance_at_3") == [(0, 0.6819)]
    assert history("eval/trained/per_position_acceptance") == [(1, 0.7819), (2, 0.7452), (3, 0.6819)]
    first = client.get_metric_history(run_id, "train/loss")[0]
    assert first.timestamp > 1_000_000_000_000  # the time the trainer logged it, in ms

    tags = mlrun.data.tags
    assert tags["eyrie.target.model"] == str(tmp_path / "target")
    assert tags["eyrie.target.revision"] == REVISION  # the commit the run pinned
    assert len(tags["eyrie.target.fingerprint"]) == 16  # the target's files by content
    assert tags["eyrie.run_dir"] == str(run.root) and tags["eyrie.key.train"] == TRAIN_KEY
    assert tags["eyrie.key.export"] == "2af0a3d723fbc2ed" and tags["eyrie.aux_layer_ids"] == "[2, 4, 5]"
    for dist in ("vllm", "speculators", "torch", "prefect"):
        assert tags[f"eyrie.installed.{dist}"] == tracking.installed_version(dist)
    assert tags["eyrie.served.model_runner"] == "gpu_model_runner (V1)"
    assert tags["eyrie.warnings"] == "1"
    assert tags["mlflow.note.content"] == SUMMARY  # the run's description in MLflow's UI
    assert tags[IDENTITY_TAG] == tracking.identity(run)
    commit = tracking.git_commit()
    assert tags.get("eyrie.git_commit") == commit

    assert _artifacts(client, run_id) >= {
        "drafter/config.json",
        "drafter/model.safetensors",
        "summary/summary.md",
        "summary/outputs.json",
        "summary/config.yaml",
        "run/preflight.json",
        "run/train/manifest.json",
        "run/train/metrics.jsonl",
        "run/evaluate/manifest.json",
    }
    local = Path(client.download_artifacts(run_id, "drafter/model.safetensors", str(tmp_path / "dl")))
    assert local.read_bytes() == (run.export / "drafter" / "model.safetensors").read_bytes()
    saved = yaml.safe_load(
        Path(client.download_artifacts(run_id, "summary/config.yaml", str(tmp_path / "dl"))).read_text()
    )
    assert parse_config(saved) == config
    # A local store keeps its artifacts beside its database, not in the working directory.
    assert (tmp_path / "mlflow" / "mlartifacts").is_dir()
    record = json.loads((run.root / RECORD).read_text())
    assert record["mlflow"]["run_id"] == run_id and record["mlflow"]["tracking_uri"] == store


def test_a_rerun_of_the_same_run_makes_no_second_tracked_run(tmp_path, store, monkeypatch):
    run = finished_run(tmp_path / "run")
    config = config_for(tmp_path, mlflow=True, mlflow_tracking_uri=store)
    # The first export is cut short while uploading the drafter: a warning, the tracked run left FAILED.
    from mlflow.tracking import MlflowClient

    real = MlflowClient.log_artifacts

    def cut(self, run_id, local_dir, artifact_path=None):
        if artifact_path == "drafter":
            raise OSError("connection reset")
        return real(self, run_id, local_dir, artifact_path)

    monkeypatch.setattr(MlflowClient, "log_artifacts", cut)
    first = track(run, config, OUTPUTS, SUMMARY)
    assert len(first.warnings) == 1 and "connection reset" in first.warnings[0]
    [mlrun] = _runs(store)
    assert mlrun.info.status == "FAILED"
    monkeypatch.setattr(MlflowClient, "log_artifacts", real)

    # The rerun completes that run; the next finds it complete and sends nothing.
    second = track(run, config, OUTPUTS, SUMMARY)
    assert second.warnings == [] and second.notes == [f"mlflow: exported as run {mlrun.info.run_id}"]
    recorded = (run.root / RECORD).stat().st_mtime_ns
    third = track(run, config, OUTPUTS, SUMMARY)
    assert (run.root / RECORD).stat().st_mtime_ns == recorded  # nothing new: the run folder left as it is
    assert third.notes == [f"mlflow: this run was already exported (run {mlrun.info.run_id}); nothing sent again"]
    [again] = _runs(store)
    assert again.info.run_id == mlrun.info.run_id and again.info.status == "FINISHED"
    client = _client(store)
    assert len(client.get_metric_history(again.info.run_id, "train/loss")) == 2  # each point once
    assert "drafter/model.safetensors" in _artifacts(client, again.info.run_id)

    # A moved run folder is the same run.
    moved = RunFolder(shutil.move(run.root, tmp_path / "moved"))
    assert track(moved, config, OUTPUTS, SUMMARY).notes == third.notes
    run = moved
    # Another drafter trained in the same folder is another tracked run.
    atomic_write_json(run.manifest("export"), {"stage": "export", "key": "another", "drafter": "drafter"})
    track(run, config, OUTPUTS, SUMMARY)
    assert len(_runs(store)) == 2


def test_a_long_summary_and_a_name_mlflow_refuses_do_not_stop_the_export(tmp_path, store):
    run = finished_run(tmp_path / "run")
    _log_metrics(run.train / TRAIN_KEY / METRICS, [(50, {"profile": {"p@50_ms": 12.5}})])
    config = config_for(tmp_path, mlflow=True, mlflow_tracking_uri=store)
    long = SUMMARY + "\n" + "| prompt set | category | acceptance |\n" * 400  # a report of many sets and categories
    assert track(run, config, OUTPUTS, long).warnings == []
    [mlrun] = _runs(store)
    assert mlrun.data.metrics["profile/p_50_ms"] == 12.5
    description = mlrun.data.tags["mlflow.note.content"]
    assert description.startswith(SUMMARY) and description.endswith("the artifact `summary/summary.md`)")
    client = _client(store)
    whole = Path(client.download_artifacts(mlrun.info.run_id, "summary/summary.md", str(tmp_path / "dl")))
    assert whole.read_text() == long + "\n"


def test_a_tracking_server_that_is_down_is_a_warning_saying_what_to_run(tmp_path, store, capsys):
    run = finished_run(tmp_path / "run")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = config_for(tmp_path, mlflow=True, mlflow_tracking_uri=f"http://user:secret@127.0.0.1:{port}")
    tracked = track(run, down, OUTPUTS, SUMMARY)
    [warning] = tracked.warnings
    assert f"not exported to MLflow at http://127.0.0.1:{port}" in warning and "secret" not in warning
    assert f"python -m eyrie.ops.tracking --config <the run config> --run-dir {run.root}" in warning
    assert not (run.root / RECORD).exists()

    # What the warning says to run, once a tracker answers: exports the run, without Prefect.
    config_file = tmp_path / "run.yaml"
    up = down.model_copy(update={"tracking": down.tracking.model_copy(update={"mlflow_tracking_uri": store})})
    config_file.write_text(yaml.safe_dump(up.model_dump(mode="json")))
    assert tracking.main(["--config", str(config_file), "--run-dir", str(run.root)]) == 0
    assert "mlflow: exported as run" in capsys.readouterr().out
    [mlrun] = _runs(store)
    assert mlrun.data.metrics["eval/trained/acceptance_length"] == 3.209


def test_tracking_is_off_by_default_and_then_imports_and_writes_nothing(tmp_path, monkeypatch):
    run = finished_run(tmp_path / "run")
    config = config_for(tmp_path)
    assert not config.tracking.mlflow and not config.tracking.wandb and enabled(config.tracking) == []
    monkeypatch.setitem(sys.modules, "mlflow", None)  # an import of mlflow would now raise
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    before = sorted(p.relative_to(run.root) for p in run.root.rglob("*"))
    check(config.tracking)
    tracked = track(run, config, OUTPUTS, SUMMARY)
    assert (tracked.runs, tracked.warnings, tracked.notes) == ({}, [], [])
    assert sorted(p.relative_to(run.root) for p in run.root.rglob("*")) == before


@pytest.mark.parametrize(("module", "extra"), [("mlflow", "eyrie[tracking]"), ("wandb", "eyrie[tracking-wandb]")])
def test_a_tracker_on_without_its_package_is_refused_before_the_run_naming_what_to_install(
    tmp_path, monkeypatch, module, extra
):
    monkeypatch.setitem(sys.modules, module, None)  # not installed
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    config = config_for(tmp_path, **{module: True})
    with pytest.raises(ConfigError) as err:
        check(config.tracking)
    said = str(err.value)
    assert f"tracking.{module} is on but the `{module}` package is not installed" in said
    assert extra in said
    assert f"tracking.{module}: false" in said


def test_mlflow_on_without_a_tracking_uri_is_refused_before_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = config_for(tmp_path, mlflow=True)
    with pytest.raises(ConfigError, match="tracking.mlflow_tracking_uri .* or \\$MLFLOW_TRACKING_URI"):
        check(config.tracking)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    check(config.tracking)


class _FakeWandb:
    """What `eyrie.ops.tracking.export_wandb` calls of the wandb package, recorded: the mapping from a run folder
    to W&B's calls is what is checked here (W&B's own client is not in the test extra)."""

    def __init__(self):
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.summary: dict = {}
        self.artifacts: list = []
        self.finished = 0
        self.fail: Exception | None = None

    def init(self, **kwargs):
        if self.fail:
            raise self.fail
        self.inits.append(kwargs)
        fake = self

        class Run:
            url = f"https://wandb.example/runs/{kwargs['id']}"
            summary = self.summary

            def log(self, data, step):
                fake.logged.append((step, data))

            def log_artifact(self, artifact):
                fake.artifacts.append(artifact)

            def finish(self):
                fake.finished += 1

        return Run()

    class Artifact:
        def __init__(self, name, type):
            self.name, self.type, self.dirs, self.files = name, type, [], []

        def add_dir(self, path):
            self.dirs.append(sorted(p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_file()))

        def add_file(self, path, name):
            self.files.append(name)


def test_wandb_gets_the_same_run_once_as_one_resumable_run(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = finished_run(tmp_path / "run")
    config = config_for(tmp_path, wandb=True, wandb_project="drafters", run_name="weekly")
    tracked = track(run, config, OUTPUTS, SUMMARY)
    ident = tracking.identity(run)
    assert tracked.warnings == [] and tracked.notes == [f"wandb: exported as run {ident}"]
    [init] = fake.inits
    assert (init["project"], init["name"], init["id"], init["resume"]) == ("drafters", "weekly", ident, "allow")
    assert init["config"]["config"]["train.lr"] == "0.0003" and init["notes"] == SUMMARY
    assert init["config"]["provenance"]["eyrie.target.revision"] == REVISION
    steps = [step for step, _ in fake.logged]
    assert steps == sorted(steps) == [0, 22, 30, 44]  # W&B's history only grows: in step order
    assert (
        dict(fake.logged)[30]["train/loss"] == 0.3 and dict(fake.logged)[44]["val/predicted_acceptance_length"] == 3.14
    )
    assert not [k for _, row in fake.logged for k in row if k.startswith("eval/")]  # in the summary instead
    assert fake.summary["eval/trained/acceptance_length"] == 3.209 and fake.summary["warnings"] == 1
    model, summary = fake.artifacts
    assert model.type == "model" and model.dirs == [["config.json", "model.safetensors"]]
    assert summary.type == "run-summary" and "run/train/metrics.jsonl" in summary.files
    assert sorted(summary.dirs[0]) == ["summary/config.yaml", "summary/outputs.json", "summary/summary.md"]
    assert fake.finished == 1
    assert json.loads((run.root / RECORD).read_text())["wandb"]["run_id"] == ident

    # Again: recorded complete, nothing sent.
    assert track(run, config, OUTPUTS, SUMMARY).notes == [
        f"wandb: this run was already exported (run {ident}); nothing sent again"
    ]
    assert len(fake.inits) == 1
    # A refused login is a warning of the finished run.
    (run.root / RECORD).unlink()
    fake.fail = PermissionError("api key refused")
    [warning] = track(run, config, OUTPUTS, SUMMARY).warnings
    assert warning.startswith("run tracking: this run was not exported to W&B (api key refused)")


@flow(name="eyrie-tracking-probe")
def _finished_flow(config: PipelineConfig, run_dir: str, summary: str):
    """The pipeline's last lines: the export task's warnings join the run's before its completion."""
    outputs = {"run_dir": run_dir, "warnings": list(OUTPUTS["warnings"])}
    outputs["warnings"] += track_run_task(config, run_dir, outputs, summary)
    return completion(outputs)


@pytest.mark.usefixtures("flow_api")
def test_in_the_flow_a_tracker_that_is_down_leaves_the_run_completed_with_the_warning(tmp_path):
    run = finished_run(tmp_path / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = config_for(tmp_path, mlflow=True, mlflow_tracking_uri=f"http://127.0.0.1:{port}")
    state = _finished_flow(config, str(run.root), SUMMARY, return_state=True)
    assert state.is_completed() and state.message.startswith("Completed with 2 warning(s)")
    [warning] = state.result()["warnings"][1:]
    assert warning.startswith(f"run tracking: this run was not exported to MLflow at http://127.0.0.1:{port}")
