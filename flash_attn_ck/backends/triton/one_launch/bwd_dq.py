"""Backward dQ pass: the query-tile role of the backward launch (bwd_main.attn_bwd_kernel), one
program per (query tile, batch, query head), recomputing P from lse.

No atomics and no dQ accumulator: each program owns its dQ tile and writes it once in the output
dtype, so dQ is deterministic by construction and needs no memory beyond dq itself. Costs two
extra matrix products per tile (Q K^T and dO V^T again) against the atomic mode of bwd_main.py.

Per key tile: s = Q K^T -> scores; p = exp2(s - lse); dp = drop(dO V^T);
ds = p (dp - delta) [* (1 - tanh^2)]; dQ += ds K.

features.USE_TMA / features.TMA_LOADS: the dQ store / the tile loads through TMA descriptors (row_io.py). Arguments
as bwd_main.attn_bwd_kernel's (seq, strides, sizes, score_args, features); dQ is its grads.dq.
"""

import triton
import triton.language as tl

from .row_io import head_rows, load_rows, row_tiles, store_rows
from .scores import (
    LOG2E,
    alibi_shift,
    dropout_keep,
    key_range,
    key_tile_scores,
    query_tile_bounds,
    query_tile_operands,
    value_head_dim,
)


@triton.jit
def query_tile_dq(m_block, b, h, Q, K, V, dOut, Lse, Delta, dQ, seq, strides, sizes, score_args,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, features: tl.constexpr):
    BLOCK_DV: tl.constexpr = features.BLOCK_DV       # dO's (v's) head block
    head_dim_v = value_head_dim(sizes.head_dim, features)
    # ---- the query tile: bounds, q / dO tiles, lse and delta rows ----
    m0, q_start, len_q, k_start, len_k, shift = query_tile_bounds(m_block, b, seq, sizes, BLOCK_M, features)
    if m0 >= len_q:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < len_q
    q, k_src, v_src, slope, seed, offset = query_tile_operands(
        Q, K, V, seq, strides, b, h, sizes, m0, q_start, len_q, k_start, len_k, BLOCK_M, BLOCK_N, BLOCK_D, features)
    b64 = b.to(tl.int64)
    do_base = head_rows(dOut, strides.dout_batch, strides.dout_row, strides.dout_head, b64, q_start, h)
    do = load_rows(row_tiles(do_base, strides.dout_row, len_q, head_dim_v, BLOCK_M, BLOCK_DV, features.TMA_LOADS),
                   strides.dout_row, m0, len_q, head_dim_v, BLOCK_M, BLOCK_DV, features.TMA_LOADS)
    row_base = b64 * strides.lse_batch + h.to(tl.int64) * strides.lse_head + q_start
    lse2 = tl.load(Lse + row_base + offs_m, mask=row_ok, other=float("inf")) * LOG2E
    delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)

    # ---- walk the visible key tiles ----
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = key_range(m0, len_k, shift, score_args, BLOCK_M, BLOCK_N, features)
    bias_shift = alibi_shift(len_q, len_k, shift, features)
    for n0 in range(lo, hi, BLOCK_N):
        cols, k, v, s, tanh = key_tile_scores(q, k_src, v_src, strides.k_row, strides.v_row, offs_m, n0, offs_n, m0,
                                              len_k, sizes.head_dim, shift, bias_shift, score_args, slope, BLOCK_M,
                                              BLOCK_N, BLOCK_D, features)
        if features.DP_FIRST:
            dp = tl.dot(do, tl.trans(v))
        p = tl.exp2(s - lse2[:, None])
        if not features.DP_FIRST:
            dp = tl.dot(do, tl.trans(v))
        if features.HAS_DROPOUT:
            kept = dropout_keep(seed, offset, b * sizes.heads + h, offs_m, n0, score_args.dropout_p, BLOCK_N, False)
            dp = tl.where(kept, dp * (1.0 / (1.0 - score_args.dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if features.HAS_SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)
        dq += tl.dot(ds.to(k.dtype), k)

    # ---- one store in the output dtype (TMA when dense, row-masked for varlen) ----
    dq = dq * score_args.scale       # (before the address: the order the generated code has always had)
    dq_base = head_rows(dQ, strides.dq_batch, strides.dq_row, strides.dq_head, b64, q_start, h)
    store_rows(dq, dq_base, strides.dq_row, m0, len_q, sizes.head_dim, BLOCK_M, BLOCK_D, features.USE_TMA)
