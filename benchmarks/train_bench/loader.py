"""loader: speculators' train loader as Eyrie's command configures it, drained with no model."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from train_bench.common import GpuSampler, dims, emit
from train_bench.eyrie import eyrie_command


def cmd_loader(args) -> dict:
    """speculators' train loader exactly as Eyrie's command configures it (workers, prefetch, pinned memory, with
    eyrie.stages.train.entry's GPU patches unless --off), drained with no model: the batches per second that reading the
    files, collating and (with GPU_FEED) the copy to the GPU can deliver on their own."""

    import torch
    from hs_connectors import HiddenStatesBackend
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import dataloader
    from speculators.train.config import TrainConfig

    from eyrie.stages.train.options import OPTIONS_FLAG, TrainerOptions
    from eyrie.stages.train.patches import gpu

    d = dims(args)
    cmd, _, _ = eyrie_command(args, Path(args.root), args.optimizer)
    argv = cmd[cmd.index("eyrie.stages.train.entry") + 1 :]
    options = TrainerOptions.from_dict(json.loads(Path(argv[argv.index(OPTIONS_FLAG) + 1]).read_text()))
    switches = options.switches.without(*(n.lower() for n in args.off))
    for own in ("--eyrie-verifier-weights", "--eyrie-metrics", OPTIONS_FLAG):  # the entry's own options
        if own in argv:
            del argv[argv.index(own) : argv.index(own) + 2]
    a = argparse.Namespace(**TrainConfig.resolve(argv).flatten())
    cuda = torch.cuda.is_available()
    if cuda:
        gpu._gpu_speedups(switches)
    transfer = HiddenStatesBackend.registry[a.hidden_states_backend].from_train_args(a, a.data_path)
    t0 = time.perf_counter()
    train, _ = dataloader.create_train_val_loaders(
        data_path=a.data_path,
        total_seq_len=a.total_seq_len,
        hidden_states_dtype=getattr(torch, a.hidden_states_dtype),
        transfer=transfer,
        vllm_endpoint=a.vllm_endpoint,
        on_missing=a.on_missing,
        verifier_name_or_path=a.verifier_name_or_path,
        request_timeout=a.request_timeout,
        max_retries=a.max_retries,
        generation_validation_retries=a.generation_validation_retries,
        max_consecutive_generation_failures=a.max_consecutive_generation_failures,
        hidden_size=d["hidden"],
        num_target_layers=len(d["aux"]),
        num_workers=a.num_workers,
        prefetch_factor=a.prefetch_factor,
        preprocess=shift_batch,
        train_data_ratio=a.train_data_ratio,
        seed=a.seed,
    )
    sampler = GpuSampler()
    sampler.start()
    skip, n, tokens, t_first, t_start = 8, 0, 0, None, 0.0
    for batch in train:
        n += 1
        if n == 1:
            t_first = time.perf_counter() - t0
        if n == skip:
            if cuda:
                torch.cuda.synchronize()
            t_start, w0 = time.perf_counter(), time.time()
        elif n > skip:
            tokens += int((batch["document_ids"] != -1).sum())
        if n >= skip + args.loader_batches:
            break
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t_start
    sampler.stop.set()
    del train
    return emit(
        args,
        {
            "what": "loader",
            "tag": args.tag,
            "workers": a.num_workers,
            "prefetch_factor": a.prefetch_factor,
            "off": args.off,
            "s_to_first_batch": round(t_first or 0.0, 1),
            "batches": n - skip,
            "batches_per_s": round((n - skip) / dt, 2),
            "tokens_per_s": round(tokens / dt),
            "host": sampler.summary(w0, time.time()),
        },
    )
