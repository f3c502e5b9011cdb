"""Backward dQ pass: the query-tile role of the backward launch (bwd_main.attn_bwd_kernel), one
program per (query tile, batch, query head), recomputing P from lse.

No atomics and no dQ accumulator: each program owns its dQ tile and writes it once in the output
dtype, so dQ is deterministic by construction and needs no memory beyond dq itself. Costs two
extra matrix products per tile (Q K^T and dO V^T again) against the atomic mode of bwd_main.py.

Per key tile: s = Q K^T -> scores; p = exp2(s - lse); dp = drop(dO V^T);
ds = p (dp - D) [* (1 - tanh^2)]; dQ += ds K.

USE_TMA / TMA_LOADS: the dQ store / the tile loads through TMA descriptors (tiles.py).
"""

import triton
import triton.language as tl

from .scores import LOG2E, dropout_keep, key_range, key_tile_scores, query_tile_bounds, query_tile_operands
from .tiles import load_rows, row_tiles, store_rows


@triton.jit
def query_tile_dq(
        m_block, b, h, Q, K, V, dOut, Lse, Delta, dQ, cu_seqlens_q, cu_seqlens_k, slopes, rng_state,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
        stride_dqb, stride_dqs, stride_dqh, stride_lse_b, stride_lse_h, stride_slope_b,
        heads, group, max_seqlen_q, max_seqlen_k, head_dim,
        scale, softcap, dropout_p, window_left, window_right,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        VARLEN: tl.constexpr, TOP_LEFT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
        HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        USE_TMA: tl.constexpr, TMA_LOADS: tl.constexpr, DP_FIRST: tl.constexpr, EVEN_K: tl.constexpr):
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
        BLOCK_M, BLOCK_N, BLOCK_D, HAS_ALIBI, HAS_DROPOUT, TMA_LOADS)
    b64 = b.to(tl.int64)
    do_base = dOut + b64 * stride_dob + q_start.to(tl.int64) * stride_dos + h * stride_doh
    do = load_rows(row_tiles(do_base, stride_dos, len_q, head_dim, BLOCK_M, BLOCK_D, TMA_LOADS), stride_dos, m0, len_q,
                   head_dim, BLOCK_M, BLOCK_D, TMA_LOADS)
    row_base = b64 * stride_lse_b + h.to(tl.int64) * stride_lse_h + q_start
    lse2 = tl.load(Lse + row_base + offs_m, mask=row_ok, other=float("inf")) * LOG2E
    delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)

    # ---- walk the visible key tiles ----
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = key_range(m0, len_k, shift, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for n0 in range(lo, hi, BLOCK_N):
        cols, k, v, s, tanh = key_tile_scores(q, k_src, v_src, stride_ks, stride_vs, offs_m, n0, offs_n, m0, len_k,
                                              head_dim, shift, scale, softcap, slope, window_left, window_right,
                                              BLOCK_M, BLOCK_N, BLOCK_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                              HAS_ALIBI, TMA_LOADS, EVEN_K)
        if DP_FIRST:
            dp = tl.dot(do, tl.trans(v))
        p = tl.exp2(s - lse2[:, None])
        if not DP_FIRST:
            dp = tl.dot(do, tl.trans(v))
        if HAS_DROPOUT:
            kept = dropout_keep(seed, offset, b * heads + h, offs_m[:, None], cols[None, :], max_seqlen_q, max_seqlen_k,
                                dropout_p)
            dp = tl.where(kept, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)
        dq += tl.dot(ds.to(k.dtype), k)

    # ---- one store in the output dtype (TMA when dense, row-masked for varlen) ----
    store_rows(dq * scale, dQ + b64 * stride_dqb + q_start.to(tl.int64) * stride_dqs + h * stride_dqh,
               stride_dqs, m0, len_q, head_dim, BLOCK_M, BLOCK_D, USE_TMA)
