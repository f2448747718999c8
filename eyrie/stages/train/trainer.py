"""train: speculators' EAGLE-3 trainer on the extracted hidden states, as a subprocess that resumes.

The same command runs on CPU (demo, CI: `python -m eyrie.stages.train.entry`, its options file saying cpu) and on N GPUs
(`torchrun --nproc-per-node N -m eyrie.stages.train.entry`). Checkpoints go to `train/<key>/checkpoints` in speculators'
layout (one folder per epoch, sub-epoch ones with `training_state.json`); a re-run with the same key resumes from
the newest whole one (eyrie/stages/train/checkpoints.py), so a killed or retried training task continues from its saved
step
instead of starting over.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

from eyrie.config import PipelineConfig, TrainConfig
from eyrie.errors import EyrieError
from eyrie.hidden_states.staging import clean, leftover_bytes, on_tmpfs
from eyrie.run.environment import child_environment
from eyrie.run.files import atomic_write_json, located, portable, read_json
from eyrie.run.manifest import files_under, finished_manifest, list_files
from eyrie.stages.train.checkpoints import is_whole, newest_whole_checkpoint, recover
from eyrie.stages.train.command import (
    _die_with_parent,
    missing_loggers,
    trainer_environment,
    training_command,
    verifier_source,  # noqa: F401  (tests/unit/test_identity.py imports it from here)
)
from eyrie.stages.train.data import TrainingData
from eyrie.stages.train.progress import METRICS, Metrics, read_rows, record_exit, record_launch
from eyrie.stages.train.validation import (
    PLATEAU,
    epoch_validation,
    history,
    like_for_like_metrics,
    still_improving,
    with_training_metrics,
)
from eyrie.target.metadata import stage_key


def resolve_device(train: TrainConfig) -> str:
    if train.device != "auto":
        return train.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def train_key(
    config: PipelineConfig, data_keys: list[str], vocab_key: str, aux_ids: list[int], warm_start: str | None = None
) -> str:
    """The checkpoints' lineage (`eyrie.run.identity.STAGES["train"]`): what determines the weights. `data_keys`
    are the hidden states' content keys (`eyrie.stages.extract.plan.content_key`; the same online and offline, whatever
    the storage layout), `warm_start` the base drafter, by its content. Devices, logging, checkpoint frequency and
    thresholds are not in it: a change of them resumes (`resume_notes`). The key is the lineage's 16 characters
    and 8 of the stop rule's (`STAGES["train.stop"]`): a changed plateau rule keeps the lineage's checkpoints
    (`adopt_lineage`) and decides again which one ships. The whole config: the key is computed from the
    declaration's dotted paths."""
    lineage = stage_key("train", config, drafter=warm_start, data=list(data_keys), vocab=vocab_key, aux=list(aux_ids))
    return lineage + stage_key("train.stop", config, lineage=lineage)[:8]


LINEAGE_CHARS = 16


def adopt_lineage(out_dir: Path, key: str, train: TrainConfig, log=print) -> None:
    """Before training into `out_dir/key`: the checkpoints of the same lineage made under another stop rule move
    here (no epoch is trained again), and the plateau is decided again under this rule from their saved
    validation (`decide_plateau`)."""
    work = out_dir / key
    if work.exists() or len(key) != LINEAGE_CHARS + 8:
        return
    same = [
        d
        for d in sorted(out_dir.glob(key[:LINEAGE_CHARS] + "*"))
        if d.is_dir() and len(d.name) == len(key) and (d / "checkpoints").is_dir()
    ]
    if not same:
        return
    os.replace(same[-1], work)
    log(f"train: the plateau rule changed; training continues from the checkpoints of {same[-1].name}")
    decide_plateau(work / "checkpoints", train)


