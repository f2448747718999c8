"""Run tracking: a finished run exported to MLflow (and to Weights & Biases), read from its run folder.

Off by default (`tracking.mlflow`, `tracking.wandb`); nothing here imports MLflow or W&B unless one is on. What one
run exports (`collect`):

- parameters: the config, flattened to dotted keys (`train.lr`, `evaluate.num_speculative_tokens`...), less the
  tracking section itself;
- metrics: the training curve speculators logged (`<run>/train/<key>/metrics.jsonl`: `train/loss`,
  `train/full_acc_<i>`, `lr`, ... at their global step; each epoch's `val/...` and predicted acceptance length),
  the final like-for-like validation (`validation/...`), and each evaluated drafter's acceptance length and
  per-position acceptance (`eval/<label>/acceptance_length`, `eval/<label>/acceptance_at_<k>`, and
  `eval/<label>/per_position_acceptance` with the position as its step);
- tags: the target, its pinned revision and content fingerprint, the data source and revision, the stage keys, the
  installed vLLM, speculators, torch, transformers and Prefect, Eyrie's version and git commit, the run folder and
  the run summary (MLflow's run description);
- artifacts: the exported drafter folder (config and weights), the summary (markdown and JSON), the config as YAML,
  and the run's manifests and training metrics file.

One finished run is one tracked run: the run is known by its identity (the keys of what it trained, exported and
evaluated, `identity`), kept as a tag. An export finds the tracked run of that identity and
does nothing when it is complete, continues it when an earlier export was cut short, and starts one only when there
is none, so re-running a finished run does not duplicate it. `<run>/tracking.json` records where each run went.

A tracking server that is down, or any error of the export, never fails the finished run: it comes back as a
warning of the run, naming what to run once the server is back (`python -m eyrie.ops.tracking`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from eyrie import __version__
from eyrie.config import PipelineConfig, TrackingConfig, load_config
from eyrie.errors import ConfigError, EyrieError
from eyrie.run.files import atomic_write_json, read_json, sha256_json
from eyrie.run.folder import RunFolder
from eyrie.run.identity import installed_version
from eyrie.stages.train.progress import METRICS, read_rows

RECORD = "tracking.json"  # in the run folder: where each tracker's run is
IDENTITY_TAG = "eyrie.identity"
VERSIONS = ("vllm", "speculators", "torch", "transformers", "prefect")
# (config switch, module imported, what to install)
PACKAGES = {
    "mlflow": ("mlflow", "Eyrie's `tracking` extra: pip install 'eyrie[tracking]' (or mlflow-skinny)"),
    "wandb": ("wandb", "Eyrie's `tracking-wandb` extra: pip install 'eyrie[tracking-wandb]' (or wandb)"),
}
MLFLOW_BATCH = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's own limits per log_batch
PARAM_CHARS = 6000  # MLflow's longest parameter value
NOTE_CHARS = 5000  # the run's description (a tag), within every MLflow server's tag limit
NAME_CHARACTERS = re.compile(r"[^/\w.\- ]")  # what MLflow refuses in a parameter's or metric's name
PROBE_TIMEOUT_S = 10.0


def enabled(tracking: TrackingConfig) -> list[str]:
    """The trackers a run exports to, in order."""
    return [name for name in PACKAGES if getattr(tracking, name)]


def check(tracking: TrackingConfig, environ: Mapping[str, str] | None = None) -> None:
    """Refuse, before any stage runs, a tracker that is on but cannot work here: its package missing (naming the
    extra to install), or MLflow without a tracking URI."""
    environ = os.environ if environ is None else environ
    for name in enabled(tracking):
        module, install = PACKAGES[name]
        try:
            missing = importlib.util.find_spec(module) is None
        except ValueError:  # a module in sys.modules without a spec
            missing = False
        if missing:
            raise ConfigError(
                f"tracking.{name} is on but the `{module}` package is not installed where this run runs: install "
                f"{install}, or set tracking.{name}: false"
            )
    if tracking.mlflow and not (tracking.mlflow_tracking_uri or environ.get("MLFLOW_TRACKING_URI")):
        raise ConfigError(
            "tracking.mlflow is on but no tracking URI is given: set tracking.mlflow_tracking_uri (a server's "
            "http(s) URL, or sqlite:///path/mlflow.db for a local store) or $MLFLOW_TRACKING_URI where the run runs"
        )


# ---------------------------------------------------------------------------------------------------------------
# What one finished run exports


@dataclass
class RunExport:
    identity: str
    name: str
    params: dict[str, str]
    metrics: list[tuple[str, float, int, int]]  # (key, value, step, timestamp in ms)
    tags: dict[str, str]
    files: dict[str, str]  # artifact path -> text written for the export (summary, config)
    artifacts: list[tuple[Path, str]]  # (a file or folder of the run, the artifact folder it goes to)
    summary: dict = field(default_factory=dict)  # the run's headline figures (W&B's run summary)
    description: str | None = None  # the run summary's markdown


def flatten(data: Mapping, prefix: str = "") -> dict[str, str]:
    """A nested mapping as dotted keys and string values (lists as JSON; an empty mapping as `{}`)."""
    out: dict[str, str] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, f"{key}."))
        else:
            text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
            out[key] = text[:PARAM_CHARS]
    return out


def config_params(config: PipelineConfig) -> dict[str, str]:
    data = config.model_dump(mode="json")
    data.pop("tracking", None)
    return flatten(data)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _mtime_ms(path: Path) -> int:
    try:
        return int(path.stat().st_mtime * 1000)
    except OSError:
        return int(time.time() * 1000)


SKIPPED_COLUMNS = frozenset({"time", "step", "global_step"})


def training_metrics(run: RunFolder) -> list[tuple[str, float, int, int]]:
    """The training curve (each metric at its global step, with the time it was logged), the predicted acceptance
    length per epoch and the final validation. A resumed training's repeated steps count once, the last."""
    manifest = read_json(run.manifest("train")) or {}
    out: dict[tuple[str, int], tuple[float, int]] = {}
    key = manifest.get("key")
    if key:
        rows, _ = read_rows(run.train / key / METRICS)
        for row in rows:
            step = row.get("step", row.get("global_step"))
            if not isinstance(step, int):
                continue
            ts = int(float(row.get("time") or 0) * 1000)
            for name, value in row.items():
                v = _number(value)
                if name not in SKIPPED_COLUMNS and v is not None:
                    out[(name, step)] = (v, ts)
    ts = _mtime_ms(run.manifest("train"))
    for epoch in manifest.get("history") or []:
        v, step = _number(epoch.get("predicted_acceptance_length")), epoch.get("global_step")
        if v is not None and isinstance(step, int):
            out[("val/predicted_acceptance_length", step)] = (v, ts)
    last = manifest.get("global_step")
    for name, value in (manifest.get("val_metrics") or {}).items():
        v = _number(value)
        if v is not None and isinstance(last, int):
            out[(f"validation/{name}", last)] = (v, ts)
    return [(name, v, step, t) for (name, step), (v, t) in sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def evaluation_metrics(run: RunFolder) -> list[tuple[str, float, int, int]]:
    """Each evaluated drafter's acceptance length and per-position acceptance (evaluate's manifest)."""
    manifest = read_json(run.manifest("evaluate")) or {}
    ts = _mtime_ms(run.manifest("evaluate"))
    out = []
    for label, result in sorted((manifest.get("results") or {}).items()):
        length = _number(result.get("acceptance_length"))
        if length is not None:
            out.append((f"eval/{label}/acceptance_length", length, 0, ts))
        for k, value in enumerate(result.get("per_position_acceptance") or [], start=1):
            v = _number(value)
            if v is not None:
                out.append((f"eval/{label}/acceptance_at_{k}", v, 0, ts))
                out.append((f"eval/{label}/per_position_acceptance", v, k, ts))
    return out


def identity(run: RunFolder) -> str:
    """One finished run: the keys of what it trained, exported and evaluated (a moved run folder keeps it; two
    folders with the same keys hold interchangeable drafters and evaluations, the keys' promise)."""
    evaluation = read_json(run.manifest("evaluate")) or {}
    return sha256_json(
        [
            (read_json(run.manifest("train")) or {}).get("key"),
            (read_json(run.manifest("export")) or {}).get("key"),
            sorted((label, r.get("key")) for label, r in (evaluation.get("results") or {}).items()),
        ]
    )[:32]


def git_commit(where: Path | None = None) -> str | None:
    """The commit of the checkout Eyrie runs from (with `-dirty` when tracked files changed); None outside one."""
    where = where or Path(__file__).resolve().parents[2]
    if not (where / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head or None


def _target_fingerprint(config: PipelineConfig) -> str | None:
    try:
        from eyrie.target.metadata import target_identity

        return target_identity(config.target)
    except Exception:  # a provenance tag: a target moved or a hub not reachable leaves it out
        return None


def provenance(run: RunFolder, config: PipelineConfig) -> dict[str, str]:
    """The tags: what was trained against, with what, from which code, and where the run is."""
    preflight = read_json(run.root / "preflight.json") or {}
    revisions = preflight.get("revisions") or {}
    evaluation = read_json(run.manifest("evaluate")) or {}
    served = ((evaluation.get("results") or {}).get("trained") or {}).get("served_under") or {}
    tags: dict[str, Any] = {
        IDENTITY_TAG: identity(run),
        "eyrie.run_dir": str(run.root),
        "eyrie.name": config.name,
        "eyrie.version": __version__,
        "eyrie.git_commit": git_commit(),
        "eyrie.target.model": config.target.model,
        "eyrie.target.revision": revisions.get("target") or config.target.revision,
        "eyrie.target.fingerprint": _target_fingerprint(config),
        "eyrie.target.architecture": preflight.get("architecture"),
        "eyrie.aux_layer_ids": json.dumps(preflight.get("aux_layer_ids")) if preflight.get("aux_layer_ids") else None,
        "eyrie.data.source": config.data.source,
        "eyrie.data.revision": revisions.get("data") or config.data.revision,
        "eyrie.served.model_runner": served.get("model_runner"),
        "eyrie.served.attention_backend": served.get("attention_backend"),
    }
    for stage in ("prepare", "regenerate", "vocab", "train", "export"):
        tags[f"eyrie.key.{stage}"] = (read_json(run.manifest(stage)) or {}).get("key")
    for dist in VERSIONS:
        tags[f"eyrie.installed.{dist}"] = installed_version(dist)
    return {k: str(v) for k, v in tags.items() if v is not None}


def _drafter(run: RunFolder) -> Path | None:
    manifest = read_json(run.manifest("export")) or {}
    drafter = manifest.get("drafter")
    folder = run.export / drafter if drafter else None
    return folder if folder and folder.is_dir() else None


def summary_figures(run: RunFolder, outputs: Mapping | None) -> dict[str, Any]:
    evaluation = read_json(run.manifest("evaluate")) or {}
    figures: dict[str, Any] = {}
    for label, result in (evaluation.get("results") or {}).items():
        figures[f"eval/{label}/acceptance_length"] = result.get("acceptance_length")
        figures[f"eval/{label}/per_position_acceptance"] = result.get("per_position_acceptance")
    if outputs:
        figures["warnings"] = len(outputs.get("warnings") or [])
        figures["drafter"] = outputs.get("drafter")
    return figures


def collect(
    run: RunFolder,
    config: PipelineConfig,
    outputs: Mapping | None = None,
    summary_markdown: str | None = None,
) -> RunExport:
    """What the finished run in `run` exports. `outputs` and `summary_markdown` are the flow's (its return value and
    its run-summary artifact); without them, `finished.json`'s outputs, as `eyrie run` recorded them."""
    if not read_json(run.manifest("evaluate")):
        raise EyrieError(
            f"{run.root} holds no finished evaluation (evaluate/manifest.json): only a run that went through "
            "evaluation is exported. Run it to the end first (`eyrie run` without --until)"
        )
    if outputs is None:
        outputs = (read_json(run.root / "finished.json") or {}).get("outputs")
    tags = provenance(run, config)
    if outputs:
        tags["eyrie.warnings"] = str(len(outputs.get("warnings") or []))
    files = {"summary/config.yaml": yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)}
    if outputs:
        files["summary/outputs.json"] = json.dumps(outputs, indent=2, sort_keys=True, default=str) + "\n"
    if summary_markdown:
        files["summary/summary.md"] = summary_markdown + "\n"
    artifacts: list[tuple[Path, str]] = []
    drafter = _drafter(run)
    if drafter and config.tracking.log_drafter:
        artifacts.append((drafter, "drafter"))
    for path, folder in (
        (run.root / "preflight.json", "run"),
        (run.manifest("prepare"), "run/prepare"),
        (run.manifest("train"), "run/train"),
        (run.manifest("export"), "run/export"),
        (run.manifest("evaluate"), "run/evaluate"),
    ):
        if path.is_file():
            artifacts.append((path, folder))
    key = (read_json(run.manifest("train")) or {}).get("key")
    if key and (run.train / key / METRICS).is_file():
        artifacts.append((run.train / key / METRICS, "run/train"))
    plot = (outputs or {}).get("draft_tokens_plot")
    if plot and Path(run.root, plot).is_file():
        artifacts.append((Path(run.root, plot), "run/evaluate"))
    return RunExport(
        identity=tags[IDENTITY_TAG],
        name=config.tracking.run_name or config.name,
        params=config_params(config),
        metrics=training_metrics(run) + evaluation_metrics(run),
        tags=tags,
        files=files,
        artifacts=artifacts,
        summary=summary_figures(run, outputs),
        description=summary_markdown,
    )


# ---------------------------------------------------------------------------------------------------------------
# MLflow


def mlflow_name(key: str) -> str:
    """A parameter's or metric's name as MLflow takes it: a character it refuses becomes `_`."""
    return NAME_CHARACTERS.sub("_", key)


def note(markdown: str) -> str:
    """The run summary as the run's description: whole when it fits, else its beginning and where the rest is."""
    if len(markdown) <= NOTE_CHARS:
        return markdown
    tail = "\n\n... (the whole summary: the artifact `summary/summary.md`)"
    return markdown[: NOTE_CHARS - len(tail)] + tail


def _batches(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def without_secrets(uri: str) -> str:
    """A URI as it may be written down: without a user and password."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host))
    return uri


def probe(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """A tracking server answers, in seconds: MLflow's own client retries a refused connection for minutes."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
    except requests.RequestException as err:
        raise EyrieError(
            f"the MLflow server at {without_secrets(uri)} does not answer ({type(err).__name__})"
        ) from None


def _local_artifacts(uri: str) -> str | None:
    """A local sqlite store's artifacts beside its database (MLflow's own default is the working directory's)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).resolve().parent / "mlartifacts").as_uri()
    return None


def export_mlflow(export: RunExport, tracking: TrackingConfig) -> dict:
    """Export to MLflow; returns the tracked run's record (its id, experiment, URI, and whether it was already
    complete)."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    uri = tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ConfigError("no MLflow tracking URI: set tracking.mlflow_tracking_uri or $MLFLOW_TRACKING_URI")
    probe(uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(tracking.mlflow_experiment)
    if experiment is None:
        location = tracking.mlflow_artifact_location or _local_artifacts(uri)
        try:
            experiment_id = client.create_experiment(tracking.mlflow_experiment, artifact_location=location)
        except Exception:  # made by another run meanwhile
            found = client.get_experiment_by_name(tracking.mlflow_experiment)
            if found is None:
                raise
            experiment_id = found.experiment_id
    else:
        experiment_id = experiment.experiment_id
    record = {"tracking_uri": without_secrets(uri), "experiment_id": experiment_id, "identity": export.identity}
    found_runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`{IDENTITY_TAG}` = '{export.identity}'", max_results=10
    )
    complete = [r for r in found_runs if r.info.status == "FINISHED"]
    if complete:
        return {**record, "run_id": complete[0].info.run_id, "already_exported": True}
    if found_runs:  # an export cut short: continued in the same run
        run_id = found_runs[0].info.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        run_id = client.create_run(
            experiment_id, run_name=export.name, tags={IDENTITY_TAG: export.identity}
        ).info.run_id
    try:
        params = [Param(mlflow_name(k), v) for k, v in export.params.items()]
        tags = [RunTag(k, v) for k, v in export.tags.items()]
        if export.description:  # the run's description in MLflow's UI
            tags.append(RunTag("mlflow.note.content", note(export.description)))
        for batch in _batches(params, MLFLOW_BATCH["params"]):
            client.log_batch(run_id, params=batch)
        for batch in _batches(tags, MLFLOW_BATCH["tags"]):
            client.log_batch(run_id, tags=batch)
        # The times are the data's own: an export continued after a cut logs the same points again, which the
        # store keeps once.
        metrics = [Metric(mlflow_name(k), v, ts, step) for k, v, step, ts in export.metrics]
        for batch in _batches(metrics, MLFLOW_BATCH["metrics"]):
            client.log_batch(run_id, metrics=batch)
        with tempfile.TemporaryDirectory(prefix="eyrie-tracking-") as tmp:
            for rel, text in export.files.items():
                path = Path(tmp, rel)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            client.log_artifacts(run_id, tmp)
        for path, folder in export.artifacts:
            if path.is_dir():
                client.log_artifacts(run_id, str(path), folder)
            else:
                client.log_artifact(run_id, str(path), folder)
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FINISHED")
    return {**record, "run_id": run_id, "already_exported": False}


# ---------------------------------------------------------------------------------------------------------------
# Weights & Biases


def export_wandb(export: RunExport, tracking: TrackingConfig, done: dict | None) -> dict:
    """Export to W&B as one run whose id is the run's identity: a second export resumes it and logs no step twice
    (W&B drops a step below the run's last); one recorded complete is not touched."""
    if done and done.get("identity") == export.identity and done.get("complete"):
        return {**done, "already_exported": True}
    import wandb

    run = wandb.init(
        project=tracking.wandb_project,
        entity=tracking.wandb_entity,
        name=export.name,
        id=export.identity,
        resume="allow",
        config={"config": export.params, "provenance": export.tags},
        tags=["eyrie"],
        notes=export.description,
    )
    steps: dict[int, dict[str, float]] = {}
    for key, value, step, _ in export.metrics:
        if not key.startswith("eval/"):
            steps.setdefault(step, {})[key] = value
    for step in sorted(steps):
        run.log(steps[step], step=step)
    run.summary.update({k: v for k, v in export.summary.items() if v is not None})
    with tempfile.TemporaryDirectory(prefix="eyrie-tracking-") as tmp:
        summary = wandb.Artifact(f"summary-{export.identity[:12]}", type="run-summary")
        for rel, text in export.files.items():
            path = Path(tmp, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        summary.add_dir(tmp)
        for path, folder in export.artifacts:
            if folder == "drafter":
                model = wandb.Artifact(f"drafter-{export.identity[:12]}", type="model")
                model.add_dir(str(path))
                run.log_artifact(model)
            elif path.is_file():
                summary.add_file(str(path), name=f"{folder}/{path.name}")
        run.log_artifact(summary)
        run.finish()
    return {
        "project": tracking.wandb_project,
        "entity": tracking.wandb_entity,
        "run_id": export.identity,
        "identity": export.identity,
        "url": getattr(run, "url", None),
        "complete": True,
        "already_exported": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# The export


@dataclass
class Tracked:
    runs: dict[str, dict]  # tracker -> its record
    warnings: list[str]
    notes: list[str]


def retry_command(run: RunFolder, config_path: str | None = None) -> str:
    return f"python -m eyrie.ops.tracking --config {config_path or '<the run config>'} --run-dir {run.root}"


def track(
    run: RunFolder,
    config: PipelineConfig,
    outputs: Mapping | None = None,
    summary_markdown: str | None = None,
    config_path: str | None = None,
) -> Tracked:
    """Export the finished run in `run` to each tracker that is on. A tracker that fails (a server down, a refused
    login) is a warning that says how to export again, never an error: the run is finished."""
    names = enabled(config.tracking)
    out = Tracked({}, [], [])
    if not names:
        return out
    export = collect(run, config, outputs, summary_markdown)
    record = read_json(run.root / RECORD) or {}
    for name in names:
        try:
            if name == "mlflow":
                result = export_mlflow(export, config.tracking)
            else:
                result = export_wandb(export, config.tracking, record.get("wandb"))
        except Exception as err:
            uri = config.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
            where = f" at {without_secrets(uri)}" if name == "mlflow" else ""
            out.warnings.append(
                f"run tracking: this run was not exported to {'MLflow' if name == 'mlflow' else 'W&B'}{where} "
                f"({str(err)[:300] or type(err).__name__}); the run itself is finished. Once the tracker is "
                f"reachable, export it with `{retry_command(run, config_path)}` (it completes the tracked run an "
                "earlier export began, and never makes a second one)"
            )
            continue
        if result.pop("already_exported", False):
            out.notes.append(f"{name}: this run was already exported (run {result['run_id']}); nothing sent again")
        else:
            out.notes.append(f"{name}: exported as run {result['run_id']}")
        out.runs[name] = result
        record[name] = result
    if out.runs and record != read_json(run.root / RECORD):  # unchanged: the run folder is left as it is
        atomic_write_json(run.root / RECORD, record)
    return out


def main(argv: list[str] | None = None) -> int:
    """Export a finished run again (after a tracking server was down), without Prefect."""
    parser = argparse.ArgumentParser(prog="python -m eyrie.ops.tracking", description=main.__doc__)
    parser.add_argument("--config", required=True, help="the run's config file (its tracking section says where)")
    parser.add_argument("--run-dir", help="the run folder (default: runs/<name>)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        check(config.tracking)
        if not enabled(config.tracking):
            raise ConfigError(f"{args.config}: no tracker is on (set tracking.mlflow or tracking.wandb: true)")
        run = RunFolder(args.run_dir or Path("runs") / config.name)
        tracked = track(run, config, config_path=args.config)
    except EyrieError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for line in tracked.notes + tracked.warnings:
        print(line)
    return 1 if tracked.warnings else 0


if __name__ == "__main__":
    sys.exit(main())
