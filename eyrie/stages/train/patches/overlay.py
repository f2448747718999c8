"""`base` with some attributes replaced, and a library function's code run against other globals: how Eyrie
gives speculators' code its own pieces without replacing anything in speculators' modules."""

from __future__ import annotations

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
