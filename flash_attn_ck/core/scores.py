"""The attention scores as the kernels define them, in PyTorch: one key tile at a time.

`ScoreTile` applies everything CK applies before the softmax (scale, softcap, ALiBi, mask) and draws
the dropout keep mask at the call's global coordinates. The reference backend computes with it, and
`attention_probs` materialises the probabilities for `return_attn_probs`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .dropout import keep_mask
from .problem import AttentionParams, AttentionProblem


def without_autocast(compute):
    """`compute(..., problem, ...)` (a function of an AttentionProblem, or a backend's method of one) run without the
    problem's device's autocast. These tiles compute in the dtype the problem chose (fp32/fp64, as the kernels
    accumulate); an autocast around the call would run their matmuls in fp16/bf16 and return an fp32 result of bf16
    accuracy. torch.compile already runs the ops outside autocast: eager now matches it."""
    @functools.wraps(compute)
    def run(*args, **kwargs):
        problem = args[0] if isinstance(args[0], AttentionProblem) else args[1]
        kind = problem.device.type
        if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
            with torch.autocast(kind, enabled=False):
                return compute(*args, **kwargs)
        return compute(*args, **kwargs)
    return run


@dataclass(frozen=True)
class Sequence:
    """One sequence of the batch: its index, lengths, and row offsets into packed tensors."""
    index: int
    seqlen_q: int
    seqlen_k: int
    start_q: int
    start_k: int
    varlen: bool

    def rows_q(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Rows of a q-shaped tensor: (b, s_q, ...) or varlen (total_q, ...) starting at `dim`."""
        return t.narrow(dim, self.start_q, self.seqlen_q) if self.varlen else t.select(dim, self.index)

    def rows_k(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, self.start_k, self.seqlen_k) if self.varlen else t[self.index]

    def lse(self, t: torch.Tensor) -> torch.Tensor:
        """(h, s_q) view of an lse-shaped tensor: (b, h, s_q) or varlen (h, total_q)."""
        return t.narrow(1, self.start_q, self.seqlen_q) if self.varlen else t[self.index]


def sequences(problem: AttentionProblem, params: AttentionParams) -> Iterator[Sequence]:
    if not problem.varlen:
        for i in range(problem.batch):
            yield Sequence(i, problem.seqlen_q, problem.seqlen_k, 0, 0, False)
        return
    cu_q, cu_k = (offsets.tolist() for offsets in params.offsets())
    for i in range(problem.batch):
        yield Sequence(i, cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i], cu_q[i], cu_k[i], True)


class ScoreTile:
    """Scores of all query heads of one sequence against one key tile, with everything applied
    that CK applies before the softmax: scale, softcap, ALiBi, mask; plus the dropout keep mask."""

    def __init__(self, problem: AttentionProblem, params: AttentionParams, seq: Sequence,
                 q: torch.Tensor, k: torch.Tensor, key_start: int, key_end: int):
        p = problem
        rows = torch.arange(seq.seqlen_q, device=q.device)
        cols = torch.arange(key_start, key_end, device=q.device)
        raw = torch.matmul(q, k[:, key_start:key_end].transpose(1, 2)) * p.softmax_scale
        if p.softcap:
            self.tanh = torch.tanh(raw / p.softcap)
            raw = p.softcap * self.tanh
        if params.alibi_slopes is not None:
            slopes = params.alibi_slopes
            slopes = (slopes[seq.index] if slopes.dim() == 2 else slopes).to(raw.dtype)
            distance = (rows[:, None] + seq.seqlen_k - seq.seqlen_q - cols[None, :]).abs()
            raw = raw - slopes[:, None, None] * distance
        mask = p.mask.for_lengths(seq.seqlen_q, seq.seqlen_k)
        # (s_q, tile) boolean: the keys each row attends (None: all of the tile's keys).
        self.kept: torch.Tensor | None = mask.keep(rows, cols) if mask.is_masked else None
        if self.kept is not None:
            raw = raw.masked_fill(~self.kept, float("-inf"))
        self.scores = raw
        self.keep: torch.Tensor | None = None
        if p.dropout_p > 0:
            # Global coordinates: a chunk of a call draws the same pattern as the whole call.
            where = p.where
            heads = torch.arange(p.heads_q, device=q.device) + where.head_offset
            seed, offset = params.dropout_rng_state().tolist()
            self.keep = keep_mask((seed, offset), p.dropout_p, seq.index + where.batch_offset, where.heads, heads,
                                  rows + where.row_offset, cols)

    def dropped(self, probs: torch.Tensor, dropout_p: float) -> torch.Tensor:
        return probs if self.keep is None else probs * self.keep / (1.0 - dropout_p)


def kept_matmul(a: torch.Tensor, b: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """`a @ b` over one key tile, `a` (h, rows, keys) zero where a row does not attend a key, `b` (h, keys, d),
    where a key a row does not attend contributes nothing to that row, even a NaN/Inf in `b` (a plain
    matmul would spread it as 0 * NaN). `kept`: (rows, keys) booleans, or None (every key attended).
    docs/semantics.md §Non-finite values: exact per element here; the GPU kernels guarantee it per tile."""
    if kept is None:
        return torch.matmul(a, b)
    finite = torch.isfinite(b).all(-1)                                   # (h, keys)
    if bool(finite.all()):
        return torch.matmul(a, b)
    result = torch.matmul(a, torch.where(finite[..., None], b, torch.zeros((), dtype=b.dtype, device=b.device)))
    for j in (~finite).any(0).nonzero().flatten().tolist():              # the few keys with non-finite values
        contribution = a[:, :, j, None] * b[:, None, j, :]               # (h, rows, d)
        result += torch.where(kept[None, :, j, None], contribution, torch.zeros((), dtype=b.dtype, device=b.device))
    return result


def heads_first(t: torch.Tensor, dtype: torch.dtype, group: int = 1) -> torch.Tensor:
    """(s, h, d) -> (h * group, s, d) in `dtype`, repeating each head `group` times."""
    t = t.to(dtype).transpose(0, 1)
    return t.repeat_interleave(group, dim=0) if group > 1 else t


@without_autocast
def attention_probs(problem: AttentionProblem, params: AttentionParams, lse: torch.Tensor) -> torch.Tensor:
    """Test-only: the softmax probabilities `(b, h, max_s_q, max_s_k)` with the dropout pattern in
    the sign (negative = dropped; flash-attn's `S_dmask` convention). Varlen rows/columns past a
    sequence's end, and masked entries, are 0. Materialises s_q x s_k per head."""
    p = problem
    probs = torch.zeros(p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, dtype=p.accum_dtype, device=p.device)
    for seq in sequences(p, params):
        if seq.seqlen_q == 0 or seq.seqlen_k == 0:
            continue
        q = heads_first(seq.rows_q(params.q), p.accum_dtype)
        k = heads_first(seq.rows_k(params.k), p.accum_dtype, p.group_size)
        st = ScoreTile(p, params, seq, q, k, 0, seq.seqlen_k)
        tile = torch.exp(st.scores - seq.lse(lse)[..., None])
        if st.keep is not None:
            tile = torch.where(st.keep, tile, -tile)
        probs[seq.index, :, :seq.seqlen_q, :seq.seqlen_k] = tile
    return probs
