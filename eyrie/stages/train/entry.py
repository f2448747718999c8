"""`python -m eyrie.stages.train.entry ARGS` or `torchrun ... -m eyrie.stages.train.entry ARGS`: speculators' EAGLE-3
trainer.

ARGS are speculators' own, plus Eyrie's: `--eyrie-options PATH` (the run folder's trainer-options.json,
eyrie/stages/train/options.py: cpu or cuda, train.target_transform, and train.speed's choices resolved for this
launch), `--eyrie-metrics`, `--eyrie-verifier-weights`, `--eyrie-plateau` and the online flags.

On CPU it first patches the places where speculators 0.9.0 assumes an accelerator (the device it moves the model and
batches to and resumes onto, pinned loader memory, `torch.accelerator.synchronize`, and the autocast device type), so
the demo and CI train the same way a GPU node does. On GPUs it changes only what costs time, each behind a choice of
train.speed (patches/switches.py), the drafter's on the built instance alone (eyrie/stages/train/drafter.py): AdamW runs
fused and applies the gradient clip itself, no step synchronises the GPU except logged ones, batches are copied to the
GPU ahead of their step on a stream of their own, the progress bar is off, a fresh drafter is initialised on its GPU,
data-loader workers are forked from a server started first thing, and on one GPU forward and backward run on bfloat16
copies of the float32 weights made once a step; the start-up choices (deferred_mask_compile, one_kv_length,
eager_rotary, one_pointwise_config, warm_compile_workers) trade the cold start against tokens/s (docs/stages/train.md,
Start-up). benchmarks/train_throughput.py turns any off (`--off NAME`) to measure it.
torch.compile's cache goes beside the run's checkpoints, so a retry or resume finds its kernels compiled. Every save
keeps the whole checkpoint it overwrites until the new one is whole (eyrie/stages/train/checkpoints.py).
"""

from __future__ import annotations

import json
import os
import sys

from eyrie.stages.train.options import TrainerOptions, pop_options
from eyrie.stages.train.patches.plateau import PlateauReached
from eyrie.stages.train.patches.workers import _start_worker_server
from eyrie.stages.train.progress import record_metrics


def _compile_cache_beside(save_path: str | None) -> None:
    """torch.compile's caches (Inductor's FX graph and AOTAutograd caches, Triton kernels) default to /tmp, which a
    fresh container or node does not have. `<run>/train/compile-cache` survives a retry or resume wherever the run
    folder does; it is keyed by content, so drafters of other keys share it safely. An explicit
    TORCHINDUCTOR_CACHE_DIR wins."""
    if save_path:
        from pathlib import Path

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(save_path).resolve().parent.parent / "compile-cache"))


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _pop_option(argv: list[str], name: str) -> str | None:
    if name not in argv:
        return None
    i = argv.index(name)
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def _online_hidden_states(argv: list[str]) -> tuple[str | None, int] | None:
    """`--eyrie-online` (train.hidden_states: online, eyrie/stages/train/online.py), taken out of `argv`: the
    loaders' datasets ask Eyrie's extraction server by its served name and API key
    (eyrie/stages/train/online_dataset.py). Returns (the API key's variable, requests in flight), or None."""
    from eyrie.stages.train.online import API_KEY_ENV_FLAG, CONCURRENCY_FLAG, ONLINE_FLAG

    key_env = _pop_option(argv, API_KEY_ENV_FLAG)
    concurrency = _pop_option(argv, CONCURRENCY_FLAG)
    if ONLINE_FLAG not in argv:
        return None
    argv.remove(ONLINE_FLAG)
    return key_env, int(concurrency or 8)


def build_drafter(args, model_class, t2d, d2t, draft_vocab_size, options: TrainerOptions, verifier_names):
    """speculators' drafter build (`cli.build_draft_model`: fresh, from a config, or a warm start), with: the
    target's embedding, norm and head loaded by the checkpoint's own names (preflight resolved them:
    patches/verifier.py), a fresh drafter built on its GPU (build_on_gpu: its weights initialised there, not on the
    CPU and then moved), float32 weights to train (a warm start loads as exported, bfloat16), and the labels made
    with the target's own transform (train.target_transform, patches/target_transform.py); on GPUs train.speed's
    choices for the drafter bound on the built instance (eyrie/stages/train/drafter.py)."""
    import contextlib

    import torch
    from speculators.train import cli

    from eyrie.stages.train.patches.verifier import _load_verifier_weights_by

    if verifier_names:
        _load_verifier_weights_by(verifier_names)
    s = options.switches
    on_gpu = options.device != "cpu" and s.build_on_gpu and not getattr(args, "from_pretrained", None)
    import os

    place = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else contextlib.nullcontext()
    with place:
        model = cli.build_draft_model(args, model_class, t2d, d2t, draft_vocab_size).float()
    if options.target_transform:
        from eyrie.stages.train.patches.target_transform import apply_target_transform

        verifier = model.config.speculators_config.verifier.name_or_path
        apply_target_transform(model, verifier, getattr(args, "trust_remote_code", False))
    if options.device != "cpu":  # the drafter's speed choices, bound on this instance (drafter.py)
        from eyrie.stages.train.drafter import apply_speed_choices

        apply_speed_choices(model, s)
    return model


