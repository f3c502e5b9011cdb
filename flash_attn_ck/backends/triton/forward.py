"""Forward kernel: one program per (query tile, batch * query head); online softmax over key tiles.

Writes out (input dtype) and lse (fp32, natural log; +inf for a row that sees no key, whose output
is 0). MQA/GQA read K/V of head h // group directly (no expansion). Varlen tensors are packed
`(total, h, d)` with batch stride 0 and per-sequence starts from cu_seqlens.
"""

import triton
import triton.language as tl

from .scores import LOG2E, dropout_keep, key_range, key_tile_scores, query_tile_bounds, query_tile_operands
from .tiles import store_rows


@triton.jit
def attn_fwd_kernel(
        Q, K, V, Out, Lse, cu_seqlens_q, cu_seqlens_k, slopes, rng_state,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
        stride_lse_b, stride_lse_h, stride_slope_b,
        heads, group, max_seqlen_q, max_seqlen_k, head_dim,
        scale, softcap, dropout_p, window_left, window_right,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        VARLEN: tl.constexpr, TOP_LEFT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
        HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        USE_TMA: tl.constexpr, EVEN_K: tl.constexpr):
    # ---- program -> (query tile, sequence, head); the longest causal tiles go first ----
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1) // heads
    h = tl.program_id(1) % heads
    m0, q_start, len_q, k_start, len_k, shift = query_tile_bounds(
        m_block, b, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, BLOCK_M, VARLEN, TOP_LEFT)
    if m0 >= len_q:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < len_q
    q, k_src, v_src, slope, seed, offset = query_tile_operands(
        Q, K, V, slopes, rng_state, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb,
        stride_vs, stride_vh, stride_slope_b, b, h, group, m0, q_start, len_q, k_start, len_k, head_dim,
        BLOCK_M, BLOCK_N, BLOCK_D, HAS_ALIBI, HAS_DROPOUT, USE_TMA)

    # ---- online softmax over the visible key tiles (log2 units) ----
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = key_range(m0, len_k, shift, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for n0 in range(lo, hi, BLOCK_N):
        cols, k, v, s, _ = key_tile_scores(q, k_src, v_src, stride_ks, stride_vs, offs_m, n0, offs_n, m0, len_k,
                                           head_dim, shift, scale, softcap, slope, window_left, window_right,
                                           BLOCK_M, BLOCK_N, BLOCK_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                           USE_TMA, EVEN_K)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            kept = dropout_keep(seed, offset, b * heads + h, offs_m[:, None], cols[None, :], max_seqlen_q, max_seqlen_k,
                                dropout_p)
            p = tl.where(kept, p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # ---- normalise; empty rows give out = 0, lse = +inf ----
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / l_i)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / LOG2E)
    b64 = b.to(tl.int64)
    store_rows(out, Out + b64 * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh, stride_os, m0, len_q,
               head_dim, BLOCK_M, BLOCK_D, USE_TMA)
    lse_base = Lse + b64 * stride_lse_b + h.to(tl.int64) * stride_lse_h + q_start
    tl.store(lse_base + offs_m, lse, mask=row_ok)
