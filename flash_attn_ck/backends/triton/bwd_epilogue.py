"""Backward epilogue (SPEC §4, the Hopper design): what a key-tile program does with its dK/dV.

- `store_tile` (MHA, and GQA when one program loops over its group's query heads): the tile goes
  to global memory in the output dtype, by a TMA tensor-descriptor store when the tensor is dense
  (`USE_TMA`), by a row-masked store for varlen (never writing past the sequence's last key).
- `add_tile`: adds an fp32 tile into an fp32 accumulator `(rows, d)` slice, by the TMA bulk
  reduce-add (`descriptor.atomic_add`, `cp.reduce.async.bulk.tensor`) or by `tl.atomic_add`.
- `accumulate_kv` (GQA accumulator epilogue): each query head's program adds its dK/dV into the
  fp32 `(b, h_k, s_k, d)` accumulators; deterministic mode orders the adds of the `group` query
  heads with an int32 semaphore per (key tile, batch, kv head): the program of rank g waits until
  the semaphore equals g, adds, waits until its adds are complete in global memory, and releases
  the semaphore to g + 1. Ranks are launched in increasing order, so the wait cannot deadlock.
"""

import triton
import triton.language as tl


@triton.jit
def store_tile(tile, base, stride_row, row0, n_rows, n_cols,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr):
    """Store rows [row0, row0 + BLOCK_R) of a (n_rows, n_cols) matrix at `base` (unit column stride)."""
    value = tile.to(base.dtype.element_ty)
    if USE_TMA:
        desc = tl.make_tensor_descriptor(base, shape=[n_rows, n_cols], strides=[stride_row, 1],
                                         block_shape=[BLOCK_R, BLOCK_C])
        desc.store([row0, 0], value)
    else:
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        tl.store(base + rows[:, None].to(tl.int64) * stride_row + cols[None, :], value,
                 mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :])


@triton.jit
def add_tile(tile, base, stride_row, row0, n_rows, n_cols,
             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr):
    """Add an fp32 tile into rows [row0, row0 + BLOCK_R) of an fp32 (n_rows, n_cols) matrix."""
    if USE_TMA:
        desc = tl.make_tensor_descriptor(base, shape=[n_rows, n_cols], strides=[stride_row, 1],
                                         block_shape=[BLOCK_R, BLOCK_C])
        desc.atomic_add([row0, 0], tile)
    else:
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        tl.atomic_add(base + rows[:, None].to(tl.int64) * stride_row + cols[None, :], tile,
                      mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :], sem="relaxed")


@triton.jit
def _bulk_adds_complete(token):
    """Wait until this thread's TMA bulk reduce-adds have been written to global memory (not only
    read out of shared memory, which is all Triton's own wait after a descriptor store checks)."""
    return tl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, $1;",
        "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def accumulate_kv(dk, dv, dk_acc, dv_acc, stride_row, row0, n_rows, n_cols, lock, rank,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr,
                  DETERMINISTIC: tl.constexpr):
    if DETERMINISTIC:
        # ---- wait for our turn: ranks 0 .. rank-1 of this (key tile, batch, kv head) are done ----
        while tl.atomic_cas(lock, rank, rank, sem="acquire") != rank:
            pass
    add_tile(dk, dk_acc, stride_row, row0, n_rows, n_cols, BLOCK_R, BLOCK_C, USE_TMA)
    add_tile(dv, dv_acc, stride_row, row0, n_rows, n_cols, BLOCK_R, BLOCK_C, USE_TMA)
    if DETERMINISTIC:
        # ---- the adds must be visible in global memory before the next rank may start ----
        if USE_TMA:
            rank = _bulk_adds_complete(rank)
        tl.debug_barrier()
        tl.atomic_add(lock, 1, sem="release")
