"""Every TTT step's attention at one key length, so one compile serves all of them.

speculators' EAGLE-3 forward runs its decoder layer once per TTT step against a `DynamicCache` that grows by the
sequence length S each step (keys of length S, 2S, 3S) and a flex-attention `BlockMask` extended by one diagonal
block column per step (`extend_mask_for_draft_tokens`). A BlockMask holds its lengths as Python ints and the keys'
shapes differ, so Dynamo compiles the layer's attention frame, forward and backward, once per step: about 25 s of the
first step from a cold compile cache on an H200 at Kimi-K2.5 width, three times the same kernels.

Here every step sees keys of length ttt_steps * S: the cache is a buffer of that length, zero beyond what the steps
so far wrote (one concatenation of the steps' own keys and a slice of a zero tensor, so backward hands each step
a view of the gradient and nothing earlier steps saved for backward is written), and
the block mask has ttt_steps * S / BLOCK_SIZE block columns from the first step on, with the same blocks listed as
speculators' mask (`kv_num_blocks`, `kv_indices`, and the full blocks): the columns past the filled length are never
listed, so flex attention skips them and no query attends to a padded key. The attention output, loss and gradients
are those of the unpadded forward (tests/unit/test_one_kv_length.py compares them); the padded blocks cost only
empty kernel programs.

Only where the mask is a BlockMask over a length that is a whole number of its blocks (Kimi's 4096 is, at 128);
otherwise the forward is speculators' own. The cache's write runs eagerly (torch.compiler.disable): a graph break
between the projections and the attention, so the attention frame's inputs have one shape on every step.

Nothing of speculators is replaced: these are pieces of the built drafter's own forward and mask builder
(eyrie/stages/train/drafter.py): the forward's code reads `fixed_length_cache(...)` as its `DynamicCache` and
`extend_mask_for_draft_tokens` below as its own, `padded_mask_builder` is the instance's `_build_attn_mask`, and
`around_forward` marks the forward in progress.
"""

from __future__ import annotations

import inspect

import torch

_STATE: dict = {}  # "total": the padded key length of the forward in progress, or None; "filled": mask id -> blocks


def _pad_mask(mask, width: int):
    """`mask` with `width` block columns: zero indices appended, the listed blocks unchanged."""
    from torch.nn.attention.flex_attention import BlockMask

    def pad(indices):
        if indices is None:
            return None
        extra = width - indices.shape[-1]
        return torch.cat([indices, indices.new_zeros((*indices.shape[:-1], extra))], dim=-1)

    return BlockMask.from_kv_blocks(
        mask.kv_num_blocks,
        pad(mask.kv_indices),
        mask.full_kv_num_blocks,
        pad(mask.full_kv_indices),
        BLOCK_SIZE=mask.BLOCK_SIZE,
        mask_mod=mask.mask_mod,
        seq_lengths=(mask.seq_lengths[0], width * mask.BLOCK_SIZE[1]),
    )


_ZEROS: dict = {}  # (shape, dtype, device) -> a zero tensor the pads are slices of (read, never written)


def _padded(chunks: list, total: int):
    """The steps' keys (or values) so far, then zeros, `total` positions long: one concatenation of the steps' own
    tensors, so backward hands each step a view of the gradient (no copy chained from step to step)."""

    last = chunks[-1]
    pad = total - sum(c.shape[-2] for c in chunks)
    if pad == 0:
        return torch.cat(chunks, dim=-2)
    key = (tuple(last.shape[:-2]), last.shape[-1], last.dtype, last.device)
    zeros = _ZEROS.get(key)
    if zeros is None or zeros.shape[-2] < pad:
        _ZEROS.clear()  # one shape at a time: the trainer's
        zeros = _ZEROS[key] = last.new_zeros((*last.shape[:-2], pad, last.shape[-1]))
    return torch.cat([*chunks, zeros[..., :pad, :]], dim=-2)


