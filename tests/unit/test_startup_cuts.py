"""The start-up cuts of eyrie/stages/train/patches/startup.py: a drafter given `rotary_eager` gives
the same tables, draft tokens, loss and gradients as before, its rotary embedding is run eagerly inside a compiled
forward (no frame of its own), and one_pointwise_config only turns off Inductor's pointwise autotuning, while the
trainer runs."""

from __future__ import annotations

import pytest
import torch
from tiny_drafter import tiny_eagle3


@pytest.fixture
def stock_init(monkeypatch):
    """speculators' own EAGLE-3 __init__ for the test (unwrapped, should a test before it in this process have left
    `_rotary_tables_eager`'s wrapper on), put back after it."""
    from speculators.models.eagle3 import core

    init = core.Eagle3DraftModel.__init__
    while getattr(init, "_eyrie_rotary_eager", False):
        init = init.__wrapped__
    monkeypatch.setattr(core.Eagle3DraftModel, "__init__", init)
    return core


def _batch(n: int = 40, ttt_steps: int = 3):
    from speculators.losses import resolve_loss_config

    g = torch.Generator().manual_seed(5)
    return dict(
        hidden_states=torch.randn(1, n, 96, generator=g),
        input_ids=torch.randint(0, 256, (1, n), generator=g),
        document_ids=torch.zeros(1, n, dtype=torch.long),
        loss_mask=torch.ones(1, n, dtype=torch.long),
        position_ids=torch.arange(n)[None],
        verifier_last_hidden_states=torch.randn(1, n, 32, generator=g),
        ttt_steps=ttt_steps,
        loss_config=resolve_loss_config("kl_div", "eager"),
    )


def _step(model, batch):
    model.zero_grad()
    tokens, loss, _ = model(**batch)
    loss.backward()
    return tokens, loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_eager_rotary_changes_nothing_but_compilation(stock_init):
    from eyrie.stages.train.patches.startup import rotary_eager

    stock = tiny_eagle3()
    batch = _batch()
    ref = _step(stock, batch)
    patched = tiny_eagle3()
    rotary_eager(patched)  # this drafter's alone
    assert patched.rotary_emb.forward is not stock.rotary_emb.forward
    x, pos = torch.randn(1, 40, 64), torch.arange(40)[None]
    for a, b in zip(stock.rotary_emb(x, pos), patched.rotary_emb(x, pos), strict=True):
        assert torch.equal(a, b)
    got = _step(patched, batch)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0], strict=True))
    assert torch.equal(ref[1], got[1])
    assert ref[2].keys() == got[2].keys() and all(torch.equal(ref[2][k], got[2][k]) for k in ref[2])
    assert patched.state_dict().keys() == stock.state_dict().keys()


@pytest.mark.parametrize("eager", [False, True])
def test_eager_rotary_runs_outside_the_compiled_forward(stock_init, monkeypatch, eager):
    """Compiled (a CPU stand-in for speculators' torch.compile on GPUs), the stock forward traces the rotary
    embedding; with the patch it runs eagerly, never while Dynamo compiles."""
    from speculators.models.eagle3.model_definitions import model_classes

    from eyrie.stages.train.patches.startup import rotary_eager

    rotary = model_classes["llama"].rotary_emb_class
    forward, seen = rotary.forward, []

    def watched(self, *args, **kwargs):
        seen.append(torch.compiler.is_compiling())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(rotary, "forward", watched)
    model = tiny_eagle3()
    if eager:
        rotary_eager(model)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(type(model).forward, backend="eager")
        assert compiled(model, **_batch(ttt_steps=1))[1].isfinite()  # one TTT step: less to trace
    finally:
        torch._dynamo.reset()
    if eager:
        assert seen == [False]  # run eagerly
    else:
        assert any(seen)


def test_one_pointwise_config_sets_only_that_while_the_trainer_runs():
    """one_pointwise_config: Inductor's own `config.patch` turns pointwise autotuning off for as long as the
    trainer runs (eyrie.stages.train.drafter.inductor_settings), nothing else, and puts it back after; without the
    choice (or on CPU: no switches) nothing changes. Read through `get_config_copy` (the attribute read is not
    reliable in a long test process)."""
    import torch._inductor.config as inductor_config

    from eyrie.stages.train.drafter import inductor_settings
    from eyrie.stages.train.patches.switches import Switches

    key = "triton.autotune_pointwise"
    before = inductor_config.get_config_copy()
    with inductor_settings(Switches()):
        inside = inductor_config.get_config_copy()
    assert inside[key] is False
    assert {k: v for k, v in inside.items() if k != key} == {k: v for k, v in before.items() if k != key}
    assert inductor_config.get_config_copy() == before
    for switches in (Switches(one_pointwise_config=False), None):
        with inductor_settings(switches):
            assert inductor_config.get_config_copy() == before


def test_the_start_up_choices_are_on_for_a_short_run_and_a_misspelt_name_is_refused():
    """The start-up choices are on for a run of unknown or short length; the options file refuses a name that is no
    choice instead of leaving it as it is."""
    import pytest

    from eyrie.config import TrainConfig
    from eyrie.stages.train.patches.switches import Switches, decide

    short = decide(TrainConfig().speed, None)
    assert short.deferred_mask_compile and short.one_kv_length and short.eager_rotary and short.one_pointwise_config
    assert not short.warm_compile_workers
    off = short.without("one_kv_length", "eager_rotary")
    assert not off.one_kv_length and not off.eager_rotary and off.deferred_mask_compile
    with pytest.raises(ValueError, match="one_kv_lenght is no switch"):
        Switches.from_dict({"one_kv_lenght": False})
