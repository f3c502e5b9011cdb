"""Warp-specialised backward main kernel for head dims above 128 (192, 256: 256 in shared memory), sm_90, Gluon.

bwd_ws.py gives each of its 8 MMA warps 16 key rows of dK and dV; at d256 a warp's share of a 128-row key tile
is 2 x 16 x 256 fp32, more registers than a thread has. Here the two MMA warpgroups split the head dim
instead: each keeps dK and dV of one half of the columns for a 64-row key tile (128 registers a thread).
S^T and dP^T need every column, so they are not split but shared out: warpgroup 0 computes S^T and P^T,
warpgroup 1 dP^T and dS^T, and they exchange P^T and dS^T through shared memory, from where both read them
as the A operand of their halves of the three gradient matmuls.

  loader   (1 warp)       bwd_ws_workers.loader: K, V once; per step Q, dO, lse·log2e and delta (one stage: at d256
                          two stages of Q and dO do not fit beside K, V and the dQ buffers)
  scores   (default,      S^T = K Q^T, P^T = exp2(S^T * scale * log2e - lse * log2e), masked (with a softcap the
            4 warps)      scores are cap * tanh(scale * S^T / cap), gluon_common.hardware_tanh; with ALiBi the
                          head's slope times the distance is subtracted, in log2 units)
                          -> P^T to shared memory, and with a softcap the scores' slope 1 - tanh^2 ("p_ready");
                          with dropout (dropout.py's keep mask of the tile) the shared P^T is dV's operand, its
                          dropped entries zero and its kept ones scaled by 1 / (1 - p), and the whole P^T goes
                          beside it for dS^T
  dP       (4 warps)      dP^T = V dO^T; dS^T = P^T (dP^T - delta) (times the slope; with dropout dS^T = P^T_kept
                          dP^T - P^T delta, which is P^T (kept dP^T / (1 - p) - delta)) -> shared memory ("ds_ready")
  both, on their half h of the columns:
                          dV_h += P^T dO_h, dK_h += dS^T Q_h, dQ_h = dS K_h
                          then P^T/dS^T ("ps_free") and the Q/dO slot ("tile_empty") are released and dQ_h
                          (scaled) goes to its dQ buffer
  dQ writer (1 warp)      bwd_ws_workers.dq_writer with two parts a step: one reduce-add per half

Invariants: HEAD_D = 256 with 64 x 64 tiles (config.BWD_WS_SM90[256]); everything else as bwd_ws.py (boxes of one
head, rows past a sequence masked by lse = +inf and the key mask, dK/dV stored by masked pointers, the
deterministic mode's ordered adds).
"""


from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..runtime.softmax_terms import alibi_distance
from ..runtime.triton_versions import barrier
from . import bwd_ws_workers as workers
from .dropout import pattern_of
from .gluon_common import LOG2E, aggregate, hardware_tanh, probs_transposed, slot

MMA_WARPS: gl.constexpr = gl.constexpr(4)   # one warpgroup per half


@aggregate
class Exchange:
    """What the two MMA warpgroups exchange per step: P^T and dS^T in shared memory, "p_ready" and "ds_ready" (one
    arrival each, by the warpgroup that wrote it) and "ps_free" (both warpgroups' matmuls have read them)."""
    pt: gl.shared_memory_descriptor
    dst: gl.shared_memory_descriptor
    p_ready: gl.shared_memory_descriptor
    ds_ready: gl.shared_memory_descriptor
    ps_free: gl.shared_memory_descriptor


