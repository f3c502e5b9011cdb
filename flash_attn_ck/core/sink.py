"""Learnable attention sinks, folded around any backend's kernels through the lse (docs/semantics.md §Learnable
sinks).

A sink is one more logit per query head, with no value: each row's softmax runs over its keys and `sink[h]`.
Forward: the kernels' `(out, lse)` over the keys become `L = logaddexp(lse, sink[h])` and `out * exp(lse - L)`.
Backward: given that out and L, the kernels' dQ, dK, dV are already the sink's (P = exp(S - L), D = rowsum(dO * O));
only `dsink[h] = -sum_rows exp(sink[h] - L) D` is added. Row statistics are `(b, h, s_q)` or varlen `(h, total_q)`:
the head is dim -2 in both.
"""

from __future__ import annotations

import math

import torch


def _per_head(sink: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The sink as an `(h, 1)` column in lse's dtype, broadcasting over the rows of `(b, h, s)` or `(h, t)`."""
    return sink.detach().to(lse.dtype).unsqueeze(-1)


def _row_scale(scale: torch.Tensor) -> torch.Tensor:
    """Row statistics `(b, h, s)` / `(h, t)` as a factor of out `(b, s, h, d)` / `(t, h, d)`."""
    return scale.transpose(-1, -2).unsqueeze(-1)


def fold_sink(sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Turn the kernels' out and lse over the keys into the sink's, in place. A row without keys (lse +inf, the
    kernels' convention) gets L = sink and keeps out 0; a row whose L is -inf (no key, sink -inf) keeps +inf; a NaN
    sink gives its head NaN, as the softmax it stands for would."""
    inf = float("inf")
    over_keys = lse.masked_fill(lse == inf, -inf)
    total = torch.logaddexp(over_keys, _per_head(sink, lse))
    scale = torch.exp(over_keys - total).masked_fill(total == -inf, 0.0)    # -inf - -inf: a row with nothing at all
    out.mul_(_row_scale(scale))     # one pass over out: the product in fp32 (scale's dtype), rounded once
    lse.copy_(total.masked_fill(total == -inf, inf))


def rows_dot(dout: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """D = rowsum(dO * O) in `dtype`, laid out as lse: out `(b, s, h, d)` -> `(b, h, s)`, `(t, h, d)` -> `(h, t)`."""
    return (dout.to(dtype) * out.to(dtype)).sum(-1).transpose(-1, -2)


def sink_gradient(sink: torch.Tensor, lse: torch.Tensor, softmax_d: torch.Tensor) -> torch.Tensor:
    """`dsink[h] = -sum over batch and rows of exp(sink[h] - L) * D`, accumulated in lse's dtype, in the sink's."""
    logit = _per_head(sink, lse)
    # L = +inf: rows in no sequence (p 0), or a sink of +inf, which takes the whole row (p 1, where exp gives NaN)
    p_sink = torch.where((logit == math.inf) & (lse == math.inf), 1.0, torch.exp(logit - lse))
    weighted = p_sink * softmax_d.to(lse.dtype)
    per_head = weighted.sum(-1)
    if per_head.dim() == 2:         # dense: (b, h)
        per_head = per_head.sum(0)
    return (-per_head).to(sink.dtype)
