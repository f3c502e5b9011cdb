"""Shared @triton.jit helpers: sequence bounds, the attention mask, score modifiers, dropout.

Every kernel (forward, dQ pass, key-tile pass) builds its scores through these helpers, so the
forward and the backward see exactly the same mask, softcap, ALiBi and dropout pattern.

Conventions (checked by the tests against frontend/mask.py and frontend/dropout.py):
- Scores are kept in log2 units: `s2 = log2(e) * score`, so softmax uses exp2.
- The mask is bottom-right aligned per sequence (`shift = len_k - len_q`; 0 for top-left): row i
  keeps key j iff `j >= i + shift - left` (when a left bound exists) and `j <= i + shift + right`
  (when a right bound exists) and `j < len_k`.
- Helpers are elementwise in `rows`/`cols`, so a caller may use (rows[:, None], cols[None, :]) or
  the transposed orientation (rows[None, :], cols[:, None]).
"""

import triton
import triton.language as tl

from .tiles import load_rows, row_tiles

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def sequence_bounds(cu_seqlens_ptr, b, max_len, VARLEN: tl.constexpr):
    """(first packed row, length) of sequence b; dense tensors start at row 0 with the max length."""
    if VARLEN:
        start = tl.load(cu_seqlens_ptr + b)
        length = tl.load(cu_seqlens_ptr + b + 1) - start
    else:
        start = 0
        length = max_len
    return start, length


@triton.jit
def query_tile_bounds(m_block, b, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, BLOCK_M: tl.constexpr,
                      VARLEN: tl.constexpr, TOP_LEFT: tl.constexpr):
    """Query tile m_block of sequence b: (first row m0, q start, q length, k start, k length, diagonal shift)."""
    q_start, len_q = sequence_bounds(cu_seqlens_q, b, max_seqlen_q, VARLEN)
    k_start, len_k = sequence_bounds(cu_seqlens_k, b, max_seqlen_k, VARLEN)
    shift = 0 if TOP_LEFT else len_k - len_q
    return m_block * BLOCK_M, q_start, len_q, k_start, len_k, shift


