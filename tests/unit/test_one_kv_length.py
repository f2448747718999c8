"""The TTT steps' attention at one padded key length (eyrie/stages/train/patches/one_kv_length.py, bound on the drafter
by eyrie/stages/train/drafter.py) is speculators' attention: the same draft tokens, loss, metrics and gradients on a
flex-attention drafter, on CPU (eager flex attention), with documents, padding and every TTT step's diagonal draft
blocks."""

from __future__ import annotations

import pytest
from tiny_drafter import tiny_eagle3


def _one_kv_length_alone(model) -> None:
    """one_kv_length bound on `model` (eyrie/stages/train/drafter.py), no other choice; speculators' class and module
    keep their own forward, mask builder, cache and mask extension."""
    from speculators.models.eagle3 import core

    from eyrie.stages.train.drafter import apply_speed_choices
    from eyrie.stages.train.patches.switches import Switches

    before = {n: getattr(core, n) for n in ("DynamicCache", "extend_mask_for_draft_tokens")}
    methods = {n: getattr(core.Eagle3DraftModel, n) for n in ("forward", "_build_attn_mask")}
    only = Switches(sync_free_metrics=False, deferred_mask_compile=False, eager_rotary=False, one_kv_length=True)
    apply_speed_choices(model, only)
    assert {n: getattr(core, n) for n in before} == before
    assert {n: getattr(core.Eagle3DraftModel, n) for n in methods} == methods
    assert {"forward", "_build_attn_mask"} <= set(vars(model))


def _flex_drafter_and_batch(n: int):
    import torch
    from speculators.losses import resolve_loss_config

    model = tiny_eagle3()
    model.config.transformer_layer_config._attn_implementation = "simple_flex_attention"
    for module in model.modules():  # the attention layers read the implementation from their own config
        if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
            module.config._attn_implementation = "simple_flex_attention"
    model._attn_impl, model._create_mask_fn = (
        "simple_flex_attention",
        __import__("speculators.models.eagle3.core", fromlist=["create_block_mask"]).create_block_mask,
    )
    g = torch.Generator().manual_seed(3)
    a, b = 150, n - 150 - 20  # two documents crossing a block boundary, then padding
    batch = dict(
        hidden_states=torch.randn(1, n, 96, generator=g),
        input_ids=torch.randint(0, 256, (1, n), generator=g),
        document_ids=torch.cat([torch.zeros(a), torch.ones(b), -torch.ones(20)]).long()[None],
        loss_mask=torch.randint(0, 2, (1, n), generator=g),
        position_ids=torch.cat([torch.arange(a), torch.arange(b), torch.zeros(20, dtype=torch.long)])[None],
        verifier_last_hidden_states=torch.randn(1, n, 32, generator=g),
        ttt_steps=3,
        loss_config=resolve_loss_config("kl_div", "eager"),
    )
    return model, batch


def _run(model, batch):
    model.zero_grad()
    tokens, loss, metrics = model(**batch)
    if loss.requires_grad:
        loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return tokens, loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads


def _dense_reference(block_mask, kv_len: int):
    """The elementwise mask flex attention applies for `block_mask`: a full block's every element, a listed
    partial block's elements where its mask_mod holds, nothing else (flex attention has no backward on CPU, so the
    gradients are taken through SDPA under this mask)."""
    import torch
    from torch.nn.attention.flex_attention import create_mask

    q_len = block_mask.seq_lengths[0]
    bq, bk = block_mask.BLOCK_SIZE

    def blocks(num, indices):
        dense = torch.zeros(indices.shape[-2], indices.shape[-1] + 1, dtype=torch.bool)
        for i in range(indices.shape[-2]):
            dense[i, indices[0, 0, i, : num[0, 0, i]]] = True
        return dense[:, :-1].repeat_interleave(bq, 0).repeat_interleave(bk, 1)[:q_len, :kv_len]

    partial = blocks(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = (
        blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        if block_mask.full_kv_indices is not None
        else torch.zeros_like(partial)
    )
    mod = create_mask(block_mask.mask_mod, None, None, q_len, kv_len, device="cpu")[0, 0]
    return full | (partial & mod)


def _attention(mode: str, seen: list):
    """speculators' flex attention (forward only: 'flex') or its mask through SDPA ('dense'), noting each call's
    key length and mask lengths."""
    import torch
    from speculators.models import attention

    stock = attention.ALL_ATTENTION_FUNCTIONS["simple_flex_attention"]

    def run(module, query, key, value, attention_mask, scaling=None, **kwargs):
        seen.append((key.shape[-2], tuple(attention_mask.seq_lengths)))
        if mode == "flex":
            return stock(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        mask = _dense_reference(attention_mask, key.shape[-2])
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return run


@pytest.mark.parametrize("mode", ["flex", "dense"])
def test_padded_keys_give_speculators_loss_and_gradients(monkeypatch, mode):
    """Stock against patched, the same batch: equal draft tokens, loss and metrics; with 'dense' (the block
    masks' own semantics through SDPA) equal gradients too. The stock keys grow S, 2S, 3S; the patched ones are 3S
    on every step with a mask of that length."""
    import contextlib

    import torch
    from speculators.models import attention

    from eyrie.stages.train.patches import one_kv_length

    model, batch = _flex_drafter_and_batch(384)  # 3 blocks of 128
    seen: list = []
    monkeypatch.setitem(
        attention.ALL_ATTENTION_FUNCTIONS._global_mapping, "simple_flex_attention", _attention(mode, seen)
    )
    grad = torch.no_grad() if mode == "flex" else contextlib.nullcontext()

    def run():
        with grad:
            model.zero_grad()
            tokens, loss, metrics = model(**batch)
            if mode == "dense":
                loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return tokens, loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads

    want = run()
    assert [k for k, _ in seen] == [384, 768, 1152]  # speculators: the keys grow each step
    seen.clear()
    _one_kv_length_alone(model)
    got = run()
    assert seen == [(1152, (384, 1152))] * 3  # every step: one key length, one mask length
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    # the draft tokens are argmaxes of a random toy drafter's logits: a near tie may flip at the last bit (a longer
    # masked row sums in another order); the loss and metrics above are the comparison
    assert all((a != b).float().mean() <= 0.02 for a, b in zip(want[0], got[0]))
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert want[2].keys() == got[2].keys()
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], rtol=1e-5, atol=1e-6)
    assert want[3].keys() == got[3].keys() and (want[3] or mode == "flex")
    for k in want[3]:
        torch.testing.assert_close(got[3][k], want[3][k], rtol=1e-4, atol=1e-6, msg=k)
    assert one_kv_length._STATE["total"] is None and one_kv_length._STATE["filled"] == {}  # nothing held after


def test_a_length_off_the_block_grid_keeps_speculators_cache_and_mask():
    """A sequence that is not a whole number of mask blocks is left to speculators (the forward as it was)."""
    import torch

    model, batch = _flex_drafter_and_batch(300)
    try:
        with torch.no_grad():
            want = _run(model, batch)
    except Exception as err:  # noqa: BLE001  (speculators' own forward may refuse the length; so must ours)
        want = err
    _one_kv_length_alone(model)
    if isinstance(want, Exception):
        with pytest.raises(type(want)), torch.no_grad():
            _run(model, batch)
        return
    with torch.no_grad():
        got = _run(model, batch)
    torch.testing.assert_close(got[1], want[1])