def fixed_length_cache(stock_cache):
    """`stock_cache` (speculators' `DynamicCache`), but with keys and values of the forward's padded length on
    every step."""

    class FixedLengthCache(stock_cache):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._eyrie_layers: dict = {}

        @torch.compiler.disable
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            total = _STATE.get("total")
            if not total:  # this forward's mask is not padded: speculators' cache
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)
            keys, values = self._eyrie_layers.setdefault(layer_idx, ([], []))
            keys.append(key_states)
            values.append(value_states)
            filled = sum(k.shape[-2] for k in keys)
            if filled > total:
                raise RuntimeError(
                    f"eyrie: the padded cache holds {total} positions but the TTT steps wrote {filled}; "
                    "set train.speed.one_kv_length: false and report it"
                )
            return _padded(keys, total), _padded(values, total)

    return FixedLengthCache


def padded_mask_builder(build):
    """The mask builder `build` (self, doc_ids_1d, seq_len, device, sliding_window) with its block mask padded to
    ttt_steps * seq_len keys when it can be (else `build`'s mask as it is); eager."""
    from torch.nn.attention.flex_attention import BlockMask

    @torch.compiler.disable
    def _build_attn_mask(self, doc_ids_1d, seq_len, device, sliding_window=None):
        mask = build(self, doc_ids_1d, seq_len, device, sliding_window)
        ttt = _STATE.get("ttt_steps")
        size = getattr(mask, "BLOCK_SIZE", None)
        if (
            not isinstance(mask, BlockMask)
            or not isinstance(ttt, int)
            or ttt < 1
            or size is None
            or size[0] != size[1]
            or seq_len % size[1]
            or tuple(mask.seq_lengths) != (seq_len, seq_len)
            or _STATE.get("total", 0) not in (0, ttt * seq_len)  # a second mask of another kind: none padded
        ):
            _STATE["total"] = None
            _STATE["filled"] = {}
            return mask
        _STATE["total"] = ttt * seq_len
        padded = _pad_mask(mask, ttt * (seq_len // size[1]))
        _STATE["filled"][id(padded)] = (padded, seq_len // size[1])
        return padded

    return _build_attn_mask


@torch.compiler.disable
def extend_mask_for_draft_tokens(block_mask):
    """speculators' `extend_mask_for_draft_tokens` for its own masks; a padded mask gets the next step's diagonal
    blocks in its next free column instead of a new column."""
    from speculators.models.eagle3.attention import extend_mask_for_draft_tokens as stock_extend
    from torch.nn.attention.flex_attention import BlockMask

    entry = _STATE.get("filled", {}).get(id(block_mask))
    if entry is None or entry[0] is not block_mask:
        return stock_extend(block_mask)
    filled = entry[1]
    kv_indices = block_mask.kv_indices
    q_blocks, width = kv_indices.shape[-2], kv_indices.shape[-1]
    if filled + q_blocks > width:  # the extension after the last step: its mask is never used
        return block_mask
    new_blocks = torch.arange(filled, filled + q_blocks, dtype=kv_indices.dtype, device=kv_indices.device)
    kv_indices = kv_indices.clone()
    kv_indices.scatter_(-1, block_mask.kv_num_blocks.unsqueeze(-1), new_blocks.reshape(1, 1, q_blocks, 1))
    out = BlockMask.from_kv_blocks(
        block_mask.kv_num_blocks + 1,
        kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
        seq_lengths=block_mask.seq_lengths,
    )
    _STATE["filled"][id(out)] = (out, filled + q_blocks)
    return out


def around_forward(forward, stock_forward):
    """`forward` (the drafter's) with the padded length's state set for the call: its TTT steps read from the call's
    arguments as `stock_forward` (speculators' own forward, for its signature) takes them."""
    import functools

    signature = inspect.signature(getattr(stock_forward, "__wrapped__", stock_forward))
    ttt_default = signature.parameters["ttt_steps"].default
    ttt_position = list(signature.parameters).index("ttt_steps") - 1  # after self

    @functools.wraps(forward)
    def one_kv_length_forward(self, *args, **kwargs):
        ttt = args[ttt_position] if len(args) > ttt_position else kwargs.get("ttt_steps", ttt_default)
        _STATE.update(ttt_steps=ttt, total=0, filled={})
        try:
            return forward(self, *args, **kwargs)
        finally:
            _STATE.update(ttt_steps=None, total=None, filled={})

    return one_kv_length_forward