def decide_plateau(save_path: Path, train: TrainConfig) -> None:
    """The plateau under the current rule, from the saved epochs' validation: the first epoch it would have
    stopped at (PLATEAU written), or none (PLATEAU removed: training goes on)."""
    from eyrie.stages.train.validation import plateaued, predicted_acceptance_length

    (save_path / PLATEAU).unlink(missing_ok=True)
    t = train
    if not t.stop_on_plateau:
        return
    scores: dict[int, float] = {}
    epoch = 0
    while (metrics := epoch_validation(save_path / str(epoch))) is not None:
        scores[epoch] = predicted_acceptance_length(metrics)
        if plateaued(list(scores.values()), t.plateau_patience, t.plateau_min_delta):
            best = max(scores, key=lambda e: scores[e])
            atomic_write_json(save_path / PLATEAU, {"epoch": epoch, "best_epoch": best, "scores": scores})
            return
        epoch += 1


# Settings outside the train key whose change, on a resume, continues differently from an uninterrupted run.
APPROXIMATE_ON_RESUME = ("devices", "device")
RESUME_SETTINGS = "settings.json"  # beside the checkpoints: the APPROXIMATE_ON_RESUME settings they were made with


def resume_notes(train: TrainConfig, work: Path, device: str) -> list[str]:
    """Warnings for a resume across a change that makes it approximate (a GPU died: fewer devices deal the data
    out differently from the saved step on); records the current settings for the next resume."""
    now = {"devices": train.devices if device == "cuda" else 1, "device": device}
    path = work / RESUME_SETTINGS
    before = read_json(path)
    notes = []
    if isinstance(before, dict) and (work / "checkpoints").is_dir():
        changed = {k: (before.get(k), now[k]) for k in APPROXIMATE_ON_RESUME if before.get(k) != now[k]}
        if changed:
            what = ", ".join(f"train.{k} {a} -> {b}" for k, (a, b) in changed.items())
            notes.append(
                f"resuming training across a change ({what}): the checkpoints are kept, but from the saved step on "
                "the batches are dealt out differently than in an uninterrupted run (the drafter is as good, not "
                "bit-identical)"
            )
    if before != now:
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, now)
    return notes


def launch_switches(train: TrainConfig, spe: int, global_step: int, metrics: Path):
    """train.speed resolved for this launch (`eyrie.stages.train.patches.switches.decide`): its `auto` choices by
    the training time left, the steps left (one rank's) at the rate this drafter's earlier launches measured (the
    median of their logged steps' tokens/s, in `metrics`), or at train.speed.assumed_tokens_per_s before any did."""
    import statistics

    from eyrie.stages.train.patches.switches import decide, expected_training_s

    rows = read_rows(metrics)[0]
    speeds = [r["profile/tokens_per_s"] for r in rows if isinstance(r.get("profile/tokens_per_s"), (int, float))]
    speeds = [v for v in speeds if v > 0]
    rate = statistics.median(speeds) if speeds else None
    left = spe * train.epochs - global_step
    return decide(train.speed, expected_training_s(left, train.max_seq_len, rate, train.speed.assumed_tokens_per_s))


def steps_per_epoch(seq_lens: list[int], total_seq_len: int, train_ratio: float) -> int:
    """Approximate packed batches per epoch (speculators packs samples up to total_seq_len tokens)."""
    n = int(len(seq_lens) * train_ratio)
    return max(1, math.ceil(sum(min(s, total_seq_len) for s in seq_lens[:n]) / total_seq_len))


