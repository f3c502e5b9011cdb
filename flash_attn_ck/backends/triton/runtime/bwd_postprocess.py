"""Backward post-process: fp32 accumulators -> output dtype.

Used for dK/dV of the GQA accumulator epilogue (`(b, h_k, s_k, d)` or varlen `(h_k, total_k, d)`
-> `(b, s_k, h_k, d)` / `(total_k, h_k, d)`) and for dQ in the atomic dQ mode (fp32 buffer laid
out like q). Grid: (row blocks, heads, batch); rows are sequence positions (varlen: packed rows,
with batch = 1 and zero batch strides). Strides are (batch, head, row) tuples (launch.cast_rows).
It never writes its source: a zeroing store in the same kernel let the compiled code read back zeros (Triton
may re-issue a load next to a later use), so the accumulator reused by the next launch is zeroed by `zero_kernel`
(with the deterministic mode's semaphores): one launch, which a replay can re-issue where a torch fill could not.
"""

import triton
import triton.language as tl

from .bwd_preprocess import zero_share


@triton.jit
def cast_rows_kernel(Src, Dst, stride_src, stride_dst, n_rows, head_dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < head_dim)[None, :]
    r64 = rows[:, None].to(tl.int64)
    src = Src + b * stride_src[0] + h * stride_src[1] + r64 * stride_src[2] + cols[None, :]
    x = tl.load(src, mask=mask)
    tl.store(Dst + b * stride_dst[0] + h * stride_dst[1] + r64 * stride_dst[2] + cols[None, :],
             x.to(Dst.dtype.element_ty), mask=mask)


@triton.jit
def zero_kernel(buffers, numels, ZERO_BLOCK: tl.constexpr, COUNT: tl.constexpr):
    """Zero COUNT flat buffers, each program its share of each (launch.zero_flat)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for i in tl.static_range(COUNT):
        zero_share(buffers[i], numels[i], pid, nprog, ZERO_BLOCK)
