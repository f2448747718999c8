"""The drafter's block mask built from the documents' block layout (eyrie/stages/train/block_mask.py) is the
BlockMask `create_block_mask` builds for speculators' `create_combined_mask_mod`: the same listed and full blocks in
the same order, the same mask_mod and lengths, over packed, padded, unordered and single-document layouts."""

from __future__ import annotations

import pytest
import torch
from speculators.models.eagle3.attention import create_combined_mask_mod
from torch.nn.attention.flex_attention import create_block_mask

from eyrie.stages.train.block_mask import document_block_mask, fits


def _layouts(seq: int):
    g = torch.Generator().manual_seed(7)
    yield (
        "two shifted documents then padding",
        torch.cat([torch.zeros(seq // 2 - 1), torch.ones(seq // 2 - 1), -torch.ones(2)]).long(),
    )
    yield "one document", torch.zeros(seq, dtype=torch.long)
    yield "all padding", -torch.ones(seq, dtype=torch.long)
    yield "documents on block edges", torch.arange(seq) // 128
    for case in range(12):  # random packs: lengths from 1 token to several blocks, some ids out of order, padding
        lengths, total = [], 0
        while total < seq:
            n = int(torch.randint(1, 400, (1,), generator=g))
            lengths.append(min(n, seq - total))
            total += lengths[-1]
        ids = torch.randperm(len(lengths), generator=g) * (1000 if case % 2 else 1) if case % 3 else None
        doc = torch.cat([torch.full((n,), int(ids[i]) if ids is not None else i) for i, n in enumerate(lengths)])
        pad = int(torch.randint(0, 300, (1,), generator=g)) if case % 4 else 0
        if pad:
            doc[-pad:] = -1
        yield f"random pack {case}", doc


@pytest.mark.parametrize("seq", [256, 1024])
def test_the_document_block_mask_is_create_block_masks(seq):
    for name, doc in _layouts(seq):
        assert fits(doc, seq, 128)
        mod = create_combined_mask_mod(doc, seq)
        want = create_block_mask(mod, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device="cpu")
        got = document_block_mask(doc, seq, mod, 128)
        for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks"):
            a, b = getattr(want, field), getattr(got, field)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, field)
        assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE and got.mask_mod is mod
        assert torch.equal(got.to_dense(), want.to_dense()), name


def test_lengths_off_the_block_grid_are_not_built_here():
    assert not fits(torch.zeros(300, dtype=torch.long), 300, 128)
    assert not fits(torch.zeros(256, dtype=torch.long), 384, 128)
    assert not fits(torch.zeros(1, 256, dtype=torch.long), 256, 128)
