"""The Gluon kernels' scalar index arithmetic run on the host: a @gluon.jit function's own code executed on Python
ints, with the `gl` helpers it calls (maximum, minimum, cdiv) as Python functions that round as the kernel does. The
tests of which key tiles a kernel walks, and with or without the mask, read the kernel's functions themselves, not a
copy of their rules."""

from __future__ import annotations

import types

from triton.runtime.jit import JITFunction

from flash_attn_ck.backends.triton.gluon import gluon_common


def _cdiv(x: int, div: int) -> int:
    """gl.cdiv on int32 values: (x + div - 1) // div with the kernel's division, which truncates toward zero."""
    n = x + div - 1
    return abs(n) // div if n >= 0 else -(abs(n) // div)


HOST_GL = types.SimpleNamespace(maximum=max, minimum=min, cdiv=_cdiv)


def on_host(jit_fn):
    """`jit_fn`'s Python function with `gl` bound to HOST_GL: callable on ints. Its integer divisions are Python's
    (flooring), so the functions run this way keep their numerators non-negative, where both roundings agree."""
    fn = jit_fn.fn
    return types.FunctionType(fn.__code__, {**fn.__globals__, "gl": HOST_GL}, fn.__name__, fn.__defaults__,
                              fn.__closure__)


class HostMask:
    """gluon_common.Mask for a window (left, right: -1 for no bound) and an alignment, its jit methods run on the
    host; fields as operators.mask_args makes them (bounds >= 0, a flag per bound)."""

    def __init__(self, left: int, right: int, top_left: bool):
        self.left, self.right = max(left, 0), max(right, 0)
        self.TOP_LEFT, self.HAS_LEFT, self.HAS_RIGHT = top_left, left >= 0, right >= 0


for _name, _method in vars(gluon_common.Mask).items():
    if isinstance(_method, JITFunction):
        setattr(HostMask, _name, on_host(_method))
