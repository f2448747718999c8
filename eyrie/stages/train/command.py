"""The trainer's command line (speculators' CLI through eyrie.stages.train.entry) and its environment."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from eyrie.config import PipelineConfig, TargetConfig
from eyrie.errors import EyrieError
from eyrie.run.environment import child_environment
from eyrie.stages.train.data import TrainingData
from eyrie.stages.train.online import online_args
from eyrie.stages.train.options import OPTIONS, OPTIONS_FLAG, TrainerOptions
from eyrie.stages.train.patches.switches import Switches, decide
from eyrie.stages.train.progress import METRICS, METRICS_FLAG
from eyrie.target.drafter import draft_layer_config


def learning_rate(config: PipelineConfig, warm: bool) -> float:
    """train.lr, scaled down for a warm start: at the rate that trains a drafter from scratch, a trained one's first
    steps undo what it learned (measured in the README, "Retraining")."""
    return config.train.lr * (config.promotion.warm_start_lr_scale if warm else 1.0)


# The files of a hub target the trainer reads besides the borrowed tensors' weight files: configs, tokenizer, code.
VERIFIER_FILES = ("*.json", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.tokenizer")


def verifier_source(target: TargetConfig, borrowed: dict[str, str]) -> str:
    """Where the trainer reads the verifier from (its config, tokenizer and the embedding, norm and head it
    borrows): a local target's folder; a hub target's snapshot at the commit its revision resolves to (the run
    pins it: the hidden states came from that commit), holding its small files and only the weight files of the
    borrowed tensors and of their modules' other tensors (a norm's or a head's bias, which the labels apply).
    speculators, given a hub id, would read every file from the default branch."""
    from eyrie.target.metadata import is_local_target

    if is_local_target(target):
        return str(target.model)
    from huggingface_hub import hf_hub_download, snapshot_download

    from eyrie.target.hub import hub_commit

    commit = hub_commit(target.model, "model", target.revision)
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    try:
        index = hf_hub_download(target.model, "model.safetensors.index.json", revision=commit, local_files_only=offline)
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        # The borrowed tensors' shards, and those of their modules' other tensors (a final norm's or a head's
        # bias: the labels apply them, eyrie/stages/train/patches/target_transform.py).
        modules = tuple(n.rsplit(".", 1)[0] + "." for n in borrowed.values())
        shards = sorted({f for n, f in weight_map.items() if n in borrowed.values() or n.startswith(modules)})
    except Exception:  # no index: one weight file
        shards = ["model.safetensors"]
    return snapshot_download(
        target.model,
        revision=commit,
        allow_patterns=[*VERIFIER_FILES, *shards],
        local_files_only=offline,
    )


def training_command(
    config: PipelineConfig,
    data: TrainingData,
    save_path: Path,
    checkpoint_freq: float,
    device: str,
    warm_start: Path | None = None,
    dry_run: bool = False,
    server_url: str | None = None,
    switches: Switches | None = None,
) -> list[str]:
    """The trainer's command line. `data.target_facts` is what preflight decided about the target
    (`PreflightReport.target_facts`): the checkpoint names of the tensors the drafter borrows, which
    `eyrie.stages.train.entry` hands to speculators' loader, and the mask token id.

    `server_url`: online hidden states (eyrie.stages.train.online) from the extraction server there; `hidden_dir` is
    then the
    server's tmpfs storage path. Without it the trainer reads files from `hidden_dir` and a missing one is an
    error.

    `switches`: train.speed resolved for this launch (`eyrie.stages.train.patches.switches.decide`; default: for a
    run of unknown length). They, the device and train.target_transform go to the trainer in
    `<save_path's folder>/trainer-options.json` (`--eyrie-options`)."""
    t = config.train
    if device == "cuda" and t.devices > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={t.devices}"]
    else:
        launcher = [sys.executable]
    args = [
        "-m",
        "eyrie.stages.train.entry",
        "--speculator-type",
        "eagle3",
        "--verifier-name-or-path",
        verifier_source(config.target, data.target_facts.get("verifier_weights") or {}),
        "--data-path",
        str(data.data_dir),
        "--d2t-path",
        str(data.d2t),
        "--t2d-path",
        str(data.t2d),
        "--draft-vocab-size",
        str(config.vocab.draft_vocab_size),
        "--target-layer-ids",
        *map(str, data.aux_ids),
        "--save-path",
        str(save_path),
        "--epochs",
        str(t.epochs),
        "--lr",
        str(learning_rate(config, warm_start is not None)),
        "--ttt-steps",
        str(t.ttt_steps),
        "--total-seq-len",
        str(t.max_seq_len),
        "--checkpoint-freq",
        str(checkpoint_freq),
        "--train-data-ratio",
        str(1 - t.val_fraction),
        "--seed",
        str(t.seed),
        *(
            online_args(
                server_url,
                data.hidden_dir,
                config.extraction.request_timeout_s,
                config.extraction.api_key_env,
                config.extraction.concurrency,
            )
            if server_url
            else ["--hidden-states-path", str(data.hidden_dir), "--on-missing", "raise"]
        ),
        "--loss-implementation",
        "eager",
        "--optimizer",
        t.optimizer,
        "--log-freq",
        str(t.log_every_steps),
        "--log-dir",
        str(save_path.parent / "logs"),
        "--logger",
        ",".join(t.loggers),  # speculators' own loggers, train.loggers; "" turns them all off
        "--eyrie-verifier-weights",
        json.dumps(data.target_facts["verifier_weights"], sort_keys=True),
    ]
    if config.target.trust_remote_code:
        args.append("--trust-remote-code")
    if data.target_facts.get("mask_token_id") is not None:
        args += ["--mask-token-id", str(data.target_facts["mask_token_id"])]
    if device == "cpu":  # no Triton, no flex attention kernels, no bf16 autocast benefit on CPU
        args += ["--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32", "--num-workers", "0"]
    if t.stop_on_plateau:
        args += ["--eyrie-plateau", f"{t.plateau_patience},{t.plateau_min_delta}"]
    if warm_start is not None:
        args += ["--from-pretrained", str(warm_start)]
    else:
        draft = save_path.parent / "draft_layer_config.json"
        draft.parent.mkdir(parents=True, exist_ok=True)
        draft_layer_config(config.target, t.num_layers).to_json_file(str(draft))
        args += ["--draft-config", str(draft)]
    if t.loggers and not dry_run:  # one name per drafter: a resumed training continues its MLflow run, its events
        args += ["--run-name", f"{config.name}-{save_path.parent.name[:8]}"]
    options = TrainerOptions(
        device="cuda" if device == "cuda" else "cpu",
        target_transform=t.target_transform,
        switches=switches or decide(t.speed, None),
    )
    args += [OPTIONS_FLAG, str(options.write(save_path.parent / OPTIONS))]
    if dry_run:
        args.append("--dry-run")
    else:  # the metrics the flow's watcher and `eyrie status` read (eyrie/stages/train/progress.py)
        args += [METRICS_FLAG, str(save_path.parent / METRICS)]
    return launcher + args


def _die_with_parent() -> None:
    """Linux: SIGTERM the trainer when the flow process dies (even by SIGKILL), so no orphan keeps writing
    checkpoints that the next run is about to resume from (speculators saves `interrupted/` on SIGTERM)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# train.loggers: speculators' metric loggers, each with the package it imports, the prefix of the variables that
