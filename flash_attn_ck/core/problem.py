"""The description of one attention call that every stage after validation works from.

`AttentionProblem` holds sizes and features only (no tensors): backends decide from it whether they
can run a call, and workspace plans are computed from it. `AttentionParams` holds the tensors a
kernel needs besides q/k/v, in the kernel layout (head dim already padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from .mask import MaskInfo

# Entries of one problem's memo before it is emptied: a backend keeps a few dozen (kernel choices, launch constants,
# replays, chunk plans); the bound matters only to callers that make a new backend per call.
MEMO_ENTRIES = 256


def pad_head_dim(head_dim: int, multiple: int = 8) -> int:
    return -(-head_dim // multiple) * multiple


def row_stats_shape(rows: tuple[int, ...], heads: int) -> tuple[int, ...]:
    """The shape of lse-like row statistics for q-like rows `(b, s)` or varlen `(total,)`:
    `(b, h, s)`, or `(h, total)`."""
    return (heads, *rows) if len(rows) == 1 else (rows[0], heads, rows[1])


def accum_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """lse, D and dQ accumulators: fp32 as in CK; fp64 inputs (gradcheck on the reference) keep fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def result_shape(q: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """out and dout: q's rows and heads, v's head dim."""
    return (*q.shape[:-1], v.shape[-1])


@dataclass(frozen=True)
class Placement:
    """Where a chunk of a call sits in the whole call (pipeline/chunking.py). Dropout counters and
    masks use these global coordinates, so a chunk draws the same keep pattern as the whole call."""
    batch_offset: int = 0        # first sequence of the chunk
    head_offset: int = 0         # first query head of the chunk
    row_offset: int = 0          # first query row of the chunk (batch mode only)
    heads: int = 0               # query heads of the whole call
    seqlen_q: int = 0            # (max) query length of the whole call


@dataclass(frozen=True)
class AttentionProblem:
    batch: int                  # number of sequences (varlen: len(cu_seqlens) - 1)
    seqlen_q: int               # varlen: max_seqlen_q
    seqlen_k: int               # varlen: max_seqlen_k
    heads_q: int
    heads_k: int
    head_dim: int               # q's and k's, as the user passed it
    dtype: torch.dtype
    device: torch.device
    mask: MaskInfo
    softmax_scale: float
    varlen: bool = False
    total_q: int = 0            # varlen only: rows of the packed q / k
    total_k: int = 0
    has_alibi: bool = False
    has_sink: bool = False      # a learnable sink (AttentionOptions.learnable_sink)
    dropout_p: float = 0.0
    softcap: float = 0.0
    deterministic: bool = False
    # out (forward), dq/dk/dv (backward): dtype, or fp32 for fp16/bf16 inputs (AttentionOptions.out_dtype);
    # None: dtype. Backends that cannot write fp32 results refuse the call (Backend.fp32_outputs_refusal).
    out_dtype: torch.dtype | None = None
    # v's (and out's, dout's, dv's); 0: head_dim (q, k and v share one head dim)
    head_dim_v: int = 0
    head_dim_padded: int = field(default=0)
    head_dim_v_padded: int = field(default=0)
    placement: Placement | None = None      # a chunk's place in the whole call (None: the whole call; `where`)
    # What is derived from this problem alone, kept by whoever derives it (a backend's kernel choice and launch
    # constants, under a key of its own): a problem is immutable, and the pipeline reuses one per call signature
    # (pipeline/prepare.py), so a repeated call finds its decisions here. Not part of the problem's value; nor are
    # the cached properties below (computed once per problem: the pipeline asks them on every call).
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def remember(self, key, value):
        """`memo[key] = value`, returned. A memo that holds MEMO_ENTRIES is emptied first: its keys name backend
        instances, so a caller that makes a backend per call (`backend=TritonBackend(...)`) would otherwise keep
        every one of them alive here for as long as the problem lives."""
        if len(self.memo) >= MEMO_ENTRIES:
            self.memo.clear()
        self.memo[key] = value
        return value

    def __post_init__(self):
        if self.out_dtype is None:
            object.__setattr__(self, "out_dtype", self.dtype)
        if self.head_dim_v == 0:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.head_dim_padded == 0:
            object.__setattr__(self, "head_dim_padded", pad_head_dim(self.head_dim))
        if self.head_dim_v_padded == 0:
            object.__setattr__(self, "head_dim_v_padded", pad_head_dim(self.head_dim_v))

    @property
    def results_dtype(self) -> torch.dtype:
        """The dtype of out (forward) and dq/dk/dv (backward): `out_dtype`, which construction has resolved."""
        return self.dtype if self.out_dtype is None else self.out_dtype

    @cached_property
    def where(self) -> Placement:
        """Where this problem sits in the whole call: its placement, or the whole call itself."""
        return self.placement or Placement(heads=self.heads_q, seqlen_q=self.seqlen_q)

    @property
    def padded(self) -> bool:
        """Whether the kernels see a head dim (q/k's or v's) padded beyond the user's."""
        return self.head_dim_padded != self.head_dim or self.head_dim_v_padded != self.head_dim_v

    @property
    def widest_head_dim_padded(self) -> int:
        """The larger padded head dim: what sizes a kernel's head-dim bucket (CK's `t.hdim_q <= hdim && t.hdim_v <=
        hdim`)."""
        return max(self.head_dim_padded, self.head_dim_v_padded)

    @property
    def accum_dtype(self) -> torch.dtype:
        return accum_dtype_for(self.dtype)

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_k

    @property
    def is_gqa(self) -> bool:
        return self.heads_q != self.heads_k

    @property
    def rows_q(self) -> int:
        """Rows of q per head across the batch (the leading dims of q flattened)."""
        return self.total_q if self.varlen else self.batch * self.seqlen_q

    @property
    def rows_k(self) -> int:
        return self.total_k if self.varlen else self.batch * self.seqlen_k

    @cached_property
    def has_queries(self) -> bool:
        """Whether some sequence has a query row. Kernels size their grids from the (max) length, so a varlen
        call with max_seqlen_q = 0 has none even when q holds rows (after cu_seqlens_q[-1], in no sequence)."""
        return self.rows_q > 0 and self.seqlen_q > 0

    @cached_property
    def has_keys(self) -> bool:
        """Whether some sequence has a key row (as `has_queries`)."""
        return self.rows_k > 0 and self.seqlen_k > 0

    @property
    def q_rows_shape(self) -> tuple[int, ...]:
        """The leading dims of q (and out, dout, dq): `(b, s_q)`, or varlen `(total_q,)`."""
        return (self.total_q,) if self.varlen else (self.batch, self.seqlen_q)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """out and dout: q's rows and heads, v's head dim."""
        return (*self.q_rows_shape, self.heads_q, self.head_dim_v)

    @property
    def k_rows_shape(self) -> tuple[int, ...]:
        """The leading dims of k (and v, dk, dv): `(b, s_k)`, or varlen `(total_k,)`."""
        return (self.total_k,) if self.varlen else (self.batch, self.seqlen_k)

    @cached_property
    def lse_shape(self) -> tuple[int, ...]:
        """softmax_lse and softmax_d: `(b, h, s_q)`, or varlen `(h, total_q)`."""
        return row_stats_shape(self.q_rows_shape, self.heads_q)

    def forward_flops(self) -> float:
        """docs/semantics.md: 2 b h s_q s_k (d + d_v) (q k^T and P v; 4 b h s_q s_k d when d_v = d), halved when
        causal (dense shapes; varlen uses the max lengths)."""
        return self._matmul_flops(self.head_dim + self.head_dim_v)

    def backward_flops(self) -> float:
        """2 b h s_q s_k (3 d + 2 d_v): q k^T, dQ and dK over d; dO v^T and dV over d_v (2.5x the forward when
        d_v = d), halved when causal."""
        return self._matmul_flops(3 * self.head_dim + 2 * self.head_dim_v)

    def _matmul_flops(self, summed_head_dims: int) -> float:
        flops = 2.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * summed_head_dims
        return flops / 2 if self.mask.is_causal else flops


@dataclass
class AttentionParams:
    """Kernel-layout tensors shared by forward and backward (head dims padded to a multiple of 8)."""
    q: torch.Tensor                         # (b, s_q, h, d) or varlen (total_q, h, d)
    k: torch.Tensor                         # (b, s_k, h_k, d) or varlen (total_k, h_k, d)
    v: torch.Tensor                         # (b, s_k, h_k, d_v) or varlen (total_k, h_k, d_v)
    cu_seqlens_q: torch.Tensor | None = None   # int32 (b + 1,), varlen only
    cu_seqlens_k: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None   # fp32 (h,) or (b, h)
    rng_state: torch.Tensor | None = None      # int64 [seed, offset], dropout only
    # (h,) logits of a learnable sink in lse's dtype (fp32; fp64 for fp64 calls), forward only: a backend whose
    # forward takes it (Backend.forward_takes_sink) reads it, the others leave it to the pipeline's fold (core/sink.py)
    learnable_sink: torch.Tensor | None = None

    def offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cu_seqlens_q, cu_seqlens_k)` of a varlen call (a dense call has none: asking is a bug)."""
        if self.cu_seqlens_q is None or self.cu_seqlens_k is None:
            raise TypeError("AttentionParams.offsets: a dense call's params have no sequence offsets")
        return self.cu_seqlens_q, self.cu_seqlens_k

    def dropout_rng_state(self) -> torch.Tensor:
        """`rng_state` of a call with dropout (one without has none: asking is a bug)."""
        if self.rng_state is None:
            raise TypeError("AttentionParams.dropout_rng_state: a call without dropout has no rng_state")
        return self.rng_state
