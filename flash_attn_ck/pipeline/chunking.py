"""Bounded backward workspace: split a call into chunks whose workspace fits under a cap.

The CK contract's buffers grow with the problem (expanded dK/dV for GQA; deterministic `dq_accum`
with one fp32 split per key tile). When a backend's plan exceeds the cap, the backward runs in
chunks, each on views of the inputs and outputs (no copies of q/k/v/out/dout):

1. whole KV-head groups (with their query heads) and batch entries: exact by construction, so the
   result is bit-identical to the unchunked call;
2. if one group of one sequence is still too large: slices of the group's query heads and/or of
   the query rows (batch mode, no ALiBi). Their dK/dV are partial sums, written in the gradients' dtype
   (as CK's expanded buffers are: the input dtype, or fp32 with `out_dtype`) and added in fp32 (fp64 for fp64
   inputs) in a fixed order, so runs stay deterministic.

Chunks carry a `Placement` (global batch/head/row offsets), so dropout draws the same keep pattern
and masks keep their alignment. If even the smallest chunk does not fit, the backend's leaner setup
(`Backend.leaner`: the Triton backend's one-launch kernel, which has no fp32 dQ accumulator) is planned
instead; if that does not fit either, `WorkspaceError` says how much it needs.
"""

from __future__ import annotations

import collections.abc
import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ..backends.base import Backend
from ..core import checks
from ..core.errors import ArgumentError, WorkspaceError
from ..core.mask import MaskInfo, MaskType
from ..core.plan import BufferSpec, WorkspacePlan, format_bytes
from ..core.problem import AttentionParams, AttentionProblem, Placement

WORKSPACE_ENV = "FLASH_ATTN_CK_MAX_WORKSPACE_BYTES"
# 4 GiB: every shape of the benchmark grid (docs/semantics.md) runs unchunked in non-deterministic mode, while the
# deterministic long-context cases that would need tens of GiB are bounded. -1 removes the cap.
DEFAULT_MAX_WORKSPACE_BYTES = 4 << 30


def workspace_cap(max_workspace_bytes: int | None) -> int | None:
    """The argument, else `$FLASH_ATTN_CK_MAX_WORKSPACE_BYTES` (unset or empty: not given), else the
    default; None = no cap (-1). Other negative values are refused, naming the argument or the variable."""
    if max_workspace_bytes is None:
        text = os.environ.get(WORKSPACE_ENV, "").strip()
        if text:
            try:
                value = int(text)
            except ValueError:
                raise ArgumentError(f"{WORKSPACE_ENV}={text!r}: expected an integer number of bytes "
                                    f"(-1: no cap)") from None
            max_workspace_bytes = checks.check_workspace_bytes(f"{WORKSPACE_ENV}={text!r}", value)
        else:
            max_workspace_bytes = DEFAULT_MAX_WORKSPACE_BYTES
    else:
        max_workspace_bytes = checks.check_workspace_bytes("max_workspace_bytes", max_workspace_bytes)
    return None if max_workspace_bytes == -1 else int(max_workspace_bytes)


@dataclass(frozen=True)
class Chunk:
    batch: tuple[int, int]          # sequences [start, end)
    kv_heads: tuple[int, int]       # key/value heads [start, end)
    group_heads: tuple[int, int]    # query heads inside each group [start, end): (0, group) = whole groups
    rows: tuple[int, int]           # query rows [start, end) (batch mode; varlen: all rows)

    def partial(self, problem: AttentionProblem) -> bool:
        """True when dK/dV of this chunk are partial sums (the group or the rows are split)."""
        return self.group_heads != (0, problem.group_size) or self.rows != (0, problem.seqlen_q)