def run_training(
    config: PipelineConfig,
    out_dir: Path,
    key: str,
    data: TrainingData,
    seq_lens: list[int],
    warm_start: Path | None = None,
    log=print,
    server_url: str | None = None,
) -> dict:
    """Train (or resume) into `out_dir/<key>`; returns the stage manifest naming the final checkpoint. The whole
    config: the trainer's command and environment (`eyrie.stages.train.command`) read the target, vocab, extraction,
    train and promotion sections.

    With `train.hidden_states: online`, `server_url` is the extraction server's (up, serving the captured layers)
    and `data.hidden_dir` its tmpfs storage path: the trainer asks it for every sample (eyrie.stages.train.online)."""
    if manifest := finished_manifest(out_dir / "manifest.json", key):
        manifest = placed(manifest, out_dir)
        if Path(manifest["checkpoint"]).is_dir():
            return manifest
        # A manifest of absolute paths (written before they were kept relative) whose run folder moved since.
        log(
            f"the train manifest names {manifest['checkpoint']}, which is not there (the run folder moved): "
            "written again"
        )
    online = config.train.hidden_states == "online"
    if online and not server_url:  # before anything is written under out_dir
        raise EyrieError("train.hidden_states is online, but no extraction server was given to train from")
    adopt_lineage(out_dir, key, config.train, log)
    work = out_dir / key
    save_path = work / "checkpoints"
    device = resolve_device(config.train)
    notes = resume_notes(config.train, work, device)
    for note in notes:
        log(f"warning: {note}")
    spe = steps_per_epoch(seq_lens, config.train.max_seq_len, 1 - config.train.val_fraction)
    if device == "cuda" and config.train.devices > 1:  # speculators deals the packed batches out across the ranks,
        spe = math.ceil(spe / config.train.devices)  # and checkpoint_freq is a share of one rank's steps
    every = config.train.save_every_steps
    freq = 1.0 if not every or every >= spe else max(every / spe, 1 / spe)
    if online:
        if not on_tmpfs(data.hidden_dir):
            log(f"warning: online hidden states go through {data.hidden_dir}, not a tmpfs: they touch the disk")
        dropped = clean(data.hidden_dir)  # requests a killed trainer left in flight: nobody will read them
        if dropped[0]:
            log(f"removed {dropped[0]} unread hidden-state files ({dropped[1]} bytes) left by an earlier trainer")
    # speculators saves `interrupted/` on SIGTERM but never resumes from it (it resumes from the newest numbered
    # checkpoint, as Eyrie reports); left there, it only draws a warning on every later launch.
    shutil.rmtree(save_path / "interrupted", ignore_errors=True)
    for note in recover(save_path):
        log(note)
    resumed_from = newest_whole_checkpoint(save_path)
    plateau = read_json(save_path / PLATEAU)
    if plateau:  # stopped on a plateau before its manifest was written: nothing left to train
        log(f"training stopped on a validation plateau at epoch {plateau.get('epoch')}; not relaunched")
        return _train_manifest(
            config.train, out_dir, key, save_path, device, work / "train.log", resumed_from, data.data_dir, notes
        )
    state = read_json(resumed_from / "training_state.json") if resumed_from else None
    switches = launch_switches(config.train, spe, (state or {}).get("global_step") or 0, work / METRICS)
    cmd = training_command(
        config,
        data,
        save_path,
        freq,
        device,
        warm_start,
        server_url=server_url if online else None,
        switches=switches,
    )
    log(
        f"training on {device} ({spe} steps/epoch, checkpoint every {freq:g} epoch)"
        + (f"; resuming from {resumed_from} (global step {state and state.get('global_step')})" if resumed_from else "")
    )
    env = trainer_environment(config, device, online, log_dir=work / "logs")
    missing_loggers(config.train.loggers)
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "train.log"
    with open(log_path, "ab") as f:
        f.write(f"\n===== eyrie: {' '.join(cmd)}\n".encode())
        f.flush()
        trainer = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        try:
            record_launch(work, spe, config.train.epochs, trainer.pid)  # for `eyrie status` and the task's watcher
            rc = trainer.wait()
            record_exit(work, rc)
        except BaseException:  # interrupted: as subprocess.run would, the trainer is killed before this returns
            trainer.kill()
            trainer.wait()
            raise
    if online:
        left = leftover_bytes(data.hidden_dir)
        if left:  # a sample speculators gave up on (its file came after the retry), or a killed trainer's
            n, size = clean(data.hidden_dir)
            log(f"removed {n} unread hidden-state files ({size} bytes) from {data.hidden_dir}")
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise EyrieError(
            f"training exited with code {rc}; checkpoints so far are kept in {save_path} and the "
            f"next run resumes from them. End of {log_path}:\n{tail}"
        )
    return _train_manifest(config.train, out_dir, key, save_path, device, log_path, resumed_from, data.data_dir, notes)


