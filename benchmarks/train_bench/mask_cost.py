"""What the drafter's block mask costs per step eagerly against compiled, and what compiling it costs once.

train.speed.deferred_mask_compile builds speculators' EAGLE-3 block mask eagerly on every step
(eyrie/stages/train/drafter.py: torch.compiler.disable on the drafter's `_build_attn_mask`) instead of compiling the
builder inside the first step. This times, on one GPU (or `--device cpu`) and with torch alone (speculators need not be
installed), the builder as speculators writes it (`create_combined_mask_mod`, copied below from speculators 0.9.0's
models/eagle3/attention.py, under `create_block_mask`) over a packed sequence of the trainer's shape: eager per call,
the first compiled call from a cold Inductor cache, compiled per call after it, and Eyrie's eager builder from the
documents' block layout (eyrie/stages/train/block_mask.py), the one the trainer uses, per call. One JSON line per
layout. Run:

`python3 benchmarks/train_bench/mask_cost.py [--seq 4096] [--calls 50] [--device cpu]`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def create_combined_mask_mod(document_ids, total_seq_len: int, sliding_window: int | None = None):
    """speculators 0.9.0's (models/eagle3/attention.py), unchanged."""
    import torch
    from torch.nn.attention.flex_attention import and_masks, or_masks

    def causal_mask_mod(_b, _h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        if sliding_window is not None:
            causal = causal & (kv_idx > q_idx - sliding_window)
        return causal

    def document_mask_mod(_b, _h, q_idx, kv_idx):
        return torch.logical_and(
            document_ids[q_idx] != -1,
            document_ids[q_idx] == document_ids[kv_idx % total_seq_len],
        )

    def diagonal_draft_mask_mod(_b, _h, q_idx, kv_idx):
        return kv_idx % total_seq_len == q_idx

    return or_masks(and_masks(causal_mask_mod, document_mask_mod), diagonal_draft_mask_mod)


def build(doc_ids, seq_len: int, device):
    """`Eagle3DraftModel._build_attn_mask` with `_create_mask_fn` = flex attention's `create_block_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = create_combined_mask_mod(doc_ids, seq_len)
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)


def by_layout(doc_ids, seq_len: int, device):
    """Eyrie's eager builder (eyrie/stages/train/block_mask.py): the same BlockMask from the documents' block layout."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from eyrie.stages.train.block_mask import document_block_mask

    return document_block_mask(doc_ids, seq_len, create_combined_mask_mod(doc_ids, seq_len), 128)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _per_call_ms(fn, docs, seq: int, calls: int, device: str) -> float:
    times = []
    for d in docs[:calls]:
        _sync(device)
        start = time.perf_counter()
        fn(d, seq, device)
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mask-cost-"))  # cold
    import torch

    seq, dev = args.seq, args.device
    layouts = {
        "two_docs_shifted_then_pad": lambda: torch.cat(
            [torch.zeros(seq // 2 - 1), torch.ones(seq // 2 - 1), -torch.ones(2)]
        ).long(),
        "eight_docs": lambda: torch.arange(seq) // (seq // 8),
    }
    for name, make in layouts.items():
        docs = [make().to(dev) for _ in range(args.calls + 5)]  # a new tensor a step, as the trainer's batches
        for d in docs[:5]:
            build(d, seq, dev)  # warm-up: kernels loaded, caches of the eager path filled
        eager_ms = _per_call_ms(build, docs[5:], seq, args.calls, dev)
        torch._dynamo.reset()
        compiled = torch.compile(build)
        _sync(dev)
        start = time.perf_counter()
        compiled(docs[0], seq, dev)
        _sync(dev)
        first_s = round(time.perf_counter() - start, 2)
        compiled_ms = _per_call_ms(compiled, docs[5:], seq, args.calls, dev)
        layout_ms = _per_call_ms(by_layout, docs[5:], seq, args.calls, dev)
        same_layout = bool(by_layout(docs[1], seq, dev).to_dense().equal(build(docs[1], seq, dev).to_dense()))
        same = bool(compiled(docs[1], seq, dev).to_dense().equal(build(docs[1], seq, dev).to_dense()))
        line = dict(
            what="mask_cost",
            layout=name,
            seq=seq,
            eager_ms_per_call=eager_ms,
            compiled_first_call_s=first_s,
            compiled_ms_per_call=compiled_ms,
            block_layout_ms_per_call=layout_ms,
            same_mask=same,
            same_mask_from_block_layout=same_layout,
            torch=torch.__version__,
            device=torch.cuda.get_device_name() if dev == "cuda" else f"cpu ({os.cpu_count()} cores)",
        )
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
