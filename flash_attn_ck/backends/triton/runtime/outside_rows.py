"""Varlen rows in no sequence: every fill of a call in one launch.

Packed rows at or after `cu_seqlens[-1]` belong to no sequence (docs/semantics.md §API): out, dq, dk, dv and
softmax_d are 0 there, lse +inf. The generic form (core/rows.py) costs a mask and a masked fill per tensor,
a handful of launches that dominate a small varlen call's host time; here one launch fills them all.

Each target is a tensor viewed as (rows, inner_a, inner_b) with its own strides (a (total, h, d) tensor along
dim 0, an lse-like (h, total) one along dim 1 with inner (h, 1)), the fill value, and which offsets end it
(`cu_seqlens_q` or `_k`: its last entry, read on the device). Grid: (row blocks of the longest target,
targets, inner blocks of the widest); a program whose rows all lie inside the sequences returns after one load.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_R = 64
BLOCK_I = 512


class Target(NamedTuple):
    """One tensor to fill (runtime tuple `T` of the kernel)."""
    data: torch.Tensor
    rows: int
    stride_row: int
    inner_a: int
    stride_a: int
    inner_b: int
    stride_b: int
    value: float


@triton.jit
def _fill_one(T, end, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_R
    inner = T.inner_a * T.inner_b
    i0 = tl.program_id(2) * BLOCK_I
    if (r0 + BLOCK_R > end) & (r0 < T.rows) & (i0 < inner):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = (rows >= end) & (rows < T.rows)
        idx = i0 + tl.arange(0, BLOCK_I)
        off = (idx // T.inner_b).to(tl.int64) * T.stride_a + (idx % T.inner_b).to(tl.int64) * T.stride_b
        ptrs = T.data + rows.to(tl.int64)[:, None] * T.stride_row + off[None, :]
        value = tl.full([BLOCK_R, BLOCK_I], T.value, tl.float32).to(T.data.dtype.element_ty)
        tl.store(ptrs, value, mask=row_ok[:, None] & (idx < inner)[None, :])


@triton.jit
def fill_outside_kernel(targets, cu_seqlens_q, last_q, cu_seqlens_k, last_k, USES_K: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """`targets`: a tuple of Target; USES_K[i]: target i ends at cu_seqlens_k[last_k], else cu_seqlens_q[last_q]."""
    which = tl.program_id(1)
    for i in tl.static_range(len(targets)):
        if which == i:
            if USES_K[i]:
                end = tl.load(cu_seqlens_k + last_k)
            else:
                end = tl.load(cu_seqlens_q + last_q)
            _fill_one(targets[i], end, BLOCK_R, BLOCK_I)


def target(t: torch.Tensor, dim: int, value: float) -> Target:
    """`t` (2-D or 3-D) filled along `dim` as rows, its other dims the inner ones."""
    shape, strides = list(t.shape), list(t.stride())
    rows, stride_row = shape.pop(dim), strides.pop(dim)
    shape += [1] * (2 - len(shape))
    strides += [0] * (2 - len(strides))
    return Target(t, rows, stride_row, shape[0], strides[0], shape[1], strides[1], value)