def _train_manifest(
    train: TrainConfig,
    out_dir: Path,
    key: str,
    save_path: Path,
    device: str,
    log_path: Path,
    resumed_from,
    data_dir: Path,
    notes: list[str] | None = None,
) -> dict:
    final = newest_whole_checkpoint(save_path)
    if final is None:
        raise EyrieError(f"training finished but wrote no checkpoint under {save_path}")
    rows = history(save_path)
    trained = Metrics()
    trained.add(read_rows(save_path.parent / METRICS)[0])
    rows = with_training_metrics(rows, trained.table())
    plateau = read_json(save_path / PLATEAU)
    if plateau and plateau.get("best_epoch") is not None and is_whole(save_path / str(plateau["best_epoch"])):
        final = save_path / str(plateau["best_epoch"])  # the plateau's last epochs were no better
    state = read_json(final / "training_state.json") or {}
    improving = None if plateau else still_improving(rows, train.still_improving_warning)
    manifest = {
        "stage": "train",
        "key": key,
        # Paths relative to out_dir (`portable`): a moved run folder is reused whole (`placed`).
        "checkpoint": portable(final, out_dir),
        "device": device,
        "epochs": train.epochs,
        "global_step": state.get("global_step"),
        "resumed_from": portable(resumed_from, out_dir) if resumed_from else None,
        # Counted over the draft starts vLLM makes (what the train/serve gap compares): once, here, not per run.
        "val_metrics": like_for_like_metrics(epoch_validation(final), data_dir, train.val_fraction),
        "stopped_on_plateau": plateau,
        "warnings": [*(notes or []), *([improving] if improving else [])],
        "log": portable(log_path, out_dir),
        "history": rows,
        "files": list_files(out_dir, files_under(final)),  # the shipped checkpoint
    }
    atomic_write_json(out_dir / "manifest.json", manifest)
    return placed(manifest, out_dir)


PATHS = ("checkpoint", "resumed_from", "log")


def placed(manifest: dict, out_dir: Path) -> dict:
    """The train manifest with its paths (`PATHS`) under the folder's current place."""
    return {**manifest, **{k: located(manifest.get(k), out_dir) for k in PATHS}}


def untrained_key(config: PipelineConfig, vocab_key: str, aux_ids: list[int]) -> str:
    """What an untrained drafter is made of (`eyrie.run.identity.STAGES["untrained"]`): the target (its config and
    the tensors it borrows), the draft vocabulary, the captured layers, and the drafter's own shape and seed. The
    whole config: the key is computed from the declaration's dotted paths."""
    return stage_key("untrained", config, vocab=vocab_key, aux=list(aux_ids))


def untrained_drafter(config: PipelineConfig, out_dir: Path, key: str, data: TrainingData) -> Path:
    """A freshly initialised drafter of the same shape (speculators' --dry-run): the evaluation baseline, kept
    under its key (`untrained_key`), so a changed target, vocabulary or drafter shape gets a new one. The whole
    config: speculators' command (`eyrie.stages.train.command.training_command`) reads it across sections."""
    path = out_dir / f"untrained-{key}"
    if (path / "model.safetensors").exists():
        return path
    staging = out_dir / f"untrained-{key}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    # Initialising needs no accelerator: always on CPU, one process.
    cmd = training_command(config, data, staging, 1.0, "cpu", dry_run=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_environment({}))
    if r.returncode != 0:
        raise EyrieError(f"could not initialise the untrained drafter:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    os.replace(staging, path)
    return path
