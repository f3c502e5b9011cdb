"""Partial attention results merged by their lse, in the accumulation dtype."""

from __future__ import annotations

import torch


def merge(out, lse, block_out, block_lse):
    """Merge one block's (out, lse) into the running (out, lse) in the accumulation dtype (fp32; fp64 for
    fp64 inputs); `out` (b, c, h, d_v), lse (b, h, c), or varlen (t, h, d_v), (h, t). The first block (out None)
    starts them."""
    accum = accum_dtype(block_out)
    block_out, block_lse = block_out.to(accum), block_lse.to(accum)
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)

    def weight(x):      # (b, h, c) -> (b, c, h, 1), varlen (h, t) -> (t, h, 1)
        return torch.exp(x - new_lse).transpose(-1, -2).unsqueeze(-1)

    return out * weight(lse) + block_out * weight(block_lse), new_lse


def out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A shard's (or head group's) output: q's rows and heads, v's head dim d_v, q's dtype and device."""
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def accum_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32

