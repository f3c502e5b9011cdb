"""Backward main kernel: one launch, two program roles (FlexAttention's layout), so the dQ pass
fills the SMs the key-tile programs leave idle and costs no launch of its own.

Grid: (key tiles [+ query tiles * query heads per slot], batch * program heads). In each slot
(batch, program head) the first `cdiv(max_seqlen_k, BLOCK_N)` programs are key-tile programs
(`key_tile_dkdv` below); in the dQ-pass mode (not DQ_ATOMIC) the rest are query-tile programs
(`bwd_dq.query_tile_dq`) of the slot's query heads, the longest causal tiles first. Both roles
share num_warps and num_stages (config.Configs checks it).

Key-tile programs recompute P from lse; dK/dV stay on chip. Two head modes (`LOOP_GROUP`):
- LOOP_GROUP: the program owns kv head hk and loops over the `group` query heads that read it,
  so dK/dV are complete on chip and leave through `row_io.store_rows` in the output dtype (MHA is the
  case group == 1). Deterministic by construction, no fp32 accumulators.
- otherwise (the GQA accumulator epilogue): the program owns one query head and adds its dK/dV
  into fp32 `(b, h_k, s_k, d)` accumulators (`accumulate_kv`), ordered by semaphores when
  DETERMINISTIC; bwd_postprocess casts them.
With DQ_ATOMIC there are no query-tile programs: the key-tile programs add dQ into an fp32 buffer
laid out like q (not deterministic; cast by bwd_postprocess). `grads.dq` is that buffer in this mode
and the output otherwise.

Per (key tile, query tile), transposed so that keys are rows:
  sT = K Q^T -> scores; pT = exp2(sT - lse); dV += drop(pT) dO; dpT = drop(V dO^T);
  dsT = pT (dpT - delta) [* (1 - tanh^2) with softcap]; dK += dsT Q; (dQ += dsT^T K).

USE_TMA: tile stores and adds (the epilogue, atomic dQ) through TMA descriptors; TMA_LOADS: tile
loads too (config.Configs.bwd_tma; row_io.py says what changes). DP_FIRST: dpT (dp in the dQ pass) is
issued right after the scores' product, before the exp2 (config.Configs.bwd_dp_first). EVEN_K: every
key tile of both roles is full (dense, s_k a multiple of BLOCK_N and DQ_BLOCK_N), so without a window
bound no tile needs the mask (scores.block_needs_mask); config.Configs.bwd_even_k turns it off per row.

Arguments (launch.bwd_main builds them): the inputs, grads (launch.Gradients), kv_acc
(launch.KVAccumulators), seq (launch.SequenceArgs), strides (launch.BackwardStrides), batch, sizes
(launch.Sizes), score_args (launch.ScoreArgs) and every compile-time flag above in features (launch.Features,
constexpr; HEAD_DIM_V / BLOCK_DV: v's, dO's and dV's head dim and block), handed whole to the roles and to the
helpers of scores.py.
"""

import triton
import triton.language as tl

from .bwd_dq import query_tile_dq
from .bwd_epilogue import accumulate_kv
from .row_io import add_rows, head_rows, load_rows, row_tiles, store_rows
from .scores import (
    LOG2E,
    alibi_shift,
    alibi_slope,
    block_needs_mask,
    diagonal_shift,
    dropout_keep,
    dropout_seed,
    keep_positions,
    query_range,
    scores_log2,
    sequence_bounds,
    value_head_dim,
)