@triton.jit
def query_tile_operands(Q, K, V, slopes, rng_state, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                        stride_vb, stride_vs, stride_vh, stride_slope_b, b, h, group, m0, q_start, len_q, k_start,
                        len_k, head_dim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, TMA_LOADS: tl.constexpr):
    """What a query-tile program (forward, dQ pass) reads before its key loop: its q tile, the K and V
    sources of its kv head (tiles.row_tiles, for key_tile_scores), the ALiBi slope, and the dropout
    seed and offset (0 when unused)."""
    b64 = b.to(tl.int64)
    q_base = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
    q = load_rows(row_tiles(q_base, stride_qs, len_q, head_dim, BLOCK_M, BLOCK_D, TMA_LOADS), stride_qs, m0, len_q,
                  head_dim, BLOCK_M, BLOCK_D, TMA_LOADS)
    k_src = row_tiles(K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + (h // group) * stride_kh, stride_ks,
                      len_k, head_dim, BLOCK_N, BLOCK_D, TMA_LOADS)
    v_src = row_tiles(V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + (h // group) * stride_vh, stride_vs,
                      len_k, head_dim, BLOCK_N, BLOCK_D, TMA_LOADS)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(slopes + b * stride_slope_b + h)
    seed = 0
    offset = 0
    if HAS_DROPOUT:
        seed = tl.load(rng_state)
        offset = tl.load(rng_state + 1)
    return q, k_src, v_src, slope, seed, offset


@triton.jit
def key_range(m0, len_k, shift, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks [lo, hi) that rows [m0, m0 + BLOCK_M) can see; lo is a multiple of BLOCK_N."""
    lo = 0
    hi = len_k
    if HAS_LEFT:
        lo = tl.maximum(m0 + shift - left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m0 + BLOCK_M + shift + right, len_k)
    return lo, hi


@triton.jit
def query_range(n0, len_q, shift, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query blocks [lo, hi) that see keys [n0, n0 + BLOCK_N); lo is a multiple of BLOCK_M."""
    lo = 0
    hi = len_q
    if HAS_RIGHT:
        lo = tl.maximum(n0 - shift - right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(n0 + BLOCK_N + left - shift, len_q)
    return lo, hi


@triton.jit
def block_needs_mask(m0, n0, len_k, shift, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EVEN_K: tl.constexpr):
    """False when every (row, key) of the tile is kept, so the per-element mask can be skipped.
    EVEN_K (every key tile full) with no window bound: False at compile time, so the loop carries no
    branch (that branch cost 2-3% of the d128 non-causal backward, docs/triton.md)."""
    if EVEN_K and not HAS_LEFT and not HAS_RIGHT:
        return False
    partial = n0 + BLOCK_N > len_k
    if HAS_LEFT:
        partial = partial | (n0 < m0 + BLOCK_M - 1 + shift - left)
    if HAS_RIGHT:
        partial = partial | (n0 + BLOCK_N - 1 > m0 + shift + right)
    return partial


@triton.jit
def keep_positions(rows, cols, len_k, shift, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    keep = cols < len_k
    if HAS_LEFT:
        keep = keep & (cols >= rows + shift - left)
    if HAS_RIGHT:
        keep = keep & (cols <= rows + shift + right)
    return keep


@triton.jit
def scores_log2(qk, rows, cols, shift, scale, softcap, slope,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw q.k -> (score in log2 units, tanh of the softcap argument or None).

    score = softcap * tanh(scale * qk / softcap) (or scale * qk), minus slope * |i + shift - j|."""
    if HAS_SOFTCAP:
        x = qk * (scale / softcap)
        tanh = 1.0 - 2.0 / (tl.exp2((2.0 * LOG2E) * x) + 1.0)
        s2 = tanh * (softcap * LOG2E)
    else:
        tanh = qk  # unused: a placeholder of the right shape
        s2 = qk * (scale * LOG2E)
    if HAS_ALIBI:
        distance = tl.abs(rows + shift - cols).to(tl.float32)
        s2 = s2 - (slope * LOG2E) * distance
    return s2, tanh


@triton.jit
def key_tile_scores(q, k_src, v_src, stride_ks, stride_vs, offs_m, n0, offs_n, m0, len_k, head_dim, shift,
                    scale, softcap, slope, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, TMA_LOADS: tl.constexpr, EVEN_K: tl.constexpr):
    """One key tile as a query tile sees it: (columns, K, V, scores in log2 units with softcap/ALiBi and
    -inf outside the mask, softcap tanh). k_src/v_src come from tiles.row_tiles; key rows past the
    sequence load as 0."""
    cols = n0 + offs_n
    k = load_rows(k_src, stride_ks, n0, len_k, head_dim, BLOCK_N, BLOCK_D, TMA_LOADS)
    v = load_rows(v_src, stride_vs, n0, len_k, head_dim, BLOCK_N, BLOCK_D, TMA_LOADS)
    s, tanh = scores_log2(tl.dot(q, tl.trans(k)), offs_m[:, None], cols[None, :], shift, scale, softcap, slope,
                          HAS_SOFTCAP, HAS_ALIBI)
    if block_needs_mask(m0, n0, len_k, shift, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                        EVEN_K):
        keep = keep_positions(offs_m[:, None], cols[None, :], len_k, shift, window_left, window_right,
                              HAS_LEFT, HAS_RIGHT)
        s = tl.where(keep, s, float("-inf"))
    return cols, k, v, s, tanh


@triton.jit
def dropout_keep(seed, offset, plane, rows, cols, max_seqlen_q, max_seqlen_k, dropout_p):
    """core/dropout.py: Philox(seed, counter (j, i, low32(offset + plane), high32(offset + plane))), kept
    iff (bits >> 8) * 2**-24 >= p in fp32. `plane` = b * heads + h. max_seqlen_q/k are not used: the
    pattern must not depend on launch bounds (issue 16 item 5); the arguments stay for the callers."""
    zero = rows * 0 + cols * 0
    word = offset.to(tl.int64) + plane.to(tl.int64)
    c0 = (cols + zero).to(tl.uint32)
    c1 = (rows + zero).to(tl.uint32)
    c2 = (zero + (word & 0xFFFFFFFF)).to(tl.uint32)
    c3 = (zero + ((word >> 32) & 0xFFFFFFFF)).to(tl.uint32)
    bits, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    uniform = (bits >> 8).to(tl.float32) * 5.960464477539063e-08  # 2**-24
    return uniform >= dropout_p
