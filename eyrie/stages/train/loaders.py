"""The trainer's loaders, composed from speculators' parts (its `ArrowDataset`, packing batch sampler and
`CollateFn`) the way `speculators.train.dataloader.create_train_val_loaders` composes them, with Eyrie's readers
chosen here instead of registered over speculators' own:

- the hidden states read through `eyrie.hidden_states.pack_reader`'s backends (files and packs, bf16 and fp8), or on
  GPUs with fp8_on_gpu `gpu_decode`'s (fp8 bytes carried to the GPU, decoded there, collated by `CarryingCollate`);
- online (train.hidden_states: online) `OnlineDataset`, which asks Eyrie's extraction server for each sample;
- workers that read files without a CUDA context (`workers._worker_init`), forked from a server started first thing
  (forkserver_workers) instead of spawned; no pinned memory on CPU; on GPUs with gpu_feed, batches copied to the GPU
  ahead of their step (`feed._copied_ahead`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.dataloader import _limit_worker_threads
from speculators.train.distributed import get_dp_rank, get_dp_size
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from torch.utils.data import DataLoader

from eyrie.stages.train.patches.switches import Switches


class GpuFedLoader(DataLoader):
    """A loader whose batches arrive on the GPU, copied on a stream of their own up to `ahead` steps ahead; the
    trainer's own `.to()` then finds them there and does nothing."""

    def __init__(self, *args, ahead: int = 2, fp8_on_gpu: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.ahead = ahead
        self.fp8_on_gpu = fp8_on_gpu

    def __iter__(self):
        from eyrie.stages.train.patches.feed import _copied_ahead

        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return _copied_ahead(super().__iter__(), device, self.ahead, self.fp8_on_gpu)


def transfer_for(args, switches: Switches | None):
    """The hidden-state reader for speculators' `--hidden-states-backend` (`file` or `fp8`), reading packs too."""
    from hs_connectors import HiddenStatesBackend

    from eyrie.hidden_states import pack_reader

    backend = args.hidden_states_backend
    if backend == "fp8" and switches is not None and switches.gpu_feed and switches.fp8_on_gpu:
        from eyrie.hidden_states.gpu_decode import CarriedFP8Backend

        return CarriedFP8Backend.from_train_args(args, args.data_path), True
    readers: dict[str, Any] = {"file": pack_reader.PackedFileBackend, "fp8": pack_reader.PackedFP8Backend}
    cls = readers.get(backend) or HiddenStatesBackend.registry[backend]
    return cls.from_train_args(args, args.data_path), False


def make_loader(
    dataset,
    args,
    hidden_size: int,
    num_target_layers: int,
    preprocess,
    switches: Switches | None,
    device: str,
    carried: bool,
    max_batches: int | None = None,
) -> DataLoader:
    """speculators' `_setup_dataloader`, with Eyrie's workers, pinning, collate and GPU feed."""
    from eyrie.stages.train.patches.workers import _WORKER_SERVER_PRELOAD, _worker_init

    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=args.total_seq_len,
        lengths=dataset.approx_lengths,
        num_replicas=get_dp_size(),
        rank=get_dp_rank(),
        seed=args.seed,
        max_batches=max_batches,
    )
    collate_class: type = CollateFn
    if carried:
        from eyrie.hidden_states.gpu_decode import CarryingCollate

        collate_class = CarryingCollate
    workers = args.num_workers
    context: Any = None
    if workers > 0:
        context = "spawn"
        if switches is not None and switches.forkserver_workers:
            import multiprocessing

            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(_WORKER_SERVER_PRELOAD)
    gpu = device != "cpu" and switches is not None
    kwargs: dict[str, Any] = dict(
        batch_sampler=sampler,
        num_workers=workers,
        prefetch_factor=args.prefetch_factor if workers > 0 else None,
        pin_memory=device != "cpu" and (switches is None or switches.pinned_loader or not switches.gpu_feed),
        collate_fn=collate_class(
            args.total_seq_len,
            hidden_size,
            num_target_layers=num_target_layers,
            dtype=dataset.hidden_states_dtype,
            preprocess=preprocess,
        ),
        persistent_workers=workers > 0,
        multiprocessing_context=context,
        worker_init_fn=_worker_init if workers > 0 else None,
    )
    if gpu and switches.gpu_feed:  # type: ignore[union-attr]
        return GpuFedLoader(dataset, ahead=switches.feed_ahead, fp8_on_gpu=switches.fp8_on_gpu, **kwargs)  # type: ignore[union-attr]
    return DataLoader(dataset, **kwargs)


def train_val_loaders(
    args,
    hidden_size: int,
    num_target_layers: int,
    preprocess,
    switches: Switches | None,
    device: str,
    online: tuple[str | None, int] | None = None,
) -> tuple[DataLoader, DataLoader]:
    """speculators' `create_train_val_loaders` composed with Eyrie's readers. `online`: (the variable holding the
    extraction server's API key, requests in flight), or None for files."""
    _limit_worker_threads()
    if not 0.0 < args.train_data_ratio < 1.0:
        raise ValueError(f"train_data_ratio must be in (0, 1), got {args.train_data_ratio}")
    transfer, carried = transfer_for(args, switches)
    dataset_class: type = ArrowDataset
    if online is not None:
        from eyrie.stages.train.online_dataset import OnlineDataset

        OnlineDataset.api_key_env, OnlineDataset.concurrency = online
        dataset_class = OnlineDataset
    common = dict(
        datapath=args.data_path,
        max_len=args.total_seq_len,
        transfer=transfer,
        vllm_endpoint=args.vllm_endpoint,
        on_missing=args.on_missing,
        train_ratio=args.train_data_ratio,
        model=args.verifier_name_or_path,
        hidden_states_dtype=getattr(torch, args.hidden_states_dtype),
        request_timeout=args.request_timeout,
        max_retries=args.max_retries,
        generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures,
    )
    train = dataset_class(split="train", **common)
    val = dataset_class(split="val", **common)
    loader = dict(
        args=args,
        hidden_size=hidden_size,
        num_target_layers=num_target_layers,
        preprocess=preprocess,
        switches=switches,
        device=device,
        carried=carried,
    )
    return make_loader(train, **loader), make_loader(val, **loader)  # type: ignore[arg-type]
