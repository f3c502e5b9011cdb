"""Shared @triton.jit helpers: sequence bounds, the attention mask, score modifiers, dropout.

Every kernel (forward, dQ pass, key-tile pass) builds its scores through these helpers, so the
forward and the backward see exactly the same mask, softcap, ALiBi and dropout pattern.

Conventions (checked by the tests against core/mask.py and core/dropout.py):
- Scores are kept in log2 units: `s2 = log2(e) * score`, so softmax uses exp2.
- The mask is bottom-right aligned per sequence (`shift = len_k - len_q`; 0 for top-left): row i
  keeps key j iff `j >= i + shift - left` (when a left bound exists) and `j <= i + shift + right`
  (when a right bound exists) and `j < len_k`.
- Helpers are elementwise in `rows`/`cols`, so a caller may use (rows[:, None], cols[None, :]) or
  the transposed orientation (rows[None, :], cols[:, None]).
- `features` is the call's launch.Features (constexpr), `score_args` its launch.ScoreArgs, `sizes` its
  launch.Sizes,
  `seq` its launch.SequenceArgs, `strides` its launch.ForwardStrides or BackwardStrides: a helper
  reads the flags and values it needs, so a new flag changes no signature.
"""

import triton
import triton.language as tl

from ..runtime.softmax_terms import LOG2E, alibi_distance
from .row_io import head_rows, load_rows, row_tiles


@triton.jit
def accurate_tanh(x):
    """tanh in fp32 to a few ulp relative everywhere, from the operations the interpreter runs too. 1 - 2 / (e^2x + 1)
    cancels as x -> 0 (x = 1e-8 gives 0), and a large softcap multiplies that error back: below |x| = 1/4 the Taylor
    series to x^7 (truncation < 4e-7 relative) takes over."""
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.25, series, 1.0 - 2.0 / (tl.exp2((2.0 * LOG2E) * x) + 1.0))


# ---- sequences and query-tile programs ----

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
def diagonal_shift(len_q, len_k, features: tl.constexpr):
    """Row i's diagonal key is i + shift: the sequence's bottom-right corner, or 0 with features.TOP_LEFT."""
    return 0 if features.TOP_LEFT else len_k - len_q


@triton.jit
def alibi_shift(len_q, len_k, shift, features: tl.constexpr):
    """Row i's ALiBi distance is |i + alibi_shift - j|: from the bottom-right diagonal whatever the mask's
    alignment (docs/semantics.md), so a top-left mask changes which keys are kept, not their bias."""
    return len_k - len_q if features.TOP_LEFT else shift


@triton.jit
def query_tile_bounds(m_block, b, seq, sizes, BLOCK_M: tl.constexpr, features: tl.constexpr):
    """Query tile m_block of sequence b: (first row m0, q start, q length, k start, k length, diagonal shift)."""
    q_start, len_q = sequence_bounds(seq.cu_seqlens_q, b, sizes.max_seqlen_q, features.VARLEN)
    k_start, len_k = sequence_bounds(seq.cu_seqlens_k, b, sizes.max_seqlen_k, features.VARLEN)
    return m_block * BLOCK_M, q_start, len_q, k_start, len_k, diagonal_shift(len_q, len_k, features)


