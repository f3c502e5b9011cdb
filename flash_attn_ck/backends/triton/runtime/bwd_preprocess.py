"""Backward pre-process: delta = rowsum(dO * O) in fp32 (strided like lse), and zeroing of the fp32
accumulators (dK/dV for the GQA accumulator epilogue, dQ for the atomic dQ mode) and of the
deterministic semaphores, so the frontend can hand them over uninitialised.

Grid: (row tiles, batch * heads), `n_rows` rows per batch entry; a varlen call is one entry of every packed row
(launch.bwd_preprocess). Every program also zeroes its share of each flat buffer:
`zero_ptrs` / `zero_numels` are tuples (dq, dk, dv accumulators, semaphores) and the constexpr
tuple ZERO says which exist (launch.bwd_preprocess). Strides are (batch, row, head) tuples, and
(batch, head) for Delta.
"""

import triton
import triton.language as tl

ZERO_BLOCK = 1024       # elements per zeroing store (zero_share)


@triton.jit
def zero_share(ptr, numel, pid, nprog, ZERO_BLOCK: tl.constexpr):
    """Zero elements [pid * share, (pid + 1) * share) of a flat buffer, share = ceil(numel / nprog)."""
    share = tl.cdiv(tl.cdiv(numel, nprog), ZERO_BLOCK) * ZERO_BLOCK
    start = pid.to(tl.int64) * share
    offs = tl.arange(0, ZERO_BLOCK)
    for i in range(0, share, ZERO_BLOCK):
        idx = start + i + offs
        tl.store(ptr + idx, tl.zeros([ZERO_BLOCK], ptr.dtype.element_ty), mask=idx < numel)


@triton.jit
def bwd_preprocess_kernel(
        Out, dOut, Delta, stride_o, stride_do, stride_delta, heads, n_rows, head_dim, zero_ptrs, zero_numels,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ZERO_BLOCK: tl.constexpr, ZERO: tl.constexpr):
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    nprog = tl.num_programs(0) * tl.num_programs(1)
    # ---- accumulators and semaphores ----
    for i in tl.static_range(len(ZERO)):
        if ZERO[i]:
            zero_share(zero_ptrs[i], zero_numels[i], pid, nprog, ZERO_BLOCK)

    # ---- delta = rowsum(dO * O) ----
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n_rows
    mask = row_ok[:, None] & (offs_d < head_dim)[None, :]
    rows = offs_m.to(tl.int64)
    o = tl.load(Out + b.to(tl.int64) * stride_o[0] + h.to(tl.int64) * stride_o[2] + rows[:, None] * stride_o[1]
                + offs_d[None, :],
                mask=mask, other=0.0)
    do = tl.load(dOut + b.to(tl.int64) * stride_do[0] + h.to(tl.int64) * stride_do[2] + rows[:, None] * stride_do[1]
                 + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b.to(tl.int64) * stride_delta[0] + h.to(tl.int64) * stride_delta[1] + rows, delta, mask=row_ok)
