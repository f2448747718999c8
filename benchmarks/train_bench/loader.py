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
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.config import TrainConfig

    from eyrie.stages.train.loaders import train_val_loaders
    from eyrie.stages.train.options import OPTIONS_FLAG, TrainerOptions

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
    t0 = time.perf_counter()
    train, _ = train_val_loaders(  # the entry's own loaders (eyrie/stages/train/loaders.py)
        a,
        hidden_size=d["hidden"],
        num_target_layers=len(d["aux"]),
        preprocess=shift_batch,
        switches=switches if cuda else None,
        device="cuda" if cuda else "cpu",
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
