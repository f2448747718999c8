"""`python -m eyrie.stages.train.entry ARGS` or `torchrun ... -m eyrie.stages.train.entry ARGS`: speculators' EAGLE-3
trainer.

ARGS are speculators' own, plus Eyrie's: `--eyrie-options PATH` (the run folder's trainer-options.json,
eyrie/stages/train/options.py: cpu or cuda, train.target_transform, and train.speed's choices resolved for this
launch), `--eyrie-metrics`, `--eyrie-verifier-weights`, `--eyrie-plateau` and the online flags.

On CPU it first patches the places where speculators 0.9.0 assumes an accelerator (the device it moves the model and
batches to and resumes onto, pinned loader memory, `torch.accelerator.synchronize`, and the autocast device type), so
the demo and CI train the same way a GPU node does. On GPUs it changes only what costs time, each behind a choice of
train.speed (patches/switches.py): AdamW runs fused and applies the gradient clip itself, no step synchronises the
GPU except logged ones, batches are copied to the GPU ahead of their step on a stream of their own, the progress bar
is off, a fresh drafter is initialised on its GPU, data-loader workers are forked from a server started first thing,
and on one GPU forward and backward run on bfloat16 copies of the float32 weights made once a step; the start-up
choices (deferred_mask_compile, one_kv_length, eager_rotary, one_pointwise_config, warm_compile_workers) trade the
cold start against tokens/s (docs/stages/train.md, Start-up). benchmarks/train_throughput.py turns any off
(`--off NAME`) to measure it.
torch.compile's cache goes beside the run's checkpoints, so a retry or resume finds its kernels compiled. Every save
keeps the whole checkpoint it overwrites until the new one is whole (eyrie/stages/train/checkpoints.py).
"""

from __future__ import annotations

import json
import os
import sys

from eyrie.stages.train.options import pop_options
from eyrie.stages.train.patches.build import _train_in_float32
from eyrie.stages.train.patches.cpu import _run_on_cpu
from eyrie.stages.train.patches.gpu import _gpu_speedups
from eyrie.stages.train.patches.plateau import PlateauReached, _record_validation
from eyrie.stages.train.patches.saving import _keep_the_last_whole_checkpoint
from eyrie.stages.train.patches.target_transform import _apply_target_transform
from eyrie.stages.train.patches.verifier import _load_verifier_weights_by
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


def _online_hidden_states(argv: list[str]) -> None:
    """`--eyrie-online` (train.hidden_states: online, eyrie/stages/train/online.py): speculators' generate path builds
    the loaders'
    datasets, asking Eyrie's extraction server by its served name and API key (eyrie/stages/train/online_dataset.py)."""
    from eyrie.stages.train.online import API_KEY_ENV_FLAG, CONCURRENCY_FLAG, ONLINE_FLAG

    key_env = _pop_option(argv, API_KEY_ENV_FLAG)
    concurrency = _pop_option(argv, CONCURRENCY_FLAG)
    if ONLINE_FLAG in argv:
        argv.remove(ONLINE_FLAG)
        from eyrie.stages.train.online_dataset import install

        install(key_env, int(concurrency or 8))


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
    if names:
        _load_verifier_weights_by(json.loads(names))
    _train_in_float32()
    _keep_the_last_whole_checkpoint()
    plateau = _pop_option(argv, "--eyrie-plateau")  # "patience,min_delta"
    _record_validation((int(plateau.split(",")[0]), float(plateau.split(",")[1])) if plateau else None)
    from eyrie.hidden_states.encoding import reader_arguments

    argv = reader_arguments(argv)  # speculators' fp8 backend: dequantizes fp8 files, reads bf16 ones unchanged
    from eyrie.hidden_states import pack_reader

    pack_reader.install()  # ... and reads packed storage (extraction.storage: packed); the GPU's install keeps it
    _online_hidden_states(argv)
    if options.device == "cpu":
        _run_on_cpu()
    else:
        _gpu_speedups(switches)
    if options.target_transform:  # the labels made with the target's own transform (train.target_transform)
        _apply_target_transform("--trust-remote-code" in argv)
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    try:
        train(TrainConfig.resolve(argv))
    except PlateauReached as stop:
        from speculators.train.distributed import maybe_destroy_distributed

        print(f"eyrie: {stop}; training stops here", flush=True)
        maybe_destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
