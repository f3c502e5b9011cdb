"""Warp-specialised forward kernel for sm_90, written in Gluon (FA3's design).

One CTA per (query tile of BLOCK_M rows, batch, query head); the first program of each (batch, head) takes its
last query tile, the longest under a causal mask, and with QUERY_MAJOR the grid is (heads, batch, query tiles),
so the last query tiles of every head start before any shorter one (`_cta_coords`). CONSUMERS (2 or 3) consumer
warpgroups of 64 query rows each and a loader warp share the CTA:

  loader      (1 warp)   TMA: the CTA's Q tiles (one per consumer) once, behind one "q_ready" mbarrier; then per
                         visible key tile K and V into a ring of NUM_STAGES buffers, each behind its own
                         "ready" mbarrier (TMA byte count) and "empty" mbarrier (count CONSUMERS: every
                         consumer releases it).
  consumer 0  (default,  query rows [m0, m0 + 64), one warpgroup;
               4 warps)
  consumer i  (4 warps)  query rows [m0 + 64 i, m0 + 64 (i + 1)), one warpgroup each.
                         Per key tile: S = Q K^T (shared-memory operands, async wgmma); online softmax in
                         registers (running max m and sum l; P = exp2(S * scale * log2e - m * scale *
                         log2e), one FFMA per score); O = O * alpha + P V with P as the register A
                         operand of the wgmma. The warpgroups run on their own, so one's softmax
                         overlaps another's matmuls; PINGPONG makes them take turns issuing (one "turn"
                         mbarrier each, passed round in consumer order).
                         OVERLAP: S of key tile j + 1 is issued before P V of tile j and the softmax of
                         j + 1 runs while P V of j is on the tensor cores (FA3's intra-warpgroup
                         overlap); one more S tile lives in registers.
                         Epilogue: O / l in the input dtype (a TMA store through the warpgroup's own Q
                         buffer when its rows lie in the sequence, else a row-masked pointer store) and
                         lse = m * scale + ln(l) in fp32; a row that sees no key gets O = 0, lse = +inf.

Every consumer walks every key tile the CTA sees (the loader loads each once); a tile that no row of a
warpgroup sees gives P = 0 there. Three consumers (FA3's d64 shape, 192 query rows per CTA) have 160 registers
each, room for no OVERLAP. Tensors reach the kernel as host TMA descriptors with boxes of one
head over 3-D (rows, heads, head_dim) views (gluon_common.descriptor), so one descriptor serves dense and
varlen calls: a key tile may read rows of the next sequence (masked to P = 0, as every tile past len_k
is), a Q tile may too (those rows are never written). HEAD_D is the power of two at or above head_dim:
loads read zeros past head_dim, so S and O are exact, and stores write head_dim columns only.

Invariants (on the host: `TritonBackend.fwd_ws_reasons` decides which calls run here,
gluon_common.uniform_rows copies tensors whose rows a descriptor cannot view):
  - head_dim padded to a power of two with tiles in config.FWD_WS_SM90 (64, 128, 256); heads adjacent in
    memory (stride_h = head_dim), rows uniform, 16-byte aligned; out viewed the same way;
  - BLOCK_M = 64 * CONSUMERS (config.FwdWsTile checks it);
  - the softmax scale is positive (the running max is taken on raw scores);
  - no dropout, ALiBi or softcap.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_common import (
    LOG2E,
    box_cols,
    issue_ring_mma,
    keep_mask,
    key_range,
    sequence,
    slot,
    tile_needs_mask,
    uniform_descriptor,
)

CONSUMER_WARPS: gl.constexpr = gl.constexpr(4)   # one warpgroup per consumer partition


# ---- schedule: which query rows and key tiles a CTA covers --------------------------------------
@gluon.jit
def _cta_coords(BLOCK_M: gl.constexpr, QUERY_MAJOR: gl.constexpr):
    """(first query row, batch, query head) of this CTA: the grid is (query tiles, batch, heads), or with QUERY_MAJOR
    (heads, batch, query tiles); the first program along the tile axis takes the last query tile."""
    TILE_AXIS: gl.constexpr = 2 if QUERY_MAJOR else 0
    HEAD_AXIS: gl.constexpr = 0 if QUERY_MAJOR else 2
    m0 = (gl.num_programs(TILE_AXIS) - 1 - gl.program_id(TILE_AXIS)) * BLOCK_M
    return m0, gl.program_id(1), gl.program_id(HEAD_AXIS)


@gluon.jit
def _tile_schedule(cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, window_left, window_right,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, VARLEN: gl.constexpr, TOP_LEFT: gl.constexpr,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, QUERY_MAJOR: gl.constexpr):
    """Everything every partition derives from the program id, computed the same way in each."""
    m0, b, head = _cta_coords(BLOCK_M, QUERY_MAJOR)
    q_row0, len_q = sequence(cu_seqlens_q, b, seqlen_q, VARLEN)
    k_row0, len_k = sequence(cu_seqlens_k, b, seqlen_k, VARLEN)
    shift = 0 if TOP_LEFT else len_k - len_q
    n_lo, n_hi = key_range(m0, len_q, len_k, shift, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    n_tiles = gl.maximum(gl.cdiv(n_hi - n_lo, BLOCK_N), 0)
    return m0, b, head, q_row0, len_q, k_row0, len_k, shift, n_lo, n_tiles


# ---- loader partition ------------------------------------------------------------------------
@gluon.jit
def _loader(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr,
            VARLEN: gl.constexpr, TOP_LEFT: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
            QUERY_MAJOR: gl.constexpr):
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
     cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, group, window_left, window_right) = args
    m0, b, head, q_row0, len_q, k_row0, len_k, shift, n_lo, n_tiles = _tile_schedule(
        cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, window_left, window_right,
        BLOCK_M, BLOCK_N, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT, QUERY_MAJOR)
    CONSUMERS: gl.constexpr = q_smem.shape[0]   # one Q buffer per consumer warpgroup
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    mbarrier.expect(q_ready, CONSUMERS * q_desc.block_type.nbytes)
    for wg in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [q_row0 + m0 + wg * ROWS, head, 0], q_ready, q_smem.index(wg))
    kv_head = head // group
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        row = k_row0 + n_lo + j * BLOCK_N
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_head, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_head, 0], v_ready.index(stage), v_smem.index(stage))


# ---- consumer steps --------------------------------------------------------------------------
@gluon.jit
def _issue_pv(p, v_smem, v_ready, j, acc, p_layout: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Issue O += P V of key tile j (async) once its V has landed; P from registers."""
    stage = j % NUM_STAGES
    mbarrier.wait(v_ready.index(stage), (j // NUM_STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    return warpgroup_mma(p_op, slot(v_smem, stage), acc, is_async=True)


@gluon.jit
def _s_round(q_tile, k_smem, k_ready, k_empty, s_zero, j, turn, rounds, NUM_STAGES: gl.constexpr,
             WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr):
    """A matmul round of S = Q K^T alone (key tile j): issue it in turn, wait for it, release K's slot."""
    rounds = _take_turn(turn, rounds, WARPGROUP, PINGPONG)
    s = issue_ring_mma(q_tile, k_smem, k_ready, s_zero, j, NUM_STAGES)
    _pass_turn(turn, WARPGROUP, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s,))
    _release(k_empty, j, NUM_STAGES)
    return s, rounds


@gluon.jit
def _pv_round(p, v_smem, v_ready, v_empty, j, acc, turn, rounds, p_layout: gl.constexpr, NUM_STAGES: gl.constexpr,
              WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr):
    """A matmul round of P V alone (key tile j): issue it in turn, wait for it, release V's slot."""
    rounds = _take_turn(turn, rounds, WARPGROUP, PINGPONG)
    acc = _issue_pv(p, v_smem, v_ready, j, acc, p_layout, NUM_STAGES)
    _pass_turn(turn, WARPGROUP, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    _release(v_empty, j, NUM_STAGES)
    return acc, rounds


@gluon.jit
def _take_turn(turn, rounds, WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: wait until the previous consumer has issued its matmuls of the round (turn[WARPGROUP] completes
    once per round), so the warpgroups' matmuls reach the tensor cores one round each, in consumer order."""
    if PINGPONG:
        mbarrier.wait(turn.index(WARPGROUP), rounds & 1)
    return rounds + 1


@gluon.jit
def _pass_turn(turn, WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: this consumer's matmuls of the round are issued; the next one's turn (one turn barrier each)."""
    if PINGPONG:
        mbarrier.arrive(turn.index((WARPGROUP + 1) % turn.shape[0]), count=1)


@gluon.jit
def _release(empty, j, NUM_STAGES: gl.constexpr):
    """This warpgroup is done with ring slot j % NUM_STAGES (its wgmma reading it has completed)."""
    mbarrier.arrive(empty.index(j % NUM_STAGES), count=1)


@gluon.jit
def _softmax_step(s, m_i, l_i, n0, offs_m, offs_n, m0, len_k, shift, window_left, window_right, scale_log2,
                  ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """One key tile's online-softmax update of raw scores s: (P, alpha that rescales O, new max, new sum).
    The max is kept on raw scores; exp2 takes s * scale * log2e - m * scale * log2e (one FFMA)."""
    if tile_needs_mask(m0, n0, len_k, shift, window_left, window_right, ROWS, BLOCK_N, HAS_LEFT, HAS_RIGHT):
        # (relative to the tile: columns 0..BLOCK_N - 1 against per-row bounds, no per-column key index)
        keep = keep_mask(gl.expand_dims(offs_m - n0, 1), gl.expand_dims(offs_n, 0), len_k - n0, shift,
                         window_left, window_right, HAS_LEFT, HAS_RIGHT)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_scaled = gl.where(m_new == float("-inf"), 0.0, m_new * scale_log2)   # a row with no key yet: P = 0
    p = gl.exp2(s * scale_log2 - gl.expand_dims(m_scaled, 1))
    alpha = gl.exp2(m_i * scale_log2 - m_scaled)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)


# ---- consumer partitions (default and worker: one warpgroup each) ------------------------------
@gluon.jit
def _consumer(args, WARPGROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              NUM_STAGES: gl.constexpr, VARLEN: gl.constexpr, TOP_LEFT: gl.constexpr, HAS_LEFT: gl.constexpr,
              HAS_RIGHT: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, QUERY_MAJOR: gl.constexpr):
    (q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn, o_desc, Out, Lse, cu_seqlens_q,
     cu_seqlens_k, stride_out_row, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, head_dim, scale, window_left,
     window_right) = args
    m0_cta, b, head, q_row0, len_q, k_row0, len_k, shift, n_lo, n_tiles = _tile_schedule(
        cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, window_left, window_right,
        BLOCK_M, BLOCK_N, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT, QUERY_MAJOR)
    CONSUMERS: gl.constexpr = q_smem.shape[0]
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    m0 = m0_cta + WARPGROUP * ROWS
    dtype: gl.constexpr = q_smem.dtype

    # Layouts: the warpgroup's 4 warps split the rows of S and O; P is the register A operand of P V.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)   # one value per query row
    offs_m = m0 + gl.arange(0, ROWS, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    scale_log2 = scale * LOG2E
    q_tile = slot(q_smem, WARPGROUP)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready, 0)   # also before an empty key range: the epilogue reuses the Q buffer
    rounds = 0   # matmul-issue rounds taken (PINGPONG)
    if PINGPONG and WARPGROUP == CONSUMERS - 1:
        _pass_turn(turn, WARPGROUP, PINGPONG)   # consumer 0 issues first

    # ---- online softmax over the visible key tiles ----
    if OVERLAP:
        # S_{j+1} is issued before P V_j; the softmax of tile j + 1 overlaps P V_j.
        if n_tiles > 0:
            s, rounds = _s_round(q_tile, k_smem, k_ready, k_empty, s_zero, 0, turn, rounds, NUM_STAGES,
                                 WARPGROUP, PINGPONG)
            p, _, m_i, l_i = _softmax_step(s, m_i, l_i, n_lo, offs_m, offs_n, m0, len_k, shift, window_left,
                                           window_right, scale_log2, ROWS, BLOCK_N, HAS_LEFT, HAS_RIGHT)
            for j in range(1, n_tiles):
                rounds = _take_turn(turn, rounds, WARPGROUP, PINGPONG)
                s = issue_ring_mma(q_tile, k_smem, k_ready, s_zero, j, NUM_STAGES)
                acc = _issue_pv(p, v_smem, v_ready, j - 1, acc, p_layout, NUM_STAGES)
                _pass_turn(turn, WARPGROUP, PINGPONG)
                s = warpgroup_mma_wait(1, deps=(s,))
                _release(k_empty, j, NUM_STAGES)
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, n_lo + j * BLOCK_N, offs_m, offs_n, m0, len_k, shift,
                                                   window_left, window_right, scale_log2, ROWS, BLOCK_N,
                                                   HAS_LEFT, HAS_RIGHT)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                _release(v_empty, j - 1, NUM_STAGES)
                acc = _rescale(acc, alpha, o_layout)
            acc, rounds = _pv_round(p, v_smem, v_ready, v_empty, n_tiles - 1, acc, turn, rounds, p_layout, NUM_STAGES,
                                    WARPGROUP, PINGPONG)
    else:
        for j in range(n_tiles):
            s, rounds = _s_round(q_tile, k_smem, k_ready, k_empty, s_zero, j, turn, rounds, NUM_STAGES,
                                 WARPGROUP, PINGPONG)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, n_lo + j * BLOCK_N, offs_m, offs_n, m0, len_k, shift,
                                               window_left, window_right, scale_log2, ROWS, BLOCK_N,
                                               HAS_LEFT, HAS_RIGHT)
            acc = _rescale(acc, alpha, o_layout)
            acc, rounds = _pv_round(p, v_smem, v_ready, v_empty, j, acc, turn, rounds, p_layout, NUM_STAGES,
                                    WARPGROUP, PINGPONG)

    # ---- epilogue: O / l and lse; rows that see no key get O = 0, lse = +inf ----
    empty = l_i == 0.0
    inv_l = gl.where(empty, 0.0, 1.0 / l_i)
    out = _rescale(acc, inv_l, o_layout).to(dtype)
    lse = gl.where(empty, float("inf"), m_i * scale + gl.log2(gl.where(empty, 1.0, l_i)) / LOG2E)
    lse_rows = Lse + b.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h + offs_m
    if VARLEN:
        lse_rows += q_row0
    gl.store(lse_rows, lse, mask=offs_m < len_q)
    if m0 + ROWS <= len_q:
        # this warpgroup's S matmuls, the only readers of its Q, are done: O goes out through its buffer (the
        # TMA store writes the head's head_dim columns, not the padding)
        slot(q_smem, WARPGROUP).store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [q_row0 + m0, head, 0], q_smem.index(WARPGROUP))
        tma.store_wait(0)
    elif m0 < len_q:
        offs_r = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
        rows = (q_row0 + offs_r).to(gl.int64)
        ptrs = Out + gl.expand_dims(rows * stride_out_row, 1) + head * head_dim + gl.expand_dims(offs_d, 0)
        gl.store(ptrs, out, mask=gl.expand_dims(offs_r < len_q, 1) & gl.expand_dims(offs_d < head_dim, 0))


# ---- the kernel ------------------------------------------------------------------------------
@gluon.jit
def attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, Out, Lse, cu_seqlens_q, cu_seqlens_k,
                       stride_out_row, stride_lse_b, stride_lse_h,
                       seqlen_q, seqlen_k, head_dim, group, scale, window_left, window_right,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                       NUM_STAGES: gl.constexpr, VARLEN: gl.constexpr, TOP_LEFT: gl.constexpr,
                       HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, OVERLAP: gl.constexpr,
                       PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                       QUERY_MAJOR: gl.constexpr, CONSUMERS: gl.constexpr):
    """Grid: (query tiles, batch, query heads), or (query heads, batch, query tiles) with QUERY_MAJOR; num_warps =
    CONSUMER_WARPS (consumer 0). See the module docstring."""
    if VARLEN:
        m0, b, _ = _cta_coords(BLOCK_M, QUERY_MAJOR)
        if m0 >= gl.load(cu_seqlens_q + b + 1) - gl.load(cu_seqlens_q + b):
            return
    dtype: gl.constexpr = q_desc.dtype
    # (rows, 1, HEAD_D) boxes of one head each (gluon_common.descriptor); `slot` views them 2-D
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M // CONSUMERS, 1, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 1, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 1, HEAD_D], v_desc.layout)

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], bar_layout)   # PINGPONG: consumer i may issue
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)   # one arrival per consumer warpgroup
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    # Runtime arguments travel as tuples; constexprs one by one (Gluon passes constexprs given through a tuple as
    # tensors, and a partition's (function, arguments) pair only as written in the list).
    consumer = (q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn, o_desc, Out, Lse,
                cu_seqlens_q, cu_seqlens_k, stride_out_row, stride_lse_b, stride_lse_h, seqlen_q, seqlen_k, head_dim,
                scale, window_left, window_right)
    loader = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
              cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, group, window_left, window_right)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (consumer, 0, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT,
                         OVERLAP, PINGPONG, QUERY_MAJOR)),
            (_consumer, (consumer, 1, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT,
                         OVERLAP, PINGPONG, QUERY_MAJOR)),
            (_consumer, (consumer, 2, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT,
                         OVERLAP, PINGPONG, QUERY_MAJOR)),
            (_loader, (loader, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT,
                       QUERY_MAJOR)),
        ], [CONSUMER_WARPS, CONSUMER_WARPS, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (consumer, 0, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT,
                         OVERLAP, PINGPONG, QUERY_MAJOR)),
            (_consumer, (consumer, 1, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT,
                         OVERLAP, PINGPONG, QUERY_MAJOR)),
            (_loader, (loader, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT,
                       QUERY_MAJOR)),
        ], [CONSUMER_WARPS, 1], [CONSUMER_REGS, LOADER_REGS])


# ---- host side -------------------------------------------------------------------------------
def launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, varlen: bool, batch: int, seqlen_q: int,
           seqlen_k: int, scale: float, top_left: bool, window_left: int, window_right: int, has_left: bool,
           has_right: bool, tile):
    """One launch of attn_fwd_ws_kernel: out (layout of q) and lse ((b, h, s_q) or varlen (h, total_q))."""
    d = q.shape[-1]
    group = q.shape[-2] // k.shape[-2]
    rows_per_consumer = tile.block_m // tile.consumers
    q_desc, k_desc, v_desc = (uniform_descriptor(t, varlen, rows)[1]
                              for t, rows in ((q, rows_per_consumer), (k, tile.block_n), (v, tile.block_n)))
    target, out_desc = uniform_descriptor(out, varlen, rows_per_consumer)
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    cu_q = cu_seqlens_q if varlen else lse
    cu_k = cu_seqlens_k if varlen else lse
    box = box_cols(d)   # shared-memory head dim: columns past d read as zeros, never written
    query_tiles = triton.cdiv(seqlen_q, tile.block_m)
    grid = (q.shape[-2], batch, query_tiles) if tile.longest_first else (query_tiles, batch, q.shape[-2])
    attn_fwd_ws_kernel[grid](
        q_desc, k_desc, v_desc, out_desc, target, lse, cu_q, cu_k, out_desc.strides[0],   # target's row stride
        *lse_strides, seqlen_q, seqlen_k, d, group, scale, window_left, window_right,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, HEAD_D=box, NUM_STAGES=tile.num_stages, VARLEN=varlen,
        TOP_LEFT=top_left, HAS_LEFT=has_left, HAS_RIGHT=has_right, OVERLAP=tile.overlap, PINGPONG=tile.pingpong,
        CONSUMER_REGS=tile.consumer_regs, LOADER_REGS=tile.loader_regs, QUERY_MAJOR=tile.longest_first,
        CONSUMERS=tile.consumers, num_warps=CONSUMER_WARPS.value)
    if target is not out:
        out.copy_(target)
