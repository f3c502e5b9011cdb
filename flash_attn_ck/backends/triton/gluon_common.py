"""What the warp-specialised Gluon kernels (fwd_ws.py, bwd_ws.py) share: sequence bounds, the visible
query/key ranges, the mask, the matmul against a tile of a TMA ring, and the host-side TMA descriptors (boxes
of one head over 3-D (rows, heads, head_dim) views).

The mask follows scores.py's conventions: bottom-right aligned per sequence (`shift = len_k - len_q`;
0 for top-left); row i keeps key j iff `j >= i + shift - left` (with a left bound), `j <= i + shift + right`
(with a right bound) and `j < len_k`. The helpers are elementwise in rows/cols, so a caller may use either
orientation (the forward's S, the backward's S^T).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)


# ---- sequences and visible ranges -------------------------------------------------------------
@gluon.jit
def sequence(cu_seqlens, b, max_len, VARLEN: gl.constexpr):
    """(first row in the 2-D view, length) of sequence b."""
    if VARLEN:
        start = gl.load(cu_seqlens + b)
        length = gl.load(cu_seqlens + b + 1) - start
    else:
        start = b * max_len
        length = max_len
    return start, length


@gluon.jit
def query_range(n0, len_q, shift, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Query rows [lo, hi) that see keys [n0, n0 + BLOCK_N); lo is a multiple of BLOCK_M."""
    lo = 0
    hi = len_q
    if HAS_RIGHT:
        lo = gl.maximum(n0 - shift - right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = gl.minimum(n0 + BLOCK_N + left - shift, len_q)
    return lo, hi


@gluon.jit
def key_range(m0, len_q, len_k, shift, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Keys [lo, hi) that query rows [m0, min(m0 + BLOCK_M, len_q)) see; lo is a multiple of BLOCK_N."""
    lo = 0
    hi = len_k
    if HAS_LEFT:
        lo = gl.maximum(m0 + shift - left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = gl.minimum(gl.minimum(m0 + BLOCK_M, len_q) + shift + right, len_k)
    return lo, hi


# ---- the mask ---------------------------------------------------------------------------------
@gluon.jit
def tile_needs_mask(m0, n0, len_k, shift, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """False when every (row, key) of rows [m0, m0 + BLOCK_M) x keys [n0, n0 + BLOCK_N) is kept."""
    partial = n0 + BLOCK_N > len_k
    if HAS_LEFT:
        partial = partial | (n0 < m0 + BLOCK_M - 1 + shift - left)
    if HAS_RIGHT:
        partial = partial | (n0 + BLOCK_N - 1 > m0 + shift + right)
    return partial


@gluon.jit
def keep_mask(rows, cols, len_k, shift, left, right, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Whether query `rows` see key `cols` (broadcast elementwise)."""
    keep = cols < len_k
    if HAS_LEFT:
        keep = keep & (cols >= rows + shift - left)
    if HAS_RIGHT:
        keep = keep & (cols <= rows + shift + right)
    return keep


@gluon.jit
def probs_transposed(sT, lse2, scale_log2, offs_m, offs_n, m0, n0, len_k, shift, left, right,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """The backward's P^T = exp2(S^T * scale * log2e - lse * log2e) of keys `offs_n` (rows) x queries `offs_m`
    (columns) from raw scores S^T and lse·log2e per query, 0 where the mask drops the pair (checked only on tiles
    that need it)."""
    pT = gl.exp2(sT * scale_log2 - gl.expand_dims(lse2, 0))
    if tile_needs_mask(m0, n0, len_k, shift, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT):
        keep = keep_mask(gl.expand_dims(offs_m, 0), gl.expand_dims(offs_n, 1), len_k, shift, left, right,
                         HAS_LEFT, HAS_RIGHT)
        pT = gl.where(keep, pT, 0.0)
    return pT


# ---- a matmul against a ring tile -----------------------------------------------------------------
@gluon.jit
def slot(buffers, i):
    """Buffer i of a ring of (rows, cols) tiles, or of (rows, 1, cols) tiles (a descriptor's box of one head),
    as a (rows, cols) tile."""
    tile = buffers.index(i)
    return tile.reshape([tile.shape[0], tile.shape[len(tile.shape) - 1]])


@gluon.jit
def issue_ring_mma(a_smem, ring, ready, zero, step, NUM_STAGES: gl.constexpr):
    """Issue acc = A B^T (async wgmma, both operands in shared memory) against B = the ring tile of `step`,
    once its "ready" barrier says it has landed: the forward's S = Q K^T, the backward's S^T = K Q^T and
    dP^T = V dO^T."""
    stage = step % NUM_STAGES
    mbarrier.wait(ready.index(stage), (step // NUM_STAGES) & 1)
    return warpgroup_mma(a_smem, slot(ring, stage).permute((1, 0)), zero, use_acc=False, is_async=True)


# ---- host side: TMA descriptors over 2-D row views ---------------------------------------------
# Called per tensor per launch, and small calls are host-bound: shapes and strides are read once each.
def rows_view(t, varlen: bool):
    """(rows, heads * head_dim, row stride) of a q/k/v-like tensor seen as one 2-D matrix, or None
    when its rows are not uniform (heads not adjacent, or a batch stride other than s * row stride)."""
    shape, strides = t.shape, t.stride()
    d = shape[-1]
    if strides[-1] != 1 or strides[-2] != d:
        return None
    if varlen:
        return shape[0], shape[1] * d, strides[0]
    b, s = shape[0], shape[1]
    if b > 1 and strides[0] != s * strides[1]:
        return None
    return b * s, shape[2] * d, strides[1]


def _uniform(t, varlen: bool):
    """(uniform_rows(t), its rows_view)."""
    view = rows_view(t, varlen)
    if view is not None and t.data_ptr() % 16 == 0 and (view[2] * t.element_size()) % 16 == 0:
        return t, view
    t = t.clone(memory_format=torch.contiguous_format)
    return t, rows_view(t, varlen)


def uniform_rows(t, varlen: bool):
    """`t` itself when a TMA descriptor can view its rows (uniform rows, 16-byte aligned), else a fresh contiguous
    copy (a copy even of a contiguous tensor whose base is not 16-byte aligned: `contiguous()` would return it)."""
    return _uniform(t, varlen)[0]


@functools.cache
def _box_layout(box: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a box (made once: descriptors are made per call)."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gl_dtype)


def box_cols(head_dim: int) -> int:
    """The head dim of a tile in shared memory: the power of two at or above the tensor's."""
    return 1 << (head_dim - 1).bit_length()


def descriptor(t, varlen: bool, block_rows: int, parts: int = 1):
    """A host TMA descriptor over `t`'s 3-D view (rows, heads, head_dim) with (block_rows, 1, box_cols(head_dim))
    boxes of one head (coordinates [row, head, 0]): columns past head_dim read as zeros and are not written, so a
    head dim that is not a power of two is padded in shared memory only. `parts` > 1: boxes of that fraction of
    the padded columns (coordinates [row, head, first column])."""
    return _descriptor(t, rows_view(t, varlen), block_rows, parts)


def uniform_descriptor(t, varlen: bool, block_rows: int):
    """(uniform_rows(t), the descriptor over it): its rows viewed once."""
    t, view = _uniform(t, varlen)
    return t, _descriptor(t, view, block_rows)


def _descriptor(t, view, block_rows: int, parts: int = 1):
    rows, cols, row_stride = view
    d = t.shape[-1]
    box = (block_rows, 1, box_cols(d) // parts)
    return TensorDescriptor(t, [rows, cols // d, d], [row_stride, d, 1], list(box), _box_layout(box, t.dtype))
