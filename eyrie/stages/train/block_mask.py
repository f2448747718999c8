"""speculators' EAGLE-3 block mask over packed documents, built from the documents' block layout instead of the
dense mask: the same `BlockMask` as `create_block_mask` gives for speculators' `create_combined_mask_mod`, eagerly, in
a few small tensor operations on [blocks, blocks] and [blocks, tokens] tensors.

`create_block_mask` evaluates the mask for every (query, key) pair (16.8M at 4096 tokens) and then sorts each row of
blocks: eager that took 117-383 ms a call on a 2-core CPU VM against 4.0-5.6 ms compiled and 1.2-1.5 ms here
(`cd benchmarks && python -m train_bench.mask_cost --device cpu --calls 20`, three runs, 2026-12-04, the commit adding
this module), and compiling it took 24 s of the first step on an H200 (its sort kernel alone 11 s). The mask is
`(causal & same document & not padding) | diagonal`, so a block pair's state follows from which documents each block
holds: below the diagonal a block pair is listed when the two blocks share a document and full when both hold that one
document alone; a diagonal block is always partial (the diagonal term, causal cut); above it nothing. The block lists
are ordered as `create_block_mask` orders them (a stable descending sort of each row) and handed to
`BlockMask.from_kv_blocks` with speculators' own mask_mod, so flex attention computes the partial blocks exactly as
before. tests/unit/test_train_block_mask.py compares it with `create_block_mask` field by field.
"""

from __future__ import annotations

import torch


def _canonical(doc: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Each token's document as a number in [0, seq_len): the sorted position of its document's first token; padding
    (-1) as seq_len. Fixed shapes, no host sync."""
    order = torch.sort(doc, stable=True)
    values, index = order.values, order.indices
    new = torch.ones_like(values, dtype=torch.bool)
    new[1:] = values[1:] != values[:-1]
    positions = torch.arange(seq_len, device=doc.device)
    first = torch.cummax(torch.where(new, positions, torch.zeros_like(positions)), dim=0).values
    canonical = torch.empty_like(first).scatter_(0, index, first)
    return torch.where(doc == -1, torch.full_like(canonical, seq_len), canonical)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`create_block_mask`'s row lists of a [blocks, blocks] bool block mask: counts and column indices, listed
    blocks first, each in column order (a stable descending sort), as [1, 1, blocks, ...] int32."""
    as_int = dense.to(torch.int32)
    count = as_int.sum(dim=-1).to(torch.int32)
    indices = torch.argsort(as_int, dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None].contiguous(), indices[None, None].contiguous()


def fits(doc_ids: torch.Tensor, seq_len: int, block: int) -> bool:
    """Whether `document_block_mask` builds this mask: one row of `seq_len` document ids, a whole number of blocks."""
    return doc_ids.dim() == 1 and doc_ids.shape[0] == seq_len and seq_len % block == 0 and seq_len >= block


def document_block_mask(doc_ids: torch.Tensor, seq_len: int, mask_mod, block: int):
    """The BlockMask `create_block_mask(mask_mod, None, None, seq_len, seq_len, BLOCK_SIZE=block)` gives for
    speculators' `create_combined_mask_mod(doc_ids, seq_len)` (no sliding window), where `fits`."""
    from torch.nn.attention.flex_attention import BlockMask

    n = seq_len // block
    blocks = _canonical(doc_ids, seq_len).view(n, block)
    presence = torch.zeros(n, seq_len + 1, device=doc_ids.device, dtype=torch.float32)
    presence.scatter_(1, blocks, 1.0)
    presence = presence[:, :seq_len]  # padding shares nothing
    with torch.autocast(doc_ids.device.type, enabled=False):
        share = (presence @ presence.T) > 0
    head = blocks[:, 0]
    alone = (blocks == head[:, None]).all(dim=1) & (head != seq_len)
    below = torch.ones(n, n, dtype=torch.bool, device=doc_ids.device).tril(-1)
    full = below & alone[:, None] & alone[None, :] & (head[:, None] == head[None, :])
    partial = (below & share & ~full) | torch.eye(n, dtype=torch.bool, device=doc_ids.device)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block), mask_mod=mask_mod, seq_lengths=(seq_len, seq_len)
    )
