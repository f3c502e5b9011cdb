"""Forward kernel: one program per (query tile, batch * query head); online softmax over key tiles.

Writes out (input dtype) and lse (fp32, natural log; +inf for a row that sees no key, whose output
is 0). MQA/GQA read K/V of head h // group directly (no expansion). Varlen tensors are packed
`(total, h, d)` with batch stride 0 and per-sequence starts from cu_seqlens.

Arguments (launch.forward builds them): the tensors, seq (launch.SequenceArgs), strides
(launch.ForwardStrides), sizes (launch.Sizes), score_args (launch.ScoreArgs) and the constexpr flags
features (launch.Features; the forward reads USE_TMA for its store and TMA_LOADS, set alike, for its loads, and
HEAD_DIM_V / BLOCK_DV for v's and out's head dim and block, scores.value_head_dim).
"""

import triton
import triton.language as tl

from ..runtime.softmax_terms import take_sink
from .row_io import head_rows, store_rows
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
def attn_fwd_kernel(Q, K, V, Out, Lse, seq, strides, sizes, score_args, Sink,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, features: tl.constexpr):
    BLOCK_DV: tl.constexpr = features.BLOCK_DV       # v's and out's head block (BLOCK_D with one head dim)
    # ---- program -> (query tile, sequence, head); the longest causal tiles go first ----
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1) // sizes.heads
    h = tl.program_id(1) % sizes.heads
    m0, q_start, len_q, k_start, len_k, shift = query_tile_bounds(m_block, b, seq, sizes, BLOCK_M, features)
    if m0 >= len_q:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < len_q
    q, k_src, v_src, slope, seed, offset = query_tile_operands(
        Q, K, V, seq, strides, b, h, sizes, m0, q_start, len_q, k_start, len_k, BLOCK_M, BLOCK_N, BLOCK_D, features)

    # ---- online softmax over the visible key tiles (log2 units) ----
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, hi = key_range(m0, len_k, shift, score_args, BLOCK_M, BLOCK_N, features)
    bias_shift = alibi_shift(len_q, len_k, shift, features)
    for n0 in range(lo, hi, BLOCK_N):
        cols, k, v, s, _ = key_tile_scores(q, k_src, v_src, strides.k_row, strides.v_row, offs_m, n0, offs_n, m0,
                                           len_k, sizes.head_dim, shift, bias_shift, score_args, slope, BLOCK_M,
                                           BLOCK_N, BLOCK_D, features)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if features.HAS_DROPOUT:
            kept = dropout_keep(seed, offset, b * sizes.heads + h, offs_m, n0, score_args.dropout_p, BLOCK_N, False)
            p = tl.where(kept, p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # ---- the sink: one more logit of the row's softmax, with no value ----
    alpha = 1.0
    if Sink is not None:
        m_i, l_i, alpha = take_sink(m_i, l_i, tl.load(Sink + h) * LOG2E)

    # ---- normalise; empty rows (no key, and no sink or a sink of -inf) give out = 0, lse = +inf ----
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, alpha / l_i)
    if features.HAS_DROPOUT:
        inv_l = inv_l / (1.0 - score_args.dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / LOG2E)
    b64 = b.to(tl.int64)
    out_base = head_rows(Out, strides.out_batch, strides.out_row, strides.out_head, b64, q_start, h)
    store_rows(out, out_base, strides.out_row, m0, len_q, value_head_dim(sizes.head_dim, features), BLOCK_M, BLOCK_DV,
               features.USE_TMA)
    lse_base = Lse + b64 * strides.lse_batch + h.to(tl.int64) * strides.lse_head + q_start
    tl.store(lse_base + offs_m, lse, mask=row_ok)