@triton.jit
def attn_bwd_kernel(
        Q, K, V, dOut, Lse, Delta, grads, kv_acc, seq, strides, batch, sizes, score_args,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, features: tl.constexpr):
    # ---- program -> role, sequence and program head ----
    prog_tile = tl.program_id(0)
    if features.LOOP_GROUP:
        prog_heads = sizes.heads // sizes.group
    else:
        prog_heads = sizes.heads
    b = tl.program_id(1) // prog_heads
    prog_head = tl.program_id(1) % prog_heads
    key_tiles = tl.cdiv(sizes.max_seqlen_k, BLOCK_N)
    if prog_tile < key_tiles:
        key_tile_dkdv(prog_tile, b, prog_head, Q, K, V, dOut, Lse, Delta, grads, kv_acc, seq, strides, batch, sizes,
                      score_args, BLOCK_M, BLOCK_N, BLOCK_D, features)
    elif not features.DQ_ATOMIC:
        # ---- dQ pass: query tile of one of the slot's query heads, counted from the last tile ----
        query_tiles = tl.cdiv(sizes.max_seqlen_q, DQ_BLOCK_M)
        prog_tile -= key_tiles
        if features.LOOP_GROUP:
            h = prog_head * sizes.group + prog_tile // query_tiles
        else:
            h = prog_head
        query_tile_dq(query_tiles - 1 - prog_tile % query_tiles, b, h, Q, K, V, dOut, Lse, Delta, grads.dq, seq,
                      strides, sizes, score_args, DQ_BLOCK_M, DQ_BLOCK_N, BLOCK_D, features)


