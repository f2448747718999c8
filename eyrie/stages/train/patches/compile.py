"""The block mask compiled after the first step instead of before it.

speculators' EAGLE-3 forward breaks its graph inside the TTT loop, so Dynamo runs the forward itself eagerly and
compiles the frames it calls, one after another, each the first time it runs. One of them is
`Eagle3DraftModel._build_attn_mask` (`create_block_mask` over the packed documents, once a step): compiling it took
24 s of a 98.5 s first step from a cold cache on an H200 at Kimi-K2.5 width (its sort kernel alone 11 s), for a
function that takes milliseconds eagerly. Compiled, it is faster per step than eager (a few fused kernels instead of
many small ones).

So the first step builds its mask eagerly, and the compiled builder is made in a thread of its own once that step's
frames are compiled (at the second call: every frame of the first forward and backward is compiled by then), with
that call's arguments; calls after it is ready use it. Torch compiles one frame at a time, so the thread waits for
any compile of the training thread and the reverse; its Triton kernels compile in Inductor's worker processes while
the GPU trains. The mask is the same either way (create_block_mask's own result, compiled or not).
"""

from __future__ import annotations

import threading
import time

_STATE: dict = {}  # "compiled": the compiled builder once ready; "thread": the thread making it


def _compile_in_background(build, args: tuple) -> None:
    """Compile `build` for `args` in a thread, under the calling thread's grad mode, autocast state and intra-op
    thread count (each is per thread, and Dynamo guards on them: compiled under others, the training thread's
    calls would compile it again; measured: a new thread's thread count did)."""
    import torch

    compiled = torch.compile(build)
    device = torch.device(args[3])
    grad = torch.is_grad_enabled()
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type)
    threads = torch.get_num_threads()

    def warm() -> None:
        start = time.monotonic()
        try:
            torch.set_num_threads(threads)
            if device.type == "cuda":
                torch.cuda.set_device(device.index or 0)
            with torch.set_grad_enabled(grad), torch.autocast(device.type, dtype=dtype, enabled=autocast):
                compiled(*args)
            _STATE["compiled"] = compiled
            print(
                f"eyrie: the block mask's builder compiled in the background in {time.monotonic() - start:.1f} s",
                flush=True,
            )
        except Exception as err:  # noqa: BLE001  (the eager builder stays: the same mask, a little slower)
            print(f"eyrie: the block mask's builder was not compiled ({type(err).__name__}: {err}); it runs eagerly")

    _STATE["thread"] = thread = threading.Thread(target=warm, name="eyrie-block-mask-compile", daemon=True)
    thread.start()


def _block_mask_compiled_after_the_first_step() -> None:
    """`Eagle3DraftModel._build_attn_mask` runs eagerly (torch.compiler.disable) until its compiled twin, made in
    the background from the second call on, is ready."""
    import torch
    from speculators.models.eagle3 import core

    build = core.Eagle3DraftModel._build_attn_mask
    if getattr(build, "_eyrie_deferred", False):
        return
    calls = [0]

    def _build_attn_mask(self, doc_ids_1d, seq_len, device, sliding_window=None):
        if self._attn_impl != "simple_flex_attention":  # a dense mask (sdpa, eager): nothing compiled to defer
            return build(self, doc_ids_1d, seq_len, device, sliding_window)
        compiled = _STATE.get("compiled")
        if compiled is not None:
            return compiled(self, doc_ids_1d, seq_len, device, sliding_window)
        calls[0] += 1
        if calls[0] == 2 and "thread" not in _STATE:
            _compile_in_background(build, (self, doc_ids_1d.clone(), seq_len, device, sliding_window))
        return build(self, doc_ids_1d, seq_len, device, sliding_window)

    eager = torch.compiler.disable(_build_attn_mask)
    eager._eyrie_deferred = True  # type: ignore[attr-defined]
    core.Eagle3DraftModel._build_attn_mask = eager
