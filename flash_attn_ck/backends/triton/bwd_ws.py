"""Warp-specialised backward main kernel for sm_90, written in Gluon (FA3's design).

One CTA per (key tile, batch, kv head). dK and dV stay in registers for the whole walk over the
query tiles of every query head of the kv head's group, so GQA needs no fp32 dK/dV and no
reduction. Three partitions share the CTA (the loader and the dQ writer are bwd_ws_workers.py's, shared with
bwd_ws_split.py, the kernel for head dims above 128):

  loader   (1 warp)   TMA: K, V once; then per step the Q and dO tiles into a ring of NUM_STAGES
                      buffers, each behind its own "ready" mbarrier (TMA byte count), and the tile's
                      lse (times log2 e) and D rows into shared memory beside Q (q_ready's second
                      arrival); one "tile_empty" mbarrier per slot, released by the MMA partition.
  MMA      (default,  per step, 5 matmuls and no recomputation:
            8 warps)    S^T = K Q^T, dP^T = V dO^T                 (shared-memory operands)
                        P^T = exp2(S^T * scale * log2e - lse * log2e), masked
                        dS^T = P^T * (dP^T - D)
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
write head_dim columns only.

Invariants (on the host: `TritonBackend.ws_reasons` decides which calls run here, gluon_common.uniform_rows
copies tensors whose rows a descriptor cannot view):
  - head_dim padded to a power of two with tiles in config.BWD_WS_SM90 (64, 128; 256 is bwd_ws_split.py's);
    heads adjacent in memory (stride_h = head_dim), rows uniform, 16-byte aligned;
  - no dropout, ALiBi or softcap.
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

from . import bwd_ws_workers as workers
from .bwd_ws_schedule import semaphore_tiles
from .bwd_ws_split import attn_bwd_ws_split_kernel
from .gluon_common import (
    LOG2E,
    box_cols,
    descriptor,
    issue_ring_mma,
    probs_transposed,
    slot,
)


# ---- MMA partition (default) -----------------------------------------------------------------
@gluon.jit
def _mma(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
         q_ready, do_ready, tile_empty, kv_ready, dq_full, dq_empty,
         dK, dV, cu_seqlens_q, cu_seqlens_k,
         stride_dkb, stride_dkr, stride_dkh, stride_dvb, stride_dvr, stride_dvh,
         seqlen_q, seqlen_k, head_dim, group, scale, window_left, window_right,
         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr,
         DQ_STAGES: gl.constexpr, VARLEN: gl.constexpr, TOP_LEFT: gl.constexpr, HAS_LEFT: gl.constexpr,
         HAS_RIGHT: gl.constexpr, KEY_MAJOR: gl.constexpr, num_warps: gl.constexpr):
    n0, b, kv_head, q_row0, len_q, k_row0, len_k, shift, m_lo, m_tiles = workers.tile_schedule(
        cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, window_left, window_right,
        BLOCK_M, BLOCK_N, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT, KEY_MAJOR)
    dtype: gl.constexpr = k_smem.dtype
    k_tile = k_smem.reshape([BLOCK_N, HEAD_D])
    v_tile = v_smem.reshape([BLOCK_N, HEAD_D])

    # Layouts: every warp owns 16 key rows of the (BLOCK_N, *) tiles; dQ splits its columns.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    dq_warps_m: gl.constexpr = BLOCK_M // 16 if num_warps > BLOCK_M // 16 else num_warps
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[dq_warps_m, num_warps // dq_warps_m],
        instr_shape=[16, HEAD_D // (num_warps // dq_warps_m), 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)   # one value per query (column of S^T)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)   # one value per key (row of S^T)

    offs_n = n0 + gl.arange(0, BLOCK_N, layout=row_layout)
    offs_m_tile = gl.arange(0, BLOCK_M, layout=col_layout)
    scale_log2 = scale * LOG2E

    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_D], gl.float32, dq_layout)

    steps = m_tiles * group
    mbarrier.wait(kv_ready, 0)
    for step in range(steps):
        sT = issue_ring_mma(k_tile, q_smem, q_ready, s_zero, step, NUM_STAGES)
        dpT = issue_ring_mma(v_tile, do_smem, do_ready, s_zero, step, NUM_STAGES)
        stage = step % NUM_STAGES
        m0 = m_lo + (step % m_tiles) * BLOCK_M
        q_tile = slot(q_smem, stage)
        do_tile = slot(do_smem, stage)
        lse2 = lse_smem.index(stage).load(col_layout)   # lse * log2 e (q_ready covers it)
        delta = delta_smem.index(stage).load(col_layout)
        offs_m = m0 + offs_m_tile

        # ---- P^T = exp2(S^T * scale * log2e - lse * log2e), masked ----
        sT = warpgroup_mma_wait(1, deps=(sT,))
        pT = probs_transposed(sT, lse2, scale_log2, offs_m, offs_n, m0, n0, len_k, shift, window_left, window_right,
                              BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

        # ---- dS^T = P^T (dP^T - D); dV += P^T dO ----
        dpT = warpgroup_mma_wait(0, deps=(dpT,))
        dsT = pT * (dpT - gl.expand_dims(delta, 0))
        p_op = gl.convert_layout(pT.to(dtype), a_layout)
        dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)

        # ---- dQ = dS K (dS through shared memory); dK += dS^T Q (registers) ----
        ds_bf = dsT.to(dtype)
        ds_smem.store(ds_bf)
        fence_async_shared()
        gl.thread_barrier()
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_tile, dq_zero, use_acc=False, is_async=True)
        ds_op = gl.convert_layout(ds_bf, a_layout)
        dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))   # dK stays on the tensor cores during the hand-off

        # ---- hand dQ (scaled) to the writer ----
        dq_stage = step % DQ_STAGES
        mbarrier.wait(dq_empty.index(dq_stage), ((step // DQ_STAGES) & 1) ^ 1)
        slot(dq_smem, dq_stage).store(dq * scale)
        fence_async_shared()
        gl.thread_barrier()   # every warp's dQ is in shared memory
        mbarrier.arrive(dq_full.index(dq_stage), count=1)
        dk = warpgroup_mma_wait(0, deps=(dk, ds_op))[0]
        mbarrier.arrive(tile_empty.index(stage), count=1)   # dK and dV, the last readers of Q and dO, are done

    # ---- epilogue: dK (scaled) and dV in the output dtype ----
    workers.store_dkv(dk, dv, dK, dV, n0, b, kv_head, k_row0, len_k, head_dim, scale,
              stride_dkb, stride_dkr, stride_dkh, stride_dvb, stride_dvr, stride_dvh, 0, VARLEN)


# ---- the kernel ------------------------------------------------------------------------------
@gluon.jit
def attn_bwd_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, dK, dV, Sem, cu_seqlens_q, cu_seqlens_k,
                       stride_lse_b, stride_lse_h, stride_dkb, stride_dkr, stride_dkh,
                       stride_dvb, stride_dvr, stride_dvh,
                       seqlen_q, seqlen_k, head_dim, group, scale, window_left, window_right, sem_m_tiles,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                       NUM_STAGES: gl.constexpr, DQ_STAGES: gl.constexpr, VARLEN: gl.constexpr,
                       TOP_LEFT: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                       LOADER_REGS: gl.constexpr, WRITER_REGS: gl.constexpr,
                       DETERMINISTIC: gl.constexpr, KEY_MAJOR: gl.constexpr, num_warps: gl.constexpr):
    """Grid: (key tiles, batch, kv heads), or (kv heads, batch, key tiles) with KEY_MAJOR
    (workers.cta_coords). See the module docstring."""
    if VARLEN:   # noqa: SIM102 (a constexpr branch: dense calls compile no cu_seqlens loads)
        if workers.past_sequence(cu_seqlens_k, BLOCK_N, KEY_MAJOR):
            return
    dtype: gl.constexpr = q_desc.dtype
    q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, q_ready, do_ready, tile_empty, kv_ready = \
        workers.loader_buffers(q_desc, k_desc, v_desc, do_desc, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, 1)
    dq_smem, dq_full, dq_empty = workers.writer_buffers(dq_desc, BLOCK_M, HEAD_D, DQ_STAGES, 1)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)

    gl.warp_specialize([
        (_mma, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
                q_ready, do_ready, tile_empty, kv_ready, dq_full, dq_empty,
                dK, dV, cu_seqlens_q, cu_seqlens_k,
                stride_dkb, stride_dkr, stride_dkh, stride_dvb, stride_dvr, stride_dvh,
                seqlen_q, seqlen_k, head_dim, group, scale, window_left, window_right,
                BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, DQ_STAGES, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT,
                KEY_MAJOR, num_warps)),
        (workers.loader, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                   q_ready, do_ready, tile_empty, kv_ready, Lse, Delta, stride_lse_b, stride_lse_h,
                   cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, group, window_left, window_right,
                   BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT, KEY_MAJOR)),
        (workers.dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, Sem,
                      cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, group, window_left, window_right, sem_m_tiles,
                      BLOCK_M, BLOCK_N, HEAD_D, DQ_STAGES, 1, VARLEN, TOP_LEFT, HAS_LEFT, HAS_RIGHT,
                      DETERMINISTIC, KEY_MAJOR)),
    ], [1, 1], [LOADER_REGS, WRITER_REGS])


# ---- host side -------------------------------------------------------------------------------
def launch(q, k, v, dout, lse, delta, dq_accum, dk, dv, cu_seqlens_q, cu_seqlens_k, *, varlen: bool, batch: int,
           seqlen_q: int, seqlen_k: int, scale: float, top_left: bool, window_left: int, window_right: int,
           has_left: bool, has_right: bool, tile, semaphores=None):
    """One launch of attn_bwd_ws_kernel (of bwd_ws_split's kernel for a `split_d` tile). dq_accum (rows_q, heads_q,
    d) fp32 must be zero; dq_accum receives dQ already scaled. lse/delta: (b, h, s_q) or varlen (h, total_q).
    `semaphores`: zeroed int32 (batch, heads_q, semaphore_tiles(seqlen_q, tile)) for the deterministic mode, else
    None."""
    d = q.shape[-1]
    heads_k = k.shape[-2]
    group = q.shape[-2] // heads_k
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    dk_strides = (0, dk.stride(0), dk.stride(1)) if varlen else (dk.stride(0), dk.stride(1), dk.stride(2))
    dv_strides = (0, dv.stride(0), dv.stride(1)) if varlen else (dv.stride(0), dv.stride(1), dv.stride(2))
    cu_q = cu_seqlens_q if varlen else lse
    cu_k = cu_seqlens_k if varlen else lse
    box = box_cols(d)   # shared-memory head dim: columns past d read as zeros, never written
    key_tiles = triton.cdiv(seqlen_k, tile.block_n)
    grid = (heads_k, batch, key_tiles) if tile.longest_first else (key_tiles, batch, heads_k)
    if tile.split_d:   # its two MMA warpgroups hand dQ over in halves of the columns
        kernel, dq_parts, extra = attn_bwd_ws_split_kernel, 2, dict(MMA_REGS=tile.mma_regs)
    else:
        kernel, dq_parts, extra = attn_bwd_ws_kernel, 1, {}
    if tile.max_registers:
        extra["maxnreg"] = tile.max_registers
    kernel[grid](
        descriptor(q, varlen, tile.block_m), descriptor(k, varlen, tile.block_n), descriptor(v, varlen, tile.block_n),
        descriptor(dout, varlen, tile.block_m), descriptor(dq_accum, varlen, tile.block_m, dq_parts),
        lse, delta, dk, dv, semaphores if semaphores is not None else lse, cu_q, cu_k,
        *lse_strides, *dk_strides, *dv_strides,
        seqlen_q, seqlen_k, d, group, scale, window_left, window_right, semaphore_tiles(seqlen_q, tile),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, HEAD_D=box, NUM_STAGES=tile.num_stages, DQ_STAGES=tile.dq_stages,
        VARLEN=varlen, TOP_LEFT=top_left, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        LOADER_REGS=tile.loader_regs, WRITER_REGS=tile.writer_regs,
        DETERMINISTIC=semaphores is not None, KEY_MAJOR=tile.longest_first, num_warps=tile.num_warps, **extra)