@triton.jit
def key_tile_dkdv(n_block, b, prog_head, Q, K, V, dOut, Lse, Delta, grads, kv_acc, seq, strides, batch, sizes,
                  score_args, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  features: tl.constexpr):
    """One key tile of kv head hk (LOOP_GROUP: prog_head = hk) or query head prog_head (the accumulator epilogue, into
    kv_acc; `batch` places its semaphore; only with one head dim: the accumulators have one row width). V, dO and dV
    have v's head dim (scores.value_head_dim) in BLOCK_DV columns."""
    BLOCK_DV: tl.constexpr = features.BLOCK_DV
    # ---- program -> kv head, its query heads, the key tile ----
    if features.LOOP_GROUP:
        hk = prog_head
        h_first = prog_head * sizes.group
        n_heads = sizes.group
    else:
        hk = prog_head // sizes.group
        h_first = prog_head
        n_heads = 1
    head_dim = sizes.head_dim
    head_dim_v = value_head_dim(head_dim, features)
    q_start, len_q = sequence_bounds(seq.cu_seqlens_q, b, sizes.max_seqlen_q, features.VARLEN)
    k_start, len_k = sequence_bounds(seq.cu_seqlens_k, b, sizes.max_seqlen_k, features.VARLEN)
    n0 = n_block * BLOCK_N
    if n0 >= len_k:
        return
    shift = diagonal_shift(len_q, len_k, features)
    bias_shift = alibi_shift(len_q, len_k, shift, features)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    b64 = b.to(tl.int64)
    k_base = head_rows(K, strides.k_batch, strides.k_row, strides.k_head, b64, k_start, hk)
    v_base = head_rows(V, strides.v_batch, strides.v_row, strides.v_head, b64, k_start, hk)
    k = load_rows(row_tiles(k_base, strides.k_row, len_k, head_dim, BLOCK_N, BLOCK_D, features.TMA_LOADS),
                  strides.k_row, n0, len_k, head_dim, BLOCK_N, BLOCK_D, features.TMA_LOADS)
    v = load_rows(row_tiles(v_base, strides.v_row, len_k, head_dim_v, BLOCK_N, BLOCK_DV, features.TMA_LOADS),
                  strides.v_row, n0, len_k, head_dim_v, BLOCK_N, BLOCK_DV, features.TMA_LOADS)
    seed, offset = dropout_seed(seq, features)
    m_lo, m_hi = query_range(n0, len_q, shift, score_args, BLOCK_M, BLOCK_N, features)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in tl.range(0, n_heads, num_stages=1):
        # ---- one query head: its q / dO sources, lse and D rows, ALiBi slope ----
        h = h_first + g
        q_base = head_rows(Q, strides.q_batch, strides.q_row, strides.q_head, b64, q_start, h)
        q_src = row_tiles(q_base, strides.q_row, len_q, head_dim, BLOCK_M, BLOCK_D, features.TMA_LOADS)
        do_base = head_rows(dOut, strides.dout_batch, strides.dout_row, strides.dout_head, b64, q_start, h)
        do_src = row_tiles(do_base, strides.dout_row, len_q, head_dim_v, BLOCK_M, BLOCK_DV, features.TMA_LOADS)
        row_base = b64 * strides.lse_batch + h.to(tl.int64) * strides.lse_head + q_start
        slope = alibi_slope(seq, strides, b, h, features)
        for m0 in range(m_lo, m_hi, BLOCK_M):
            # ---- recompute P^T for this query tile ----
            offs_m = m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < len_q
            q = load_rows(q_src, strides.q_row, m0, len_q, head_dim, BLOCK_M, BLOCK_D, features.TMA_LOADS)
            do = load_rows(do_src, strides.dout_row, m0, len_q, head_dim_v, BLOCK_M, BLOCK_DV, features.TMA_LOADS)
            lse2 = tl.load(Lse + row_base + offs_m, mask=row_ok, other=float("inf")) * LOG2E
            delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
            qkT = tl.dot(k, tl.trans(q))
            if features.DP_FIRST:
                dpT = tl.dot(v, tl.trans(do))
            sT, tanh = scores_log2(qkT, offs_m[None, :], offs_n[:, None], bias_shift, score_args, slope, features)
            if block_needs_mask(m0, n0, len_k, shift, score_args, BLOCK_M, BLOCK_N, features):
                keep = keep_positions(offs_m[None, :], offs_n[:, None], len_k, shift, score_args, features)
                sT = tl.where(keep, sT, float("-inf"))
            pT = tl.exp2(sT - lse2[None, :])
            if not features.DP_FIRST:
                dpT = tl.dot(v, tl.trans(do))
            # ---- dV and dS^T (dropout scales the kept entries by 1 / (1 - p)) ----
            if features.HAS_DROPOUT:
                kept = dropout_keep(seed, offset, b * sizes.heads + h, offs_m, n0, score_args.dropout_p, BLOCK_N, True)
                inv_keep = 1.0 / (1.0 - score_args.dropout_p)
                dv += tl.dot(tl.where(kept, pT * inv_keep, 0.0).to(do.dtype), do)
                dpT = tl.where(kept, dpT * inv_keep, 0.0)
            else:
                dv += tl.dot(pT.to(do.dtype), do)
            dsT = pT * (dpT - delta[None, :])
            if features.HAS_SOFTCAP:
                dsT = dsT * (1.0 - tanh * tanh)
            dk += tl.dot(dsT.to(q.dtype), q)
            if features.DQ_ATOMIC:
                # ---- atomic dQ: this tile's share into the fp32 buffer ----
                dq_part = tl.dot(tl.trans(dsT.to(k.dtype)), k) * score_args.scale
                dq_base = head_rows(grads.dq, strides.dq_batch, strides.dq_row, strides.dq_head, b64, q_start, h)
                add_rows(dq_part, dq_base, strides.dq_row, m0, len_q, head_dim, BLOCK_M, BLOCK_D, features.USE_TMA)

    if features.LOOP_GROUP:
        # ---- dK/dV complete on chip: store in the output dtype ----
        dk = dk * score_args.scale       # (before the address: the order the generated code has always had)
        dk_base = head_rows(grads.dk, strides.dk_batch, strides.dk_row, strides.dk_head, b64, k_start, hk)
        store_rows(dk, dk_base, strides.dk_row, n0, len_k, head_dim, BLOCK_N, BLOCK_D, features.USE_TMA)
        dv_base = head_rows(grads.dv, strides.dv_batch, strides.dv_row, strides.dv_head, b64, k_start, hk)
        store_rows(dv, dv_base, strides.dv_row, n0, len_k, head_dim_v, BLOCK_N, BLOCK_DV, features.USE_TMA)
    else:
        # ---- GQA accumulator epilogue: this query head's share, in rank order if deterministic ----
        lock = kv_acc.semaphores + (n_block * batch + b) * (sizes.heads // sizes.group) + hk
        acc_off = b64 * strides.kv_acc_batch + hk.to(tl.int64) * strides.kv_acc_head + k_start.to(tl.int64) * head_dim
        accumulate_kv(dk * score_args.scale, dv, kv_acc.dk + acc_off, kv_acc.dv + acc_off, head_dim, n0, len_k,
                      head_dim, lock, h_first % sizes.group, BLOCK_N, BLOCK_D, features.USE_TMA, features.DETERMINISTIC)