def train(cfg, options: TrainerOptions, plateau=None, verifier_names=None, online=None) -> None:
    """speculators' `cli.main` for EAGLE-3, composed from its parts: its seed, loggers, distributed set-up, vocab
    mappings and drafter build (`build_drafter`), Eyrie's loaders (eyrie/stages/train/loaders.py) and
    `EyrieTrainer` (eyrie/stages/train/eyrie_trainer.py). The checkpoints are speculators' own; a `--dry-run` saves
    the initialised drafter as speculators' does. tests/unit/test_train_patch_guards.py fails when `cli.main`
    changes in speculators, so the composition is checked again."""
    import argparse
    import gc

    import torch
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import cli
    from speculators.train.distributed import get_rank, maybe_destroy_distributed, maybe_setup_distributed
    from speculators.train.logger import log_run_config, setup_metric_logger, setup_root_logger
    from speculators.train.trainer import TrainerConfig

    from eyrie.stages.train.eyrie_trainer import EyrieTrainer
    from eyrie.stages.train.loaders import train_val_loaders

    args = argparse.Namespace(**cfg.flatten())
    if args.speculator_type != "eagle3" or args.fsdp_shard:
        raise SystemExit(
            f"eyrie: the trainer trains EAGLE-3 drafters without FSDP; asked for {args.speculator_type}"
            + (" with --fsdp-shard" if args.fsdp_shard else "")
        )
    cli.set_seed(args.seed, args.deterministic_cuda)
    setup_root_logger()
    setup_metric_logger(loggers=args.logger, run_name=args.run_name, output_dir=args.log_dir)
    maybe_setup_distributed()
    log_run_config(cfg)
    if not args.draft_mrope_full_head_hack:
        from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary

        install_partial_neox_rotary()
    if get_rank() == 0:
        cfg.save(args.save_path)
    hidden_states_dtype = getattr(torch, args.hidden_states_dtype)
    d2t, t2d, draft_vocab_size = cli.parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry[args.speculator_type]  # type: ignore[index]
    model = build_drafter(args, model_class, t2d, d2t, draft_vocab_size, options, verifier_names)
    if args.dry_run:  # the initialised drafter, saved as speculators' --dry-run saves it
        model.to(hidden_states_dtype)
        if get_rank() == 0:
            model.save_pretrained(args.save_path)
        maybe_destroy_distributed()
        return
    switches = options.switches if options.device != "cpu" else None
    train_loader, val_loader = train_val_loaders(
        args,
        hidden_size=model.config.transformer_layer_config.hidden_size,
        num_target_layers=len(model.target_layer_ids),
        preprocess=shift_batch,
        switches=switches,
        device=options.device,
        online=online,
    )
    train_call_kwargs, val_call_kwargs = model_class.get_trainer_kwargs(**vars(args))
    config = TrainerConfig(
        num_epochs=args.epochs,
        save_path=args.save_path,
        lr=args.lr,
        resume_from_checkpoint=not args.no_resume_from_checkpoint,
        train_call_kwargs=train_call_kwargs,
        val_call_kwargs=val_call_kwargs,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        muon_lr=args.muon_lr,
        muon_momentum=args.muon_momentum,
        muon_weight_decay=args.muon_weight_decay,
        muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr_fn=args.muon_adjust_lr_fn,
        scheduler_type=args.scheduler_type,
        scheduler_warmup_steps=args.scheduler_warmup_steps,
        scheduler_warmup_ratio=args.scheduler_warmup_ratio,
        scheduler_total_steps=args.scheduler_total_steps,
        scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
        checkpoint_freq=args.checkpoint_freq,
        save_best=args.save_best,
        hidden_states_dtype=hidden_states_dtype,
        log_freq=args.log_freq,
        fsdp_shard=args.fsdp_shard,
        gradient_checkpointing=args.gradient_checkpointing,
        max_steps=args.max_steps,
    )
    trainer = EyrieTrainer(
        model, config, train_loader, val_loader, device=options.device, switches=switches, plateau=plateau
    )
    from eyrie.stages.train.drafter import inductor_settings

    try:
        with inductor_settings(switches):
            trainer.run_training()
    except PlateauReached as stop:
        print(f"eyrie: {stop}; training stops here", flush=True)
    del trainer, model
    gc.collect()
    if options.device != "cpu":
        torch.cuda.empty_cache()
    maybe_destroy_distributed()


def main(argv: list[str]) -> None:
    options = pop_options(argv)  # --eyrie-options: the device, the labels' transform, train.speed (options.py)
    switches = options.switches
    record_metrics(argv)  # --eyrie-metrics: speculators' metric records also to a file the flow watches
    if options.device != "cpu":
        if switches.forkserver_workers:
            _start_worker_server()
        _compile_cache_beside(_option(argv, "--save-path"))
        if switches.warm_compile_workers:
            from eyrie.stages.train.patches.compile import _warm_compile_workers

            _warm_compile_workers()
    names = _pop_option(argv, "--eyrie-verifier-weights")
    plateau = _pop_option(argv, "--eyrie-plateau")  # "patience,min_delta"
    from eyrie.hidden_states.encoding import reader_arguments

    argv = reader_arguments(argv)  # speculators' fp8 backend: dequantizes fp8 files, reads bf16 ones unchanged
    online = _online_hidden_states(argv)
    if options.device == "cpu":
        from eyrie.stages.train.patches.cpu import _run_on_cpu

        _run_on_cpu()
    from speculators.train.config import TrainConfig

    train(
        TrainConfig.resolve(argv),
        options,
        plateau=(int(plateau.split(",")[0]), float(plateau.split(",")[1])) if plateau else None,
        verifier_names=json.loads(names) if names else None,
        online=online,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
