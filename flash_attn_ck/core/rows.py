"""Varlen rows that belong to no sequence: packed rows at or after `cu_seqlens[-1]`.

No kernel reads or writes them, so the pipelines define them once for every backend
(docs/semantics.md §API): out, dq, dk, dv and softmax_d are 0 there, lse is +inf.
"""

from __future__ import annotations

import torch


def fill_outside_sequences(t: torch.Tensor, cu_seqlens: torch.Tensor, dim: int, value: float) -> None:
    """Fill the entries of `t` whose index along `dim` is `>= cu_seqlens[-1]` with `value`. On the CPU the
    offset is read; on a device it stays there (no sync, capturable: a mask and one masked fill)."""
    fill_all_outside_sequences(cu_seqlens, (t, dim, value))


def fill_all_outside_sequences(cu_seqlens: torch.Tensor, *fills: tuple[torch.Tensor, int, float]) -> None:
    """`fill_outside_sequences(t, cu_seqlens, dim, value)` for each `(t, dim, value)`; on a device the tensors
    with as many rows share one mask (two launches fewer per tensor: the call is host-bound when small)."""
    if cu_seqlens.device.type == "cpu":
        end = int(cu_seqlens[-1])
        for t, dim, value in fills:
            if end < t.shape[dim]:
                t.narrow(dim, end, t.shape[dim] - end).fill_(value)
        return
    fill_by_masks(cu_seqlens, *fills)


def fill_by_mask(t: torch.Tensor, cu_seqlens: torch.Tensor, dim: int, value: float) -> None:
    """The device form of `fill_outside_sequences`: compares indices with `cu_seqlens[-1]` where it lies."""
    fill_by_masks(cu_seqlens, (t, dim, value))


def fill_by_masks(cu_seqlens: torch.Tensor, *fills: tuple[torch.Tensor, int, float]) -> None:
    """The device form of `fill_all_outside_sequences`: one mask per number of rows."""
    masks: dict[int, torch.Tensor] = {}
    for t, dim, value in fills:
        total = t.shape[dim]
        if total == 0:
            continue
        if total not in masks:
            masks[total] = torch.arange(total, device=t.device, dtype=cu_seqlens.dtype) >= cu_seqlens[-1]
        shape = [1] * t.dim()
        shape[dim] = total
        t.masked_fill_(masks[total].view(shape), value)