# ---- one MMA warpgroup: its role in S^T / dP^T, then its half of the columns ----------------------
@gluon.jit
def _mma_warpgroup(consts, bufs, xchg, seqs, mask, grads, sizes, terms, HALF: gl.constexpr):
    """`grads`: (dK, dV, their strides, v's head dim or None: q/k's); `sizes`: the kernel's; `terms`: (softcap: the
    cap or None, the shared tile of the capped scores' slope or None, alibi: (fp32 slopes, their batch stride) or None,
    dropout: ((rng_state, p, query heads, first head), the shared tile of the whole P^T) or None). dV is split into
    halves of v's head block as dK is of q/k's."""
    softcap, slope_tile, alibi, dropout = terms
    n0, b, kv_head, q_row0, len_q, k_row0, len_k, shift, m_lo, m_tiles = workers.tile_schedule(consts, seqs, mask)
    group, scale = sizes.group, sizes.scale
    BLOCK_M: gl.constexpr = consts.BLOCK_M
    BLOCK_N: gl.constexpr = consts.BLOCK_N
    HEAD_D: gl.constexpr = consts.HEAD_D
    NUM_STAGES: gl.constexpr = consts.NUM_STAGES
    dtype: gl.constexpr = bufs.k.dtype
    HALF_D: gl.constexpr = HEAD_D // 2
    HALF_DV: gl.constexpr = consts.HEAD_DV // 2
    # this warpgroup's q/k columns: half the head block, or with a q/k tail block the first block's or the tail's
    COLS: gl.constexpr = part_columns(consts, HALF)
    COL0: gl.constexpr = HALF * (HEAD_D if consts.QK_TAIL else HALF_D)
    k_tile, v_tile = bufs.kv()
    if consts.QK_TAIL:
        if HALF == 0:
            k_half = k_tile
        else:
            k_half = workers.slot_of(bufs.k_tail)
    else:
        k_half = k_tile.slice(HALF * HALF_D, HALF_D, dim=1)

    # Layouts: the warpgroup's 4 warps own 16 rows each of S^T/dP^T, of dK_h/dV_h and of dQ_h.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                          instr_shape=[16, COLS, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                        instr_shape=[16, HALF_DV, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)   # one value per query (column of S^T)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)   # one value per key (row of S^T)

    offs_n = n0 + gl.arange(0, BLOCK_N, layout=row_layout)
    offs_m_tile = gl.arange(0, BLOCK_M, layout=col_layout)
    scale_log2 = scale * LOG2E
    dk = gl.zeros([BLOCK_N, COLS], gl.float32, half_layout)
    dv = gl.zeros([BLOCK_N, HALF_DV], gl.float32, dv_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, COLS], gl.float32, half_layout)

    mbarrier.wait(bufs.kv_ready, 0)
    for step in range(m_tiles * group):
        stage = step % NUM_STAGES
        ring_phase = (step // NUM_STAGES) & 1
        phase = step & 1
        m0 = m_lo + (step % m_tiles) * BLOCK_M
        if HALF == 0:
            # ---- P^T = exp2(S^T * scale * log2e - lse * log2e), masked, to shared memory ----
            sT = bufs.q.issue_mma(k_tile, s_zero, step)
            if consts.QK_TAIL:  # plus the tail block's columns (their TMA loads land on the same barriers)
                sT = warpgroup_mma(workers.slot_of(bufs.k_tail), slot(bufs.q_tail.bufs, stage).permute((1, 0)), sT,
                                   is_async=True)
            lse2 = bufs.lse.index(stage).load(col_layout)   # lse * log2 e (q_ready covers it)
            if alibi is not None:
                slope_log2 = workers.step_slope(alibi, b, kv_head, group, step, m_tiles)
            sT = warpgroup_mma_wait(0, deps=(sT,))
            s_scale = scale_log2
            if softcap is not None:     # the forward's scores, cap * tanh(scale * s / cap), in log2 units
                tanh = hardware_tanh(sT * (scale / softcap))
                sT = (tanh * softcap) * LOG2E
                s_scale = 1.0
            if alibi is not None:   # minus the slope times the distance from the bottom-right diagonal
                sT = sT * s_scale - slope_log2 * alibi_distance(gl.expand_dims(m0 + offs_m_tile, 0),
                                                                gl.expand_dims(offs_n, 1), len_k - len_q)
                s_scale = 1.0
            pT = probs_transposed(mask, sT, lse2, s_scale, m0 + offs_m_tile, offs_n, m0, n0, len_k, shift,
                                  BLOCK_M, BLOCK_N)
            mbarrier.wait(xchg.ps_free, phase ^ 1)   # the previous step's matmuls have read P^T and dS^T
            if dropout is not None:     # dV's operand: the kept entries, scaled; dS^T's: all of P^T
                call, whole_pt = dropout
                drop = pattern_of(call, b, kv_head * group + step // m_tiles)
                whole_pt.store(pT.to(dtype))
                pT = gl.where(drop.keep(m0 + offs_m_tile, n0, BLOCK_N, s_layout, True), pT * (1.0 / (1.0 - drop.p)),
                              0.0)
            xchg.pt.store(pT.to(dtype))
            if softcap is not None:     # dS^T's factor, rounded as P^T is (scale goes to dQ and dK at their ends)
                slope_tile.store((1.0 - tanh * tanh).to(dtype))
            fence_async_shared()
            barrier()
            mbarrier.arrive(xchg.p_ready, count=1)
            mbarrier.wait(bufs.do.ready.index(stage), ring_phase)   # dV_h reads dO
            mbarrier.wait(xchg.ds_ready, phase)
        else:
            # ---- dS^T = P^T (dP^T - delta), to shared memory ----
            dpT = bufs.do.issue_mma(v_tile, s_zero, step)
            mbarrier.wait(bufs.q.ready.index(stage), ring_phase)   # delta, and Q for dK_h
            delta = bufs.delta.index(stage).load(col_layout)
            dpT = warpgroup_mma_wait(0, deps=(dpT,))
            mbarrier.wait(xchg.p_ready, phase)   # after scores' wait on ps_free: dS^T's buffer is free too
            pT = xchg.pt.load(s_layout).to(gl.float32)
            if dropout is not None:     # P^T_kept dP^T - P^T delta
                dsT = pT * dpT - dropout[1].load(s_layout).to(gl.float32) * gl.expand_dims(delta, 0)
            else:
                dsT = pT * (dpT - gl.expand_dims(delta, 0))
            if softcap is not None:     # the slope of the capped scores, written with P^T
                dsT = dsT * slope_tile.load(s_layout).to(gl.float32)
            xchg.dst.store(dsT.to(dtype))
            fence_async_shared()
            barrier()
            mbarrier.arrive(xchg.ds_ready, count=1)

        # ---- this half: dV_h += P^T dO_h, dK_h += dS^T Q_h, dQ_h = dS K_h (A operands in shared memory) ----
        dv = warpgroup_mma(xchg.pt, slot(bufs.do.bufs, stage).slice(HALF * HALF_DV, HALF_DV, dim=1), dv,
                           is_async=True)
        if consts.QK_TAIL:
            if HALF == 0:
                q_half = slot(bufs.q.bufs, stage)
            else:
                q_half = slot(bufs.q_tail.bufs, stage)
        else:
            q_half = slot(bufs.q.bufs, stage).slice(HALF * HALF_D, HALF_D, dim=1)
        dk = warpgroup_mma(xchg.dst, q_half, dk, is_async=True)
        dq = warpgroup_mma(xchg.dst.permute((1, 0)), k_half, dq_zero, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        mbarrier.arrive(xchg.ps_free, count=1)
        bufs.q.release(step)

        # ---- hand dQ_h (scaled) to the writer ----
        workers.hand_dq(consts, bufs, dq, scale, step, HALF)

    # ---- epilogue: dK_h (scaled) and dV_h in the output dtype ----
    workers.store_dkv(dk, dv, grads, n0, b, kv_head, k_row0, len_k, sizes, scale, COL0, HALF * HALF_DV, seqs.VARLEN)


@gluon.constexpr_function
def part_columns(consts, HALF):
    """The q/k columns (of dK, dQ) warpgroup HALF owns: half the head block, or with a q/k tail block (QK_TAIL) the
    first block's (HEAD_D) or the tail's."""
    if consts.QK_TAIL:
        return gl.constexpr(consts.HEAD_D if HALF == 0 else consts.QK_TAIL)
    return gl.constexpr(consts.HEAD_D // 2)


# ---- the kernel ------------------------------------------------------------------------------
@gluon.jit
def attn_bwd_ws_split_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, stats, grads, semaphores,
                             cu_seqlens, schedule, strides, sizes, window, softcap, alibi, dropout, head_dim_v,
                             tail_descs, TILE: gl.constexpr, CALL: gl.constexpr):
    """Grid: attn_bwd_ws_kernel's; num_warps = MMA_WARPS (the scores warpgroup). See the module
    docstring; the arguments are attn_bwd_ws_kernel's, dq_desc with boxes of half the head dim (dropout and a softcap
    not both: their tiles would exceed the shared memory)."""
    gl.static_assert(dropout is None or softcap is None, "bwd_ws_split takes dropout or a softcap, not both")
    consts, seqs, mask = workers.prologue(TILE, CALL, 2, cu_seqlens, schedule, sizes, window, v_desc)   # dQ in halves
    Lse, Delta = stats
    dK, dV = grads
    stride_lse, grad_strides = strides
    Sem, sem_m_tiles = semaphores
    if workers.past_sequence(consts, seqs):
        return
    dtype: gl.constexpr = q_desc.dtype
    bufs = workers.allocate(consts, q_desc, k_desc, v_desc, do_desc, dq_desc, tail_descs, 2)   # released by both
    st_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([consts.BLOCK_N, consts.BLOCK_M], dtype)
    pt_smem = gl.allocate_shared_memory(dtype, [consts.BLOCK_N, consts.BLOCK_M], st_layout)
    dst_smem = gl.allocate_shared_memory(dtype, [consts.BLOCK_N, consts.BLOCK_M], st_layout)
    if softcap is not None:     # the capped scores' slope, from the scores warpgroup to the dP one beside P^T
        slope_smem = gl.allocate_shared_memory(dtype, [consts.BLOCK_N, consts.BLOCK_M], st_layout)
    else:
        # a constexpr None: a plain one cannot go into the partitions' tuples
        slope_smem: gl.constexpr = softcap  # type: ignore[no-redef]
    if dropout is not None:     # the whole P^T, for dS^T beside the dropped one dV reads
        drop_terms = (dropout, gl.allocate_shared_memory(dtype, [consts.BLOCK_N, consts.BLOCK_M], st_layout))
    else:
        drop_terms: gl.constexpr = dropout  # type: ignore[no-redef]
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    p_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ps_free = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(ds_ready, count=1)
    mbarrier.init(ps_free, count=2)   # both warpgroups' matmuls have read P^T and dS^T
    xchg = Exchange(pt_smem, dst_smem, p_ready, ds_ready, ps_free)  # type: ignore[call-arg]

    group = sizes.group
    grads = (dK, dV, grad_strides, head_dim_v)
    # One literal list (no comprehension): the code generator then wraps a launch's constant 1 (sem_m_tiles, an lse
    # stride) as a constexpr, which crosses into a worker partition; a comprehension's plain int does not.
    gl.warp_specialize([
        (_mma_warpgroup, (consts, bufs, xchg, seqs, mask, grads, sizes, (softcap, slope_smem, alibi, drop_terms), 0)),
        (_mma_warpgroup, (consts, bufs, xchg, seqs, mask, grads, sizes, (softcap, slope_smem, alibi, drop_terms), 1)),
        (workers.loader, (consts, bufs, seqs, mask, (q_desc, k_desc, v_desc, do_desc, tail_descs),
                          (Lse, Delta, stride_lse),
                          group)),
        (workers.dq_writer, (consts, bufs, seqs, mask, (dq_desc, tail_descs), Sem, group, sem_m_tiles)),
    ], [MMA_WARPS, 1, 1], [TILE.mma_regs, TILE.loader_regs, TILE.writer_regs])