# configure it (passed to the trainer, secrets included: the operator asked for that service) and, for those that
# otherwise write under the home folder or the working folder, where their files go inside the run folder.
LOGGERS = {
    "tensorboard": ("tensorboard", "TENSORBOARD_", {}),  # event files: --log-dir/<run name>
    "wandb": ("wandb", "WANDB_", {"WANDB_DIR": ""}),
    "trackio": ("trackio", "TRACKIO_", {"TRACKIO_DIR": "trackio"}),
    "mlflow": ("mlflow", "MLFLOW_", {"MLFLOW_TRACKING_URI": "mlruns"}),
}


def missing_loggers(loggers: Sequence[str]) -> None:
    """An EyrieError naming each logger of train.loggers whose package is not installed, before the trainer starts
    (speculators would fail at its first logged step)."""
    import importlib.util

    missing = [name for name in loggers if importlib.util.find_spec(LOGGERS[name][0]) is None]
    if missing:
        raise EyrieError(
            f"train.loggers names {', '.join(missing)}, but "
            + ", ".join(LOGGERS[n][0] for n in missing)
            + f" is not installed here: `pip install {' '.join(LOGGERS[n][0] for n in missing)}`, or remove it from "
            "train.loggers"
        )


def logger_environment(loggers: Sequence[str], log_dir: Path, environ=None) -> tuple[dict[str, str], list[str]]:
    """The variables train.loggers needs: (defaults that keep each logger's files in `log_dir`, unless the operator
    set them; the operator's variables of each logger passed through)."""
    env = os.environ if environ is None else environ
    extra: dict[str, str] = {}
    passed: list[str] = []
    for name in loggers:
        _, prefix, defaults = LOGGERS[name]
        passed += [k for k in env if k.startswith(prefix)]
        for var, sub in defaults.items():
            if var not in env:
                where = (log_dir / sub).resolve() if sub else log_dir.resolve()
                extra[var] = where.as_uri() if var == "MLFLOW_TRACKING_URI" else str(where)
    return extra, passed


def trainer_environment(
    config: PipelineConfig, device: str, online: bool, log_dir: Path | None = None
) -> dict[str, str]:
    """The trainer's environment: an allow-list of the flow's (eyrie/run/environment.py: no Prefect key, no hub
    token), online the variable extraction.api_key_env names (its client reads the server's key there), and
    train.loggers' variables (`logger_environment`, their files under `log_dir`). The device and every other choice
    reach the trainer in its options file (`training_command`), not here."""
    key_env = [config.extraction.api_key_env] if online and config.extraction.api_key_env else []
    loggers, logger_vars = logger_environment(config.train.loggers, log_dir or Path("logs"))
    return child_environment(
        {
            **loggers,
            "PYTHONUNBUFFERED": "1",
        },
        passed=key_env + logger_vars,
    )
