"""`base` with some attributes replaced, and a library function's code run against other globals: how Eyrie
gives speculators' code its own pieces without replacing anything in speculators' modules."""

from __future__ import annotations

import functools
import inspect
import textwrap
import types


class _Overlay:
    """`base` with some attributes replaced: how the trainer sees `torch.nn` and `torch.nn.utils` below."""

    def __init__(self, base, **replaced):
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._base, name)


def with_globals(fn, namespace: dict, edits: dict[str, str] | None = None):
    """`fn` (undecorated) as a function of `namespace`: its own code object, or, when `edits` are given and each is
    found exactly once in its source, its source with those replacements. The library's function is untouched."""
    if edits:
        try:
            lines, first = inspect.getsourcelines(fn)
        except (OSError, TypeError):
            lines, first = [], 0
        source = textwrap.dedent("".join(lines))
        if lines and all(source.count(old) == 1 for old in edits):
            for old, new in edits.items():
                source = source.replace(old, new)
            body = source.splitlines()
            while body and body[0].lstrip().startswith("@"):  # the compile decorator, applied again by the caller
                body.pop(0)
                first += 1
            out: dict = {}
            code = compile("\n" * (first - 1) + "\n".join(body) + "\n", inspect.getsourcefile(fn) or "<src>", "exec")
            exec(code, namespace, out)  # noqa: S102  (speculators' own source, the edits above made)
            made = out[fn.__name__]
            made.__qualname__ = fn.__qualname__
            return made
    made = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    made.__kwdefaults__ = fn.__kwdefaults__
    made.__qualname__ = fn.__qualname__
    return made


def _holds(cell, obj) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def rebound(fn, namespace: dict, module: dict):
    """`fn` as a class holds it, decorated or not (speculators' `val_epoch` is wrapped by `torch.no_grad()`, a
    profiler may wrap either with `functools.wraps`): its undecorated function, which must be `module`'s own, as a
    function of `namespace` (`with_globals`), inside the same decorators (`_rewrapped`). A function that is not
    `module`'s own raises RuntimeError naming it: bound to `namespace`, another module's function would fail on its
    first missing global, after the model's build and compile."""
    inner = inspect.unwrap(fn)
    if getattr(inner, "__globals__", None) is not module:
        where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        raise RuntimeError(f"{where} is not {module.get('__name__')}'s own function: something replaced it")
    return _rewrapped(fn, inner, with_globals(inner, namespace))


def _rewrapped(fn, inner, made):
    """`fn`, decorators around `inner` each holding the next in its closure (as `functools.wraps` records it in
    `__wrapped__`), rebuilt around `made`: each wrapper's own code and globals, the function it holds replaced."""
    if fn is inner:
        return made
    held = fn.__wrapped__
    closure = fn.__closure__ or ()
    if not any(_holds(c, held) for c in closure):
        raise RuntimeError(
            f"{fn.__module__}.{fn.__qualname__}: its decorator does not hold the function it wraps, so it cannot wrap "
            "another"
        )
    new = _rewrapped(held, inner, made)
    cells = tuple(types.CellType(new) if _holds(c, held) else c for c in closure)
    wrapper = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    wrapper.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(wrapper, new)