class Ranges(collections.abc.Sequence):
    """[0, total) cut into ranges [start, end) of `size` (the last one shorter), made on demand: the row axis
    of a long call sliced into single rows has as many ranges as rows, and planning must not build them
    (its cost stays independent of the sequence length). Compares equal to any sequence of the same ranges."""

    def __init__(self, total: int, size: int):
        self.total, self.size = total, size

    def __len__(self) -> int:
        return -(-self.total // self.size)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.size
        return start, min(start + self.size, self.total)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((start, min(start + self.size, self.total)) for start in range(0, self.total, self.size))

    def __eq__(self, other) -> bool:
        if isinstance(other, Ranges):     # one range: any size at least the total cuts the same
            return (self.total, len(self)) == (other.total, len(other)) and (len(self) < 2 or self.size == other.size)
        if isinstance(other, collections.abc.Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"Ranges(total={self.total}, size={self.size})"


class ChunkGrid(collections.abc.Sequence):
    """A chunking: every combination of a batch range, a kv-head range, a group-head range and a row range,
    in that nesting order, made on demand (a row-sliced plan of a long call has millions of chunks, and
    planning must not build them). Compares equal to any sequence of the same chunks."""

    def __init__(self, batch, kv_heads, group_heads, rows):
        """Each axis: `Ranges`, or any sequence of (start, end) pairs."""
        self.axes = tuple(axis if isinstance(axis, Ranges) else tuple(axis)
                          for axis in (batch, kv_heads, group_heads, rows))
        self.length = math.prod(len(axis) for axis in self.axes)     # once: every backward asks (run_backward)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        picked = []
        for axis in reversed(self.axes):
            index, position = divmod(index, len(axis))
            picked.append(axis[position])
        return Chunk(*reversed(picked))

    def __iter__(self) -> Iterator[Chunk]:
        return (Chunk(*c) for c in itertools.product(*self.axes))

    def __eq__(self, other) -> bool:
        if isinstance(other, ChunkGrid):
            return self.axes == other.axes
        if isinstance(other, collections.abc.Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"ChunkGrid({len(self)} chunks: batch {self.axes[0][:2]}..., kv heads {self.axes[1][:2]}..., " \
               f"group heads {self.axes[2][:2]}..., rows {self.axes[3][:2]}...)"


@dataclass(frozen=True)
class HostOffsets:
    """A varlen call's sequence offsets, read to the host (a device sync: only where the call must be chunked)."""
    q: tuple[int, ...]
    k: tuple[int, ...]

    @classmethod
    def read(cls, params: AttentionParams) -> HostOffsets:
        cu_q, cu_k = params.offsets()
        return cls(tuple(cu_q.tolist()), tuple(cu_k.tolist()))

    def starts(self, batch: tuple[int, int]) -> tuple[int, int]:
        """The first packed (q, k) row of the sequences [b0, b1)."""
        return self.q[batch[0]], self.k[batch[0]]

    def rows(self, batch: tuple[int, int]) -> tuple[int, int]:
        """Packed (q, k) rows of the sequences [b0, b1)."""
        (b0, b1) = batch
        return self.q[b1] - self.q[b0], self.k[b1] - self.k[b0]


def _read(offsets: HostOffsets | None) -> HostOffsets:
    """The host offsets that a chunk of some of a varlen call's sequences needs (planning read them)."""
    if offsets is None:
        raise TypeError("a chunk of some sequences of a varlen call needs the offsets its plan read")
    return offsets


@dataclass(frozen=True)
class ChunkPlan:
    backend: str
    cap: int | None
    shared: tuple[BufferSpec, ...]      # allocated once for the whole call
    per_chunk: WorkspacePlan            # the largest chunk's workspace (reallocated per chunk)
    chunks: ChunkGrid
    unchunked_bytes: int                # what the call would need in one piece
    runner: Backend                     # the backend instance that runs the chunks (its leaner setup, see note)
    offsets: HostOffsets | None = None  # varlen offsets on the host, once chunked
    note: str = ""                      # why the runner is not the backend asked for

    @property
    def peak_bytes(self) -> int:
        return sum(b.nbytes for b in self.shared) + self.per_chunk.total_bytes

    def describe(self) -> str:
        cap = "none" if self.cap is None else format_bytes(self.cap)
        lines = [f"backward workspace ({self.backend}): cap {cap}; unchunked {format_bytes(self.unchunked_bytes)}; "
                 f"{len(self.chunks)} chunk(s); peak {format_bytes(self.peak_bytes)}"]
        if self.note:
            lines.append(f"  {self.note}")
        if self.shared:
            lines.append("  shared by all chunks:")
            lines += [f"    {b.name:<13} {format_bytes(b.nbytes):>10}  {b.purpose}" for b in self.shared]
        lines.append("  " + self.per_chunk.describe().replace("\n", "\n  "))
        return "\n".join(lines)


# ---- planning -----------------------------------------------------------------------------------

def whole_call(problem: AttentionProblem) -> Chunk:
    """The one chunk of a call that fits under the cap."""
    p = problem
    return Chunk((0, p.batch), (0, p.heads_k), (0, p.group_size), (0, p.seqlen_q))


def chunk_problem(problem: AttentionProblem, chunk: Chunk, rows_q: int, rows_k: int) -> AttentionProblem:
    """The sub-problem a chunk solves; `rows_q/k` are its packed row counts (varlen)."""
    p = problem
    b0, b1 = chunk.batch
    g0, g1 = chunk.kv_heads
    a, b = chunk.group_heads
    r0, r1 = chunk.rows
    heads_k = g1 - g0
    heads_q = heads_k * (b - a)
    mask = p.mask
    if (r0, r1) != (0, p.seqlen_q) and mask.type != MaskType.NO_MASK:
        # Rows [r0, r1): the same keep rule in the chunk's own row numbering, as generic (y, x).
        full = mask.for_lengths(p.seqlen_q, p.seqlen_k)
        mask = MaskInfo.generic(full.y - r0, full.x + r0, r1 - r0, p.seqlen_k)
    placement = Placement(batch_offset=b0, head_offset=g0 * p.group_size + a, row_offset=r0,
                          heads=p.heads_q, seqlen_q=p.seqlen_q)
    if p.varlen:
        return replace(p, batch=b1 - b0, heads_q=heads_q, heads_k=heads_k, total_q=rows_q, total_k=rows_k,
                       mask=mask, placement=placement)
    return replace(p, batch=b1 - b0, seqlen_q=r1 - r0, heads_q=heads_q, heads_k=heads_k, mask=mask,
                   placement=placement)


def _partial_sums(problem: AttentionProblem, rows: tuple[int, ...], heads_k: int) -> tuple[BufferSpec, ...]:
    """Sums of dK/dV partials in the accumulation dtype, and the chunk's own dK/dV in the gradients' dtype (the
    input dtype, or fp32 with `out_dtype`; the user's head dim: a chunk unpads its result before it is added).
    `rows`: the widest chunk's key rows, `(batch, s_k)` or varlen `(rows,)`."""
    p = problem
    accum = str(p.accum_dtype).removeprefix("torch.")
    head_dims = (("dk", p.head_dim), ("dv", p.head_dim_v))
    return tuple([BufferSpec(f"{g}_sum", (*rows, heads_k, d), p.accum_dtype, True, f"{accum} sum of {g} partials")
                  for g, d in head_dims] +
                 [BufferSpec(f"{g}_partial", (*rows, heads_k, d), p.results_dtype, False, f"one chunk's {g} partial")
                  for g, d in head_dims])


def backward_plan(backend, problem: AttentionProblem) -> WorkspacePlan:
    """The backend's buffers plus, for head dims that are not a multiple of 8, the padded copies: of q, k, dq, dk
    where q's head dim d is not, of v, out, dout, dv where v's d_v is not."""
    plan = backend.backward_plan(problem)
    if not problem.padded:
        return plan
    p = problem
    rows_q, rows_k = p.q_rows_shape, p.k_rows_shape
    qk = (p.head_dim, p.head_dim_padded, "d")
    value = (p.head_dim_v, p.head_dim_v_padded, "d_v")
    operands = (("q", rows_q, p.heads_q, p.dtype, qk), ("k", rows_k, p.heads_k, p.dtype, qk),
                ("v", rows_k, p.heads_k, p.dtype, value), ("out", rows_q, p.heads_q, p.dtype, value),
                ("dout", rows_q, p.heads_q, p.dtype, value), ("dq", rows_q, p.heads_q, p.results_dtype, qk),
                ("dk", rows_k, p.heads_k, p.results_dtype, qk), ("dv", rows_k, p.heads_k, p.results_dtype, value))
    padding = [BufferSpec(f"{name}_padded", (*rows, heads, padded), dtype, True,
                          f"{name} zero-padded to {label}={padded}")
               for name, rows, heads, dtype, (user, padded, label) in operands if padded != user]
    return replace(plan, buffers=plan.buffers + tuple(padding))


def plan_chunks(problem: AttentionProblem, backend, cap: int | None,
                params: AttentionParams | None = None) -> ChunkPlan:
    """Pick the largest chunks whose workspace fits under `cap` (see the module docstring).

    Varlen offsets are read to the host (a device sync) only when the call must be chunked. Plans that
    read no offsets (every dense plan, and a varlen call that fits unchunked) depend on the problem, the
    backend and the cap alone and are memoised: planning runs on every backward, and small calls are
    host-bound."""
    key = ("chunk plan", backend, cap)       # in problem.memo: hashing the problem by value costs microseconds
    plan = problem.memo.get(key)
    if plan is None:
        plan = _plan_chunks(problem, backend, cap, params if problem.varlen else None)
        if plan.offsets is None:
            problem.remember(key, plan)
    return plan


class _Planner:
    """Costs chunkings of one call without building their chunks: the shared buffers, the largest chunk's
    plan (memoised by shape: plans depend on sizes only) and so the peak. Dense chunks are largest first in
    every axis; varlen batch ranges differ in rows, so each distinct (rows_q, rows_k) that no other
    dominates is costed (a few per chunking)."""

    def __init__(self, problem: AttentionProblem, backend, cap: int | None):
        self.problem, self.backend, self.cap = problem, backend, cap
        self.full = backward_plan(backend, problem)
        self.whole = whole_call(problem)
        self.offsets: HostOffsets | None = None      # varlen offsets on the host, once read
        self._plans: dict[tuple, WorkspacePlan] = {}
        self._windows: dict[int, tuple[tuple[int, int], ...]] = {}

    def rows(self, chunk: Chunk) -> tuple[int, int]:
        return chunk_rows(self.problem, chunk, self.offsets)

    def chunk_plan(self, c: Chunk, rows: tuple[int, int]) -> WorkspacePlan:
        """A chunk's own buffers (softmax_d is shared by all chunks)."""
        key = (c.batch[1] - c.batch[0], c.kv_heads[1] - c.kv_heads[0], c.group_heads[1] - c.group_heads[0],
               c.rows[1] - c.rows[0], *rows)
        if key not in self._plans:
            plan = self.full if c == self.whole else backward_plan(self.backend, chunk_problem(self.problem, c, *rows))
            self._plans[key] = replace(plan, buffers=tuple(b for b in plan.buffers if b.name != "softmax_d"))
        return self._plans[key]

    def windows(self, grid: ChunkGrid) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
        """(batch range, (rows_q, rows_k)) of the batch ranges whose packed rows no other range's dominate."""
        p, batch = self.problem, grid.axes[0]
        if not p.varlen or batch == ((0, p.batch),):
            probe = Chunk(batch[0], grid.axes[1][0], grid.axes[2][0], grid.axes[3][0])
            return ((batch[0], self.rows(probe)),)
        offsets = _read(self.offsets)
        rows = {r: offsets.rows(r) for r in batch}
        best: dict[tuple[int, int], tuple[int, int]] = {}
        for r, (rq, rk) in rows.items():
            if not any(oq >= rq and ok >= rk and (oq, ok) != (rq, rk) for oq, ok in rows.values()):
                best.setdefault((rq, rk), r)
        return tuple((r, rr) for rr, r in best.items())

    def cost(self, grid: ChunkGrid) -> ChunkPlan:
        p = self.problem
        batch, kv_heads, group_heads, rows = grid.axes
        shared = [next(b for b in self.full.buffers if b.name == "softmax_d")]
        windows = self.windows(grid)
        if group_heads != ((0, p.group_size),) or rows != ((0, p.seqlen_q),):      # dK/dV partial sums
            shared += _partial_sums(p, self.widest_keys(batch, windows), max(g1 - g0 for g0, g1 in kv_heads))
        plans = [self.chunk_plan(Chunk(b, kv_heads[0], group_heads[0], rows[0]), rr) for b, rr in windows]
        largest = max(plans, key=lambda plan: plan.total_bytes)
        return ChunkPlan(self.backend.name, self.cap, tuple(shared), largest, grid, self.full.total_bytes,
                         runner=self.backend, offsets=self.offsets)

    def fits(self, cap: int, sequences: int, kv_heads: int, heads: int, rows: int) -> bool:
        """Whether chunks of `sequences` x `kv_heads` x `heads` query heads of a group x `rows` rows fit."""
        return self.cost(_grid(self.problem, sequences, kv_heads, heads, rows)).peak_bytes <= cap

    def whole_groups(self, cap: int) -> ChunkPlan | None:
        """Stage 1: for each number of kv heads, the most sequences that fit (binary search: the peak grows with
        both); the chunking with the most (sequences x kv heads), then the most kv heads, wins. None: not even one
        group of one sequence fits."""
        p = self.problem
        best: tuple[int, int] | None = None       # (sequences, kv heads)
        for kv_heads in range(p.heads_k, 0, -1):
            lo, hi = 0, p.batch          # fits(lo) (0: none), not fits(hi + 1)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.fits(cap, mid, kv_heads, p.group_size, p.seqlen_q) else (lo, mid - 1)
            if lo and (best is None or (lo * kv_heads, kv_heads) > (best[0] * best[1], best[1])):
                best = (lo, kv_heads)
        return None if best is None else self.cost(_grid(p, *best, p.group_size, p.seqlen_q))

    def slices(self, cap: int, row_sizes: list[int]) -> ChunkPlan | None:
        """Stage 2: one group of one sequence, split into query-head slices, then query-row slices; the first that
        fits (None: only the smallest does)."""
        p = self.problem
        for rows in row_sizes:
            for heads in range(p.group_size, 0, -1):
                if (rows, heads) != (p.seqlen_q, p.group_size) and self.fits(cap, 1, 1, heads, rows):
                    return self.cost(_grid(p, 1, 1, heads, rows))
        return None

    def widest_keys(self, batch, windows) -> tuple[int, ...]:
        """The key rows of the widest chunk, `(batch, s_k)` or varlen `(rows,)`: the shape of its dK/dV partials."""
        p = self.problem
        if not p.varlen:        # by batch entries: s_k may be 0
            return (max(b1 - b0 for b0, b1 in batch), p.seqlen_k)
        if batch != ((0, p.batch),):
            offsets = _read(self.offsets)
            return (max(offsets.rows(r)[1] for r in batch),)
        return (max(rr[1] for _, rr in windows),)


def _plan_chunks(problem: AttentionProblem, backend, cap: int | None,
                 params: AttentionParams | None) -> ChunkPlan:
    """The whole call if it fits; else the largest chunks that fit (stage 1: whole groups and batch entries,
    most (sequences x kv heads) first; stage 2: head and row slices of one group of one sequence). Costs
    O(h_k log b + G log s_q) chunk plans, never a list of chunks: fast for any shape, and a cap that not even
    the smallest chunk fits fails at once."""
    p = problem
    planner = _Planner(problem, backend, cap)
    plan = planner.cost(_grid(p, p.batch, p.heads_k, p.group_size, p.seqlen_q))
    if cap is None or plan.peak_bytes <= cap:
        return plan
    _check_chunkable(problem, backend, cap, plan.peak_bytes)
    if problem.varlen:
        if params is None:
            raise TypeError("planning chunks of a varlen call needs its params (the sequence offsets)")
        if any(cu.is_meta for cu in params.offsets()):     # backward_workspace plans from meta tensors
            raise WorkspaceError(f"backend {backend.name!r}: the backward needs {format_bytes(plan.peak_bytes)} of "
                                 f"workspace, over the cap of {format_bytes(cap)}, and a varlen call is chunked by "
                                 "its sequences, whose offsets meta cu_seqlens do not hold (plan with tensors on a "
                                 f"real device, or raise max_workspace_bytes or {WORKSPACE_ENV})")
        planner.offsets = HostOffsets.read(params)
    row_sizes = _row_sizes(problem, backend)
    smallest = planner.cost(_grid(p, 1, 1, 1, row_sizes[-1]))
    if smallest.peak_bytes > cap:
        return _plan_leaner(problem, backend, cap, params, smallest.peak_bytes)
    return planner.whole_groups(cap) or planner.slices(cap, row_sizes) or smallest


def _plan_leaner(problem: AttentionProblem, backend, cap: int, params: AttentionParams | None,
                 smallest_bytes: int) -> ChunkPlan:
    """The plan of the backend's leaner setup, when not even the smallest chunk of its default one fits."""
    leaner = backend.leaner()
    if leaner is None:
        raise WorkspaceError(f"backend {backend.name!r}: the backward needs at least "
                             f"{format_bytes(smallest_bytes)} of workspace even in its smallest chunk, over the "
                             f"cap of {format_bytes(cap)} (raise max_workspace_bytes or {WORKSPACE_ENV})")
    plan = _plan_chunks(problem, leaner, cap, params)
    return replace(plan, note=f"the default setup needs {format_bytes(smallest_bytes)} even in its "
                              "smallest chunk, over the cap: the leaner setup runs (kernel line below)")


def _grid(p: AttentionProblem, nb: int, ng: int, heads: int, rows: int) -> ChunkGrid:
    """Chunks of `nb` sequences x `ng` kv heads x `heads` query heads of a group x `rows` query rows."""
    return ChunkGrid(Ranges(p.batch, nb), Ranges(p.heads_k, ng), Ranges(p.group_size, heads),
                     Ranges(p.seqlen_q, rows) if p.seqlen_q else ((0, 0),))


def _row_sizes(problem: AttentionProblem, backend) -> list[int]:
    """Query rows per chunk to try, largest first: all, then halving (batch mode, no ALiBi, where the backend
    can run row slices)."""
    p = problem
    sizes = [p.seqlen_q]
    if not p.varlen and not p.has_alibi and backend.supports_row_chunks:
        size = p.seqlen_q
        while size > 1:
            size = -(-size // 2)
            sizes.append(size)
    return sizes


def _check_chunkable(problem: AttentionProblem, backend, cap: int, peak: int) -> None:
    why_not = None
    if not backend.supports_chunks:
        why_not = "this backend cannot run a call in chunks"
    elif problem.dropout_p > 0 and not backend.supports_chunked_dropout:
        why_not = "with dropout, chunks would change this backend's keep pattern"
    if why_not:
        raise WorkspaceError(f"backend {backend.name!r}: the backward needs {format_bytes(peak)} of workspace, "
                             f"over the cap of {format_bytes(cap)}, and {why_not} "
                             f"(raise max_workspace_bytes or {WORKSPACE_ENV})")


# ---- views of one chunk -------------------------------------------------------------------------

@dataclass
class ChunkViews:
    params: AttentionParams
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor
    dq: torch.Tensor
    softmax_d: torch.Tensor


def chunk_rows(problem: AttentionProblem, chunk: Chunk, offsets: HostOffsets | None) -> tuple[int, int]:
    """Packed (q, k) rows of a chunk; varlen needs the host offsets unless the chunk has every sequence."""
    b0, b1 = chunk.batch
    if not problem.varlen:
        return (b1 - b0) * (chunk.rows[1] - chunk.rows[0]), (b1 - b0) * problem.seqlen_k
    if chunk.batch == (0, problem.batch):
        return problem.total_q, problem.total_k
    return _read(offsets).rows(chunk.batch)


def chunk_views(problem: AttentionProblem, chunk: Chunk, plan: ChunkPlan, params: AttentionParams, out, lse, dout,
                dq, softmax_d) -> ChunkViews:
    p = problem
    whole_batch = chunk.batch == (0, p.batch)
    b0, b1 = chunk.batch
    g0, g1 = chunk.kv_heads
    a, b = chunk.group_heads
    r0, r1 = chunk.rows
    q_heads = (g0 * p.group_size + a, (g1 - g0) * (b - a))   # (start, count): contiguous when a slice
    assert b - a == p.group_size or g1 - g0 == 1, "a group is split only one KV head at a time"

    def q_like(t):
        t = t.narrow(-2, *q_heads)
        if p.varlen:
            return t if whole_batch else t.narrow(0, *_packed_rows(plan, chunk)[0])
        return t.narrow(0, b0, b1 - b0).narrow(1, r0, r1 - r0)

    def k_like(t):
        return kv_view(p, chunk, plan, t)

    def lse_like(t):
        if p.varlen:
            t = t.narrow(0, *q_heads)
            return t if whole_batch else t.narrow(1, *_packed_rows(plan, chunk)[0])
        return t.narrow(0, b0, b1 - b0).narrow(1, *q_heads).narrow(2, r0, r1 - r0)

    slopes = params.alibi_slopes
    if slopes is not None:
        slopes = slopes.narrow(-1, *q_heads)
        slopes = slopes.narrow(0, b0, b1 - b0) if slopes.dim() == 2 else slopes

    cu_seqlens_q, cu_seqlens_k = params.cu_seqlens_q, params.cu_seqlens_k
    if p.varlen and not whole_batch:      # the chunk's own offsets, from 0
        (start_q, _), (start_k, _) = _packed_rows(plan, chunk)
        cu_q, cu_k = params.offsets()
        cu_seqlens_q, cu_seqlens_k = cu_q[b0:b1 + 1] - start_q, cu_k[b0:b1 + 1] - start_k
    sub_params = AttentionParams(q=q_like(params.q), k=k_like(params.k), v=k_like(params.v),
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 alibi_slopes=slopes, rng_state=params.rng_state)
    return ChunkViews(sub_params, q_like(out), lse_like(lse), q_like(dout), q_like(dq), lse_like(softmax_d))


def kv_view(problem: AttentionProblem, chunk: Chunk, plan: ChunkPlan, t: torch.Tensor) -> torch.Tensor:
    """The chunk's slice of a k-shaped tensor (k, v, dk, dv)."""
    b0, b1 = chunk.batch
    t = t.narrow(-2, chunk.kv_heads[0], chunk.kv_heads[1] - chunk.kv_heads[0])
    if not problem.varlen:
        return t.narrow(0, b0, b1 - b0)
    if chunk.batch == (0, problem.batch):
        return t
    return t.narrow(0, *_packed_rows(plan, chunk)[1])


def _packed_rows(plan: ChunkPlan, chunk: Chunk) -> tuple[tuple[int, int], tuple[int, int]]:
    """`((start, rows) of q, (start, rows) of k)`: where a varlen chunk's sequences sit in the packed tensors."""
    offsets = _read(plan.offsets)
    (start_q, start_k), (rows_q, rows_k) = offsets.starts(chunk.batch), offsets.rows(chunk.batch)
    return (start_q, rows_q), (start_k, rows_k)
