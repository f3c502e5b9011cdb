"""Varlen rows that belong to no sequence: packed rows at or after `cu_seqlens[-1]`.

No kernel reads or writes them, so the pipelines define them once for every backend
(docs/semantics.md §API): out, dq, dk, dv and softmax_d are 0 there, lse is +inf.
"""

from __future__ import annotations

import torch


def fill_outside_sequences(t: torch.Tensor, cu_seqlens: torch.Tensor, dim: int, value: float) -> None:
    """Fill the entries of `t` whose index along `dim` is `>= cu_seqlens[-1]` with `value`. On the CPU the
    offset is read; on a device it stays there (no sync, capturable: a mask and one masked fill)."""
    total = t.shape[dim]
    if total == 0:
        return
    if cu_seqlens.device.type == "cpu":
        end = int(cu_seqlens[-1])
        if end < total:
            t.narrow(dim, end, total - end).fill_(value)
        return
    fill_by_mask(t, cu_seqlens, dim, value)


def fill_by_mask(t: torch.Tensor, cu_seqlens: torch.Tensor, dim: int, value: float) -> None:
    """The device form of `fill_outside_sequences`: compares indices with `cu_seqlens[-1]` where it lies."""
    total = t.shape[dim]
    outside = torch.arange(total, device=t.device, dtype=cu_seqlens.dtype) >= cu_seqlens[-1]
    shape = [1] * t.dim()
    shape[dim] = total
    t.masked_fill_(outside.view(shape), value)
