"""Warp-specialised backward main kernel for sm_90, written in Gluon (FA3's design).

One CTA per (key tile, batch, kv head). dK and dV stay in registers for the whole walk over the
query tiles of every query head of the kv head's group, so GQA needs no fp32 dK/dV and no
reduction. Three partitions share the CTA (the loader and the dQ writer are bwd_ws_workers.py's, shared with
bwd_ws_split.py, the kernel for head dims above 128):

  loader   (1 warp)   TMA: K, V once; then per step the Q and dO tiles into a ring of NUM_STAGES
                      buffers, each behind its own "ready" mbarrier (TMA byte count), and the tile's
                      lse (times log2 e) and delta rows into shared memory beside Q (q_ready's second
                      arrival); one "tile_empty" mbarrier per slot, released by the MMA partition.
  MMA      (default,  per step, 5 matmuls and no recomputation:
            8 warps)    S^T = K Q^T, dP^T = V dO^T                 (shared-memory operands)
                        P^T = exp2(S^T * scale * log2e - lse * log2e), masked
                        dS^T = P^T * (dP^T - delta)
                        (with a softcap the scores are cap * tanh(scale * S^T / cap) and dS^T takes their slope,
                        1 - tanh^2: gluon_common.hardware_tanh, fwd_ws's tanh; with ALiBi the head's
                        slope times the distance is subtracted, softmax_terms.alibi_distance, which dS^T does not see;
                        with dropout, dropout.py's keep mask of the tile zeroes P^T's and dP^T's dropped entries
                        and scales the kept ones by 1 / (1 - p) before dV and dS^T)
                        dV += P^T dO, dK += dS^T Q                  (P^T, dS^T from registers)
                        dQ = dS K                                   (dS staged in shared memory)
                      dQ (scaled) goes to a shared-memory buffer for the writer while dK is still
                      on the tensor cores; the slot is released once dK (the last reader of Q) is done.
  dQ writer (1 warp)  a TMA reduce-add (cp.reduce.async.bulk.tensor .add.f32) of each step's dQ
                      tile into the fp32 dq_accum, then frees the buffer.

Each warp of the 8-warp MMA partition owns 16 key rows of S^T/dP^T/dK/dV (two warpgroups, as
FA3's AtomLayoutNdKV = 2), so the S^T accumulator's registers are the A operand of the dV/dK
matmuls without a trip through shared memory.

Tensors reach the kernel as host TMA descriptors with boxes of one head over 3-D (rows, heads,
head_dim) views, so a tile may read rows of the next sequence: those query rows get lse = +inf
(P = 0), those key rows are masked to P = 0 on the last key tile, and dK/dV are stored by masked
pointers. A dQ tile that spills into the next sequence adds exact zeros there. HEAD_D is the power
of two at or above head_dim: loads read zeros past head_dim, the dQ reduce-add and the dK/dV stores
write head_dim columns only. A v narrower than q/k (MLA's 192 / 128) has its own: V, dO and dV tiles of
HEAD_DV columns (v's box), dP^T and dV matmuls that wide, dV stored to v's head dim (`head_dim_v`).

Invariants (on the host: `TritonBackend.ws_reasons` decides which calls run here, gluon_common.uniform_rows
copies tensors whose rows a descriptor cannot view):
  - head_dim padded to a power of two with a tile in config.BWD_WS_SM90 (split_d tiles: bwd_ws_split.py);
    heads adjacent in memory (stride_h = head_dim), rows uniform, 16-byte aligned.
Deterministic mode: the writer adds a query tile's dQ only when the semaphore of that (batch, head,
query tile) counts the key tiles before its own, so the fp32 sums happen in one order on every run.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .. import config
from ..runtime.launch import GluonCall, GluonMask, GluonSizes, LaunchSpec
from ..runtime.softmax_terms import alibi_distance
from ..runtime.triton_versions import barrier
from . import bwd_ws_workers as workers
from .bwd_ws_shapes import semaphore_tiles
from .bwd_ws_split import attn_bwd_ws_split_kernel
from .dropout import pattern_of
from .gluon_common import LOG2E, descriptor, hardware_tanh, probs_transposed, slot


# ---- MMA partition (default) -----------------------------------------------------------------
@gluon.jit
def _mma(consts, bufs, ds_smem, seqs, mask, grads, sizes, terms):
    """`grads`: (dK, dV, their strides, v's head dim or None: q/k's); `sizes`: the kernel's; `terms`: (the scores'
    cap or None, ALiBi's (fp32 slopes, their batch stride) or None, dropout's (rng_state, p, query heads, first head)
    or None)."""
    softcap, alibi, dropout = terms
    n0, b, kv_head, q_row0, len_q, k_row0, len_k, shift, m_lo, m_tiles = workers.tile_schedule(consts, seqs, mask)
    group, scale = sizes.group, sizes.scale
    BLOCK_M: gl.constexpr = consts.BLOCK_M
    BLOCK_N: gl.constexpr = consts.BLOCK_N
    HEAD_D: gl.constexpr = consts.HEAD_D
    HEAD_DV: gl.constexpr = consts.HEAD_DV
    num_warps: gl.constexpr = consts.NUM_WARPS
    dtype: gl.constexpr = bufs.k.dtype
    k_tile, v_tile = bufs.kv()

    # Layouts: every warp owns 16 key rows of the (BLOCK_N, *) tiles; dQ splits its columns.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_DV, 16])
    dq_warps_m: gl.constexpr = BLOCK_M // 16 if num_warps > BLOCK_M // 16 else num_warps
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[dq_warps_m, num_warps // dq_warps_m],
        instr_shape=[16, HEAD_D // (num_warps // dq_warps_m), 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)   # P^T for dV
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)   # one value per query (column of S^T)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)   # one value per key (row of S^T)

    offs_n = n0 + gl.arange(0, BLOCK_N, layout=row_layout)
    offs_m_tile = gl.arange(0, BLOCK_M, layout=col_layout)
    scale_log2 = scale * LOG2E

    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DV], gl.float32, dv_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_D], gl.float32, dq_layout)

    # delta (per query, beside lse in the ring) is read after the exp2 where the mask has bounds: its registers are then
    # not live across the exp2, which spares the masked kernels most of their spills. Without bounds the read beside
    # lse is the faster one even with its few spilled bytes (docs/triton.md; bench/nvidia-h200.md).
    DELTA_AFTER_EXP2: gl.constexpr = mask.HAS_LEFT or mask.HAS_RIGHT

    steps = m_tiles * group
    mbarrier.wait(bufs.kv_ready, 0)
    for step in range(steps):
        sT = bufs.q.issue_mma(k_tile, s_zero, step)
        dpT = bufs.do.issue_mma(v_tile, s_zero, step)
        stage = step % consts.NUM_STAGES
        m0 = m_lo + (step % m_tiles) * BLOCK_M
        q_tile = slot(bufs.q.bufs, stage)
        do_tile = slot(bufs.do.bufs, stage)
        lse2 = bufs.lse.index(stage).load(col_layout)   # lse * log2 e (q_ready covers it, and delta)
        if not DELTA_AFTER_EXP2:
            delta = bufs.delta.index(stage).load(col_layout)
        offs_m = m0 + offs_m_tile
        if alibi is not None:
            slope_log2 = workers.step_slope(alibi, b, kv_head, group, step, m_tiles)

        # ---- P^T = exp2(S^T * scale * log2e - lse * log2e), masked ----
        sT = warpgroup_mma_wait(1, deps=(sT,))
        s_scale = scale_log2    # what takes S^T to log2 units: 1 once the terms below have
        if softcap is not None:     # the forward's scores, cap * tanh(scale * s / cap), in log2 units
            tanh = hardware_tanh(sT * (scale / softcap))
            sT = (tanh * softcap) * LOG2E
            s_scale = 1.0
        if alibi is not None:       # minus the slope times the distance from the bottom-right diagonal (from fp32
            # coordinates, exact below 2^24: ptxas then spills less of this partition than with int ones)
            sT = sT * s_scale - slope_log2 * alibi_distance(gl.expand_dims(offs_m.to(gl.float32), 0),
                                                            gl.expand_dims(offs_n.to(gl.float32), 1),
                                                            (len_k - len_q).to(gl.float32))
            s_scale = 1.0
        pT = probs_transposed(mask, sT, lse2, s_scale, offs_m, offs_n, m0, n0, len_k, shift, BLOCK_M, BLOCK_N)

        # ---- dS^T = P^T (dP^T - delta); dV += P^T dO (with dropout: the kept entries of both, scaled) ----
        if DELTA_AFTER_EXP2:
            delta = bufs.delta.index(stage).load(col_layout)
        dpT = warpgroup_mma_wait(0, deps=(dpT,))
        if dropout is not None:
            drop = pattern_of(dropout, b, kv_head * group + step // m_tiles)
            kept = drop.keep(offs_m, n0, BLOCK_N, s_layout, True)
            inv_keep = 1.0 / (1.0 - drop.p)
            dpT = gl.where(kept, dpT * inv_keep, 0.0)
            dsT = pT * (dpT - gl.expand_dims(delta, 0))
            pT = gl.where(kept, pT * inv_keep, 0.0)
        else:
            dsT = pT * (dpT - gl.expand_dims(delta, 0))
        if softcap is not None:     # the slope of the capped scores (scale is applied to dQ and dK at their ends)
            dsT = dsT * (1.0 - tanh * tanh)
        p_op = gl.convert_layout(pT.to(dtype), p_layout)
        dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)

        # ---- dQ = dS K (dS through shared memory); dK += dS^T Q (registers) ----
        ds_bf = dsT.to(dtype)
        ds_smem.store(ds_bf)
        fence_async_shared()
        barrier()
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_tile, dq_zero, use_acc=False, is_async=True)
        ds_op = gl.convert_layout(ds_bf, a_layout)
        dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))   # dK stays on the tensor cores during the hand-off

        # ---- hand dQ (scaled) to the writer ----
        workers.hand_dq(consts, bufs, dq, scale, step, 0)
        dk = warpgroup_mma_wait(0, deps=(dk, ds_op))[0]
        workers.release_slot(consts, bufs, step)   # dK and dV, the last readers of Q and dO, are done

    # ---- epilogue: dK (scaled) and dV in the output dtype ----
    workers.store_dkv(dk, dv, grads, n0, b, kv_head, k_row0, len_k, sizes, scale, 0, 0, seqs.VARLEN)


# ---- the kernel ------------------------------------------------------------------------------
@gluon.jit
def attn_bwd_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, stats, grads, semaphores, cu_seqlens, schedule,
                       strides, sizes, window, softcap, alibi, dropout, head_dim_v, tail_descs,
                       TILE: gl.constexpr, CALL: gl.constexpr):
    """Grid: (key tiles, batch, kv heads), or (kv heads, batch, key tiles) with KEY_MAJOR, or with a `schedule` (varlen:
    int32 (rows, 2) [sequence, key tile], else a constexpr None) (kv heads, rows) (workers.cta_coords); num_warps =
    TILE.num_warps. `stats`: (Lse, Delta); `grads`: (dK, dV); `semaphores`: the deterministic mode's (int32 semaphores,
    their query tiles per head; a stand-in pointer otherwise); `cu_seqlens`: (q, k); `strides`: lse's (batch, head)
    and (dK's, dV's) (batch, row, head); `sizes`: launch.GluonSizes; `window`: (left, right); `softcap`:
    the scores' cap, or None; `alibi`: (fp32 (query heads,) or (batch, query heads) slopes, their batch stride, 0 for
    (query heads,)), or None (None: a constant, the kernel compiles without the term); `dropout`: (int64 [seed, offset]
    rng_state, p, the call's query heads, the launch's first query head) of core/dropout.py's pattern, or None;
    `head_dim_v`: v's head dim where it is not q/k's (v, dO and dV then of their own width, V and dO tiles of their own
    head block), else None; `tail_descs`: bwd_ws_split's (q tail, k tail, dq_accum tail) descriptors where q/k load
    as a first block and a tail block (CALL.QK_TAIL), else None; TILE: config.WsTile; CALL: launch.MaskFlags. See the
    module docstring."""
    consts, seqs, mask = workers.prologue(TILE, CALL, 1, cu_seqlens, schedule, sizes, window, v_desc)
    Lse, Delta = stats
    dK, dV = grads
    stride_lse, grad_strides = strides
    Sem, sem_m_tiles = semaphores
    if workers.past_sequence(consts, seqs):
        return
    dtype: gl.constexpr = q_desc.dtype
    bufs = workers.allocate(consts, q_desc, k_desc, v_desc, do_desc, dq_desc, tail_descs, 1)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([consts.BLOCK_N, consts.BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [consts.BLOCK_N, consts.BLOCK_M], ds_layout)

    group = sizes.group
    gl.warp_specialize([
        (_mma, (consts, bufs, ds_smem, seqs, mask, (dK, dV, grad_strides, head_dim_v), sizes,
               (softcap, alibi, dropout))),
        (workers.loader, (consts, bufs, seqs, mask, (q_desc, k_desc, v_desc, do_desc, tail_descs),
                          (Lse, Delta, stride_lse),
                          group)),
        (workers.dq_writer, (consts, bufs, seqs, mask, (dq_desc, tail_descs), Sem, group, sem_m_tiles)),
    ], [1, 1], [TILE.loader_regs, TILE.writer_regs])


# ---- host side -------------------------------------------------------------------------------
def launch_spec(q, k, v, dout, lse, delta, dq_accum, dk, dv, cu_seqlens_q, cu_seqlens_k, *, varlen: bool, batch: int,
                seqlen_q: int, seqlen_k: int, scale: float, mask: GluonMask, tile, semaphores=None,
                schedule=None, softcap: float = 0.0, alibi=None, dropout=None, qk_tail: int = 0) -> LaunchSpec:
    """The launch of attn_bwd_ws_kernel (of bwd_ws_split's kernel for a `split_d` tile). dq_accum (rows_q, heads_q,
    d) fp32 must be zero; dq_accum receives dQ already scaled. lse/delta: (b, h, s_q) or varlen (h, total_q).
    `semaphores`: zeroed int32 (batch, heads_q, semaphore_tiles(seqlen_q, tile)) for the deterministic mode, else
    None. `schedule` (varlen only): the call's (sequence, key tile) items (varlen_schedule.build_schedule of a walk
    that owns key tiles of tile.block_n rows), run on a grid (kv heads, items); None: the grid over every (batch, key
    tile). In the deterministic mode a schedule must list each sequence's key tiles that share a query tile in
    ascending order (TritonBackend._schedule_walk keeps the grid where it would not). `softcap`: the scores' cap (0:
    none); `alibi`: (fp32 slopes (heads,) or (batch, heads) of the launch's query heads, their
    batch stride) or None; `dropout`: (the call's int64 [seed, offset] rng_state, p, its query heads, the launch's first
    query head) or None (bwd_ws's kernel only); `qk_tail` (a `split_d` tile only): the columns of q/k's tail block
    (config.bwd_ws_qk_tail; q, k and dq_accum then as a first block and a tail block), 0: none."""
    d = q.shape[-1]
    heads_k = k.shape[-2]
    group = q.shape[-2] // heads_k
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    dk_strides = (0, dk.stride(0), dk.stride(1)) if varlen else (dk.stride(0), dk.stride(1), dk.stride(2))
    dv_strides = (0, dv.stride(0), dv.stride(1)) if varlen else (dv.stride(0), dv.stride(1), dv.stride(2))
    key_tiles = triton.cdiv(seqlen_k, tile.block_n)
    grid: tuple[int, ...]
    if schedule is not None:
        assert varlen, "a schedule lists the items of a varlen call"
        grid = (heads_k, schedule.shape[0])
    else:
        grid = (heads_k, batch, key_tiles) if tile.key_major else (key_tiles, batch, heads_k)
    # split_d: its two MMA warpgroups hand dQ over in halves of the columns
    kernel, dq_parts = (attn_bwd_ws_split_kernel, 2) if tile.split_d else (attn_bwd_ws_kernel, 1)
    assert not qk_tail or tile.split_d, "a q/k tail block is bwd_ws_split's"
    # with a q/k tail block: q, k and dq_accum's first block (their boxes) and the tail's (tail_descs)
    first = config.head_block(d - qk_tail) if qk_tail else None
    q_desc = descriptor(q, varlen, tile.block_m, first)
    tail_descs = (descriptor(q, varlen, tile.block_m, qk_tail), descriptor(k, varlen, tile.block_n, qk_tail),
                  descriptor(dq_accum, varlen, tile.block_m, qk_tail)) if qk_tail else None
    return LaunchSpec(kernel, grid, dict(
        q_desc=q_desc, k_desc=descriptor(k, varlen, tile.block_n, first), v_desc=descriptor(v, varlen, tile.block_n),
        do_desc=descriptor(dout, varlen, tile.block_m), dq_desc=descriptor(dq_accum, varlen, tile.block_m,
                                                            first or config.head_block(d) // dq_parts),
        stats=(lse, delta), grads=(dk, dv),
        semaphores=(semaphores if semaphores is not None else lse, semaphore_tiles(seqlen_q, tile)),
        cu_seqlens=(cu_seqlens_q, cu_seqlens_k) if varlen else (lse, lse), schedule=schedule,
        strides=(lse_strides, (dk_strides, dv_strides)),
        sizes=GluonSizes(seqlen_q, seqlen_k, d, group, scale), window=mask.window,
        softcap=softcap or None, alibi=alibi, dropout=dropout, head_dim_v=v.shape[-1] if v.shape[-1] != d else None,
        tail_descs=tail_descs, TILE=tile,
        CALL=GluonCall(q_desc.block_shape[-1], varlen, mask.flags, DETERMINISTIC=semaphores is not None,
                       QK_TAIL=qk_tail)),
        tile.num_warps, options={"maxnreg": tile.max_registers} if tile.max_registers else {})


def launch(*args, **kwargs):
    """One launch of attn_bwd_ws_kernel (launch_spec's arguments)."""
    launch_spec(*args, **kwargs).launch()