@triton.jit
def query_tile_operands(Q, K, V, seq, strides, b, h, sizes, m0, q_start, len_q, k_start, len_k, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, features: tl.constexpr):
    """What a query-tile program (forward, dQ pass) reads before its key loop: its q tile, the K and V
    sources of its kv head (row_io.row_tiles, for key_tile_scores; V's rows have v's head dim, `value_head_dim`),
    the ALiBi slope, and the dropout seed and offset (0 when unused). Tiles load through TMA with
    features.TMA_LOADS. `strides`: the call's launch.ForwardStrides or BackwardStrides (the q, k, v strides and
    slope_batch of either)."""
    BLOCK_DV: tl.constexpr = features.BLOCK_DV
    b64 = b.to(tl.int64)
    q_base = head_rows(Q, strides.q_batch, strides.q_row, strides.q_head, b64, q_start, h)
    q = load_rows(row_tiles(q_base, strides.q_row, len_q, sizes.head_dim, BLOCK_M, BLOCK_D, features.TMA_LOADS),
                  strides.q_row, m0, len_q, sizes.head_dim, BLOCK_M, BLOCK_D, features.TMA_LOADS)
    # (the kv head's offset written out, not through head_rows: the same operation order as before keeps
    # the generated code identical)
    k_src = row_tiles(K + b64 * strides.k_batch + k_start.to(tl.int64) * strides.k_row
                      + (h // sizes.group).to(tl.int64) * strides.k_head,
                      strides.k_row, len_k, sizes.head_dim, BLOCK_N, BLOCK_D, features.TMA_LOADS)
    v_src = row_tiles(V + b64 * strides.v_batch + k_start.to(tl.int64) * strides.v_row
                      + (h // sizes.group).to(tl.int64) * strides.v_head,
                      strides.v_row, len_k, value_head_dim(sizes.head_dim, features), BLOCK_N, BLOCK_DV,
                      features.TMA_LOADS)
    slope = alibi_slope(seq, strides, b, h, features)
    seed, offset = dropout_seed(seq, features)
    return q, k_src, v_src, slope, seed, offset


@triton.jit
def value_head_dim(head_dim, features: tl.constexpr):
    """v's head dim (out's, dO's, dV's): features.HEAD_DIM_V where v has one of its own, else q/k's `head_dim`. Its
    block is features.BLOCK_DV (BLOCK_D with one head dim)."""
    if features.HEAD_DIM_V:
        # a value of the kernel's, not a bare int: Triton 3.7 on returns no Python int from a jit function
        return head_dim * 0 + features.HEAD_DIM_V
    else:
        return head_dim


# ---- the mask: visible tile ranges, which tiles need it, the per-element test ----

@triton.jit
def key_range(m0, len_k, shift, score_args, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, features: tl.constexpr):
    """Key blocks [lo, hi) that rows [m0, m0 + BLOCK_M) can see; lo is a multiple of BLOCK_N."""
    lo = 0
    hi = len_k
    if features.HAS_LEFT:
        lo = tl.maximum(m0 + shift - score_args.window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if features.HAS_RIGHT:
        hi = tl.minimum(m0 + BLOCK_M + shift + score_args.window_right, len_k)
    return lo, hi


@triton.jit
def query_range(n0, len_q, shift, score_args, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, features: tl.constexpr):
    """Query blocks [lo, hi) that see keys [n0, n0 + BLOCK_N); lo is a multiple of BLOCK_M."""
    lo = 0
    hi = len_q
    if features.HAS_RIGHT:
        lo = tl.maximum(n0 - shift - score_args.window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if features.HAS_LEFT:
        hi = tl.minimum(n0 + BLOCK_N + score_args.window_left - shift, len_q)
    return lo, hi


@triton.jit
def block_needs_mask(m0, n0, len_k, shift, score_args, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     features: tl.constexpr):
    """False when every (row, key) of the tile is kept, so the per-element mask can be skipped.
    EVEN_K (every key tile full) with no window bound: False at compile time, so the loop carries no
    branch (a branch the d128 non-causal backward measurably pays for: bench/nvidia-h200.md)."""
    if features.EVEN_K and not features.HAS_LEFT and not features.HAS_RIGHT:
        return False
    partial = n0 + BLOCK_N > len_k
    if features.HAS_LEFT:
        partial = partial | (n0 < m0 + BLOCK_M - 1 + shift - score_args.window_left)
    if features.HAS_RIGHT:
        partial = partial | (n0 + BLOCK_N - 1 > m0 + shift + score_args.window_right)
    return partial


@triton.jit
def keep_positions(rows, cols, len_k, shift, score_args, features: tl.constexpr):
    keep = cols < len_k
    if features.HAS_LEFT:
        keep = keep & (cols >= rows + shift - score_args.window_left)
    if features.HAS_RIGHT:
        keep = keep & (cols <= rows + shift + score_args.window_right)
    return keep


# ---- score modifiers (softcap, ALiBi) and one key tile's scores ----

@triton.jit
def scores_log2(qk, rows, cols, bias_shift, score_args, slope, features: tl.constexpr):
    """Raw q.k -> (score in log2 units, tanh of the softcap argument or None).

    score = softcap * tanh(scale * qk / softcap) (or scale * qk), minus slope * |i + bias_shift - j|
    (bias_shift: `alibi_shift`)."""
    if features.HAS_SOFTCAP:
        x = qk * (score_args.scale / score_args.softcap)
        tanh = accurate_tanh(x)
        s2 = (tanh * score_args.softcap) * LOG2E     # in this order: softcap * LOG2E overflows fp32 for caps > 2.4e38
    else:
        tanh = qk  # unused: a placeholder of the right shape
        s2 = qk * (score_args.scale * LOG2E)
    if features.HAS_ALIBI:
        distance = alibi_distance(rows, cols, bias_shift)
        s2 = s2 - (slope * LOG2E) * distance
    return s2, tanh


@triton.jit
def alibi_slope(seq, strides, b, h, features: tl.constexpr):
    """Query head h's ALiBi slope in sequence b (0 without ALiBi); `strides.slope_batch` is 0 for (h,) slopes."""
    slope = 0.0
    if features.HAS_ALIBI:
        slope = tl.load(seq.slopes + b * strides.slope_batch + h)
    return slope


@triton.jit
def key_tile_scores(q, k_src, v_src, stride_ks, stride_vs, offs_m, n0, offs_n, m0, len_k, head_dim, shift, bias_shift,
                    score_args, slope, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    features: tl.constexpr):
    """One key tile as a query tile sees it: (columns, K, V, scores in log2 units with softcap/ALiBi and
    -inf outside the mask, softcap tanh). k_src/v_src come from row_io.row_tiles; key rows past the
    sequence load as 0. V has v's head dim (`value_head_dim`)."""
    BLOCK_DV: tl.constexpr = features.BLOCK_DV
    cols = n0 + offs_n
    k = load_rows(k_src, stride_ks, n0, len_k, head_dim, BLOCK_N, BLOCK_D, features.TMA_LOADS)
    v = load_rows(v_src, stride_vs, n0, len_k, value_head_dim(head_dim, features), BLOCK_N, BLOCK_DV,
                  features.TMA_LOADS)
    s, tanh = scores_log2(tl.dot(q, tl.trans(k)), offs_m[:, None], cols[None, :], bias_shift, score_args, slope,
                          features)
    if block_needs_mask(m0, n0, len_k, shift, score_args, BLOCK_M, BLOCK_N, features):
        keep = keep_positions(offs_m[:, None], cols[None, :], len_k, shift, score_args, features)
        s = tl.where(keep, s, float("-inf"))
    return cols, k, v, s, tanh


# ---- dropout ----

@triton.jit
def dropout_seed(seq, features: tl.constexpr):
    """The call's (seed, offset) from rng_state (0, 0 without dropout)."""
    seed = 0
    offset = 0
    if features.HAS_DROPOUT:
        seed = tl.load(seq.rng_state)
        offset = tl.load(seq.rng_state + 1)
    return seed, offset


@triton.jit
def dropout_keep(seed, offset, plane, rows, n0, dropout_p, BLOCK_N: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """core/dropout.py: the keep mask of rows `rows` (1-D) and keys [n0, n0 + BLOCK_N), n0 a multiple of 4;
    (rows, keys), or (keys, rows) with KEYS_FIRST. Key j takes word j % 4 of Philox(seed, counter (j // 4,
    i, low32(offset + plane), high32(offset + plane))), kept iff (bits >> 8) * 2**-24 >= p in fp32; one draw
    serves four keys. `plane` = b * heads + h. Only the element's own coordinates enter the counter, so the
    pattern does not depend on launch bounds (max_seqlen)."""
    groups = n0 // 4 + tl.arange(0, BLOCK_N // 4)
    word = offset.to(tl.int64) + plane.to(tl.int64)
    if KEYS_FIRST:
        zero = groups[:, None] * 0 + rows[None, :] * 0
        c0 = (groups[:, None] + zero).to(tl.uint32)
        c1 = (rows[None, :] + zero).to(tl.uint32)
    else:
        zero = rows[:, None] * 0 + groups[None, :] * 0
        c0 = (groups[None, :] + zero).to(tl.uint32)
        c1 = (rows[:, None] + zero).to(tl.uint32)
    c2 = (zero + (word & 0xFFFFFFFF)).to(tl.uint32)
    c3 = (zero + ((word >> 32) & 0xFFFFFFFF)).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
    # (..., group, 2, 2) with [k, l] = word 2k + l: key 4 * group + 2k + l once flattened
    words = tl.join(tl.join(w0, w2), tl.join(w1, w3))
    if KEYS_FIRST:
        bits = tl.reshape(tl.permute(words, (0, 2, 3, 1)), (BLOCK_N, rows.shape[0]))
    else:
        bits = tl.reshape(words, (rows.shape[0], BLOCK_N))
    uniform = (bits >> 8).to(tl.float32) * 5.960464477539063e-08  # 2**-24
    return uniform >= dropout_p
