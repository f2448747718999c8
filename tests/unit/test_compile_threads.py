"""DEFERRED_MASK_COMPILE's background compile (eyrie/stages/train/patches/compile.py): FX tracing made the tracing
thread's own, so a training thread calling compiled code and modules while another thread traces runs as it would
alone, and the block mask compiled in that thread is the eager one."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from eyrie.stages.train.patches import compile as deferred


def _calls_while(work, fn, expected) -> tuple[int, list[str]]:
    """Call `fn()` in a loop on a second thread while `work()` runs here; (calls, errors)."""
    errors: list[str] = []
    calls = [0]
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                assert torch.equal(fn(), expected)
                calls[0] += 1
            except Exception as err:  # noqa: BLE001  (the race's symptom: recorded, then asserted on)
                errors.append(repr(err))
                return

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        work()
    finally:
        stop.set()
        thread.join()
    return calls[0], errors


def test_a_thread_calling_compiled_modules_is_untouched_by_another_threads_fx_trace():
    # Stock torch: the tracing thread patches nn.Module.__call__ for the process and sets FX's global flag, so the
    # loop below dies within a few traces (NameError: module is not installed as a submodule, or Dynamo's "Detected
    # that you are using FX to symbolically trace a dynamo-optimized function").
    deferred._fx_tracing_per_thread()
    lin = torch.nn.Linear(8, 8)
    compiled = torch.compile(lambda x: lin(x).relu(), backend="eager")
    x = torch.randn(4, 8)
    expected = lin(x).relu()
    compiled(x)
    traced: list = []

    def trace() -> None:
        for _ in range(200):
            module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
            traced.append(torch.fx.symbolic_trace(module))

    calls, errors = _calls_while(trace, lambda: compiled(x), expected)
    assert errors == []
    assert calls > 0
    # the tracing thread's own trace is what it was: the Linear a call_module leaf, the ReLU too
    assert [n.op for n in traced[-1].graph.nodes] == ["placeholder", "call_module", "call_module", "output"]
    assert not torch.fx._symbolic_trace.is_fx_tracing()


@pytest.mark.parametrize("docs", [[100, 60, 96], [256]])
def test_the_mask_compiled_in_the_background_is_the_eager_mask(monkeypatch, docs):
    from speculators.models.eagle3 import core
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    monkeypatch.setattr(deferred, "BACKEND", "aot_eager")  # FX tracing (make_fx) as Inductor's, no C++ compile
    monkeypatch.setattr(deferred, "_STATE", {})
    deferred._fx_tracing_per_thread()
    build = core.Eagle3DraftModel._build_attn_mask
    owner = SimpleNamespace(_create_mask_fn=create_block_mask, _attn_impl="simple_flex_attention")
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])
    seq_len = doc_ids.numel()
    lin = torch.nn.Linear(8, 8)
    step = torch.compile(lambda x: lin(x).sum(-1), backend="eager")
    x = torch.randn(4, 8)
    expected = lin(x).sum(-1)
    step(x)

    def compile_in_background() -> None:
        deferred._compile_in_background(build, (owner, doc_ids.clone(), seq_len, "cpu", None))
        deferred._STATE["thread"].join(timeout=600)

    calls, errors = _calls_while(compile_in_background, lambda: step(x), expected)
    assert errors == []
    compiled = deferred._STATE.get("compiled")
    assert compiled is not None, "the background compile failed (its message is in the captured output)"
    eager = build(owner, doc_ids, seq_len, "cpu", None)
    mask = compiled(owner, doc_ids, seq_len, "cpu", None)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(mask, name), getattr(eager, name)), name
    assert torch.equal(mask.to_dense(), eager.to_dense())
    q = torch.arange(seq_len)
    causal_in_doc = (doc_ids[:, None] == doc_ids[None, :]) & (q[:, None] >= q[None, :])
    dense = create_mask(mask.mask_mod, None, None, seq_len, seq_len, device="cpu")
    assert torch.equal(dense[0, 0], causal_in_doc)
