"""`base` with some attributes replaced."""

from __future__ import annotations


class _Overlay:
    """`base` with some attributes replaced: how the trainer sees `torch.nn` and `torch.nn.utils` below."""

    def __init__(self, base, **replaced):
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._base, name)
