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

FX tracing keeps its state process-wide: `Tracer.trace` (which make_fx, AOTAutograd and Inductor's passes use) sets
a module-global flag and patches `torch.nn.Module.__call__` and `__getattr__` (and some module globals) on the
class for as long as it traces. A second thread calling a torch.compile'd function meanwhile sees the flag and
raises "Detected that you are using FX to symbolically trace a dynamo-optimized function" (measured: one run in six
crashed after step 1), and two threads tracing at once restore each other's saved flag and patches in the wrong
order. A lock around the training thread's model call cannot fix it: the background trace runs inside Dynamo's
compile lock, and a training thread that holds the model lock and reaches a frame to (re)compile waits on Dynamo's
lock while the background thread waits on the model lock: a deadlock. So `_fx_tracing_per_thread` makes that state
the tracing thread's alone: traces take one process lock (serialised, as Dynamo's own compiles already are), the
flag's readers (`is_fx_tracing`, `is_fx_symbolic_tracing`, the very function objects Dynamo captured) answer for
the calling thread, and every patch a trace makes runs its replacement only in the thread that made it, the
original in every other. Nothing changes for a thread that traces: it sees what it saw before.
"""

from __future__ import annotations

import functools
import threading
import time

_STATE: dict = {}  # "compiled": the compiled builder once ready; "thread": the thread making it
BACKEND = "inductor"  # the background compile's torch.compile backend (a CPU test uses aot_eager: FX tracing, no C++)
_TRACE_LOCK = threading.RLock()  # one FX trace at a time in the process (reentrant: traces nest)
_LOCAL = threading.local()  # .depth: how many FX traces the calling thread is inside


def _tracing_here() -> bool:
    return getattr(_LOCAL, "depth", 0) > 0


def _fx_tracing_per_thread() -> None:
    """FX tracing's process-wide state made the tracing thread's own (see the module's docstring). Once."""
    import builtins

    import torch.fx._symbolic_trace as st

    if getattr(st.Tracer.trace, "_eyrie_per_thread", False):
        return
    trace = st.Tracer.trace

    @functools.wraps(trace)
    def per_thread_trace(self, *args, **kwargs):
        with _TRACE_LOCK:
            _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
            try:
                return trace(self, *args, **kwargs)
            finally:
                _LOCAL.depth -= 1

    per_thread_trace._eyrie_per_thread = True  # type: ignore[attr-defined]
    st.Tracer.trace = per_thread_trace  # subclasses (make_fx's PythonKeyTracer) call it through super()

    # The flag's readers keep their function objects (Dynamo's compile wrapper captured is_fx_symbolic_tracing when
    # each function was compiled) and get code that asks about the calling thread; their globals are
    # torch.fx._symbolic_trace's, so the helper goes there.
    st._eyrie_tracing_here = _tracing_here  # type: ignore[attr-defined]

    def is_fx_tracing() -> bool:
        return _eyrie_tracing_here()  # type: ignore[name-defined]  # noqa: F821

    def is_fx_symbolic_tracing() -> bool:
        return _eyrie_tracing_here() and not torch.compiler.is_compiling()  # type: ignore[name-defined]  # noqa: F821

    st.is_fx_tracing.__code__ = is_fx_tracing.__code__
    st.is_fx_symbolic_tracing.__code__ = is_fx_symbolic_tracing.__code__

    def gated(new_fn, orig_fn):
        owner = threading.get_ident()

        @functools.wraps(new_fn)
        def fn(*args, **kwargs):
            if threading.get_ident() == owner:
                return new_fn(*args, **kwargs)
            return orig_fn(*args, **kwargs)

        return fn

    patch, patch_method = st._Patcher.patch, st._Patcher.patch_method

    def patch_here(self, frame_dict, name, new_fn, deduplicate=True):
        if name in frame_dict:
            orig = frame_dict[name]
        elif hasattr(builtins, name):
            orig = getattr(builtins, name)
        else:
            return patch(self, frame_dict, name, new_fn, deduplicate)
        if getattr(orig, "__fx_already_patched", False):
            return None  # what the stock patch does: already patched
        return patch(self, frame_dict, name, gated(new_fn, orig), deduplicate)

    def patch_method_here(self, cls, name, new_fn, deduplicate=True):
        orig = getattr(cls, name)
        if getattr(orig, "__fx_already_patched", False):
            return None
        return patch_method(self, cls, name, gated(new_fn, orig), deduplicate)

    st._Patcher.patch = patch_here
    st._Patcher.patch_method = patch_method_here


def _compile_in_background(build, args: tuple) -> None:
    """Compile `build` for `args` in a thread, under the calling thread's grad mode, autocast state and intra-op
    thread count (each is per thread, and Dynamo guards on them: compiled under others, the training thread's
    calls would compile it again; measured: a new thread's thread count did)."""
    import torch

    # torch.compile's default (Inductor) named only when another is set: a test's stand-in takes the function alone
    compiled = torch.compile(build) if BACKEND == "inductor" else torch.compile(build, backend=BACKEND)
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
    _fx_tracing_per_thread()  # now, before training: no trace is in flight while the tracer is swapped
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


def _warm_compile_workers() -> None:
    """Start Inductor's pool of compile worker processes now, while the trainer imports speculators (15-22 s on an
    H200 node), instead of at the first compiled frame: torch starts it there (`maybe_warm_pool`), and until its
    workers are up the first frames' Triton kernels compile one by one in the training process. The workers are
    processes of their own, so their start overlaps the imports; they read TORCHINDUCTOR_CACHE_DIR, so this comes
    after `_compile_cache_beside`. torch's own check decides whether a pool is used at all (TORCH_WARM_POOL=0, one
    compile thread, no Triton)."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()
