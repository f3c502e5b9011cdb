"""Backward epilogue (docs/semantics.md §The Hopper epilogue contract): what a key-tile program does with its dK/dV.

- MHA, and GQA when one program loops over its group's query heads: the finished tile goes to
  global memory in the output dtype through `row_io.store_rows`, a TMA tensor-descriptor store when
  the tensor is dense (`USE_TMA`), a row-masked store for varlen (never past the sequence's last key).
- `accumulate_kv` (GQA accumulator epilogue): each query head's program adds its dK/dV into the
  fp32 `(b, h_k, s_k, d)` accumulators (`row_io.add_rows`: TMA bulk reduce-add when dense, else
  `tl.atomic_add`); deterministic mode orders the adds of the `group` query
  heads with an int32 semaphore per (key tile, batch, kv head): the program of rank g waits until
  the semaphore equals g, adds, waits until its adds are complete in global memory, and releases
  the semaphore to g + 1. Ranks are launched in increasing order, so the wait cannot deadlock.
"""

import triton
import triton.language as tl

from .row_io import add_rows


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
    add_rows(dk, dk_acc, stride_row, row0, n_rows, n_cols, BLOCK_R, BLOCK_C, USE_TMA)
    add_rows(dv, dv_acc, stride_row, row0, n_rows, n_cols, BLOCK_R, BLOCK_C, USE_TMA)
    if DETERMINISTIC:
        # ---- the adds must be visible in global memory before the next rank may start ----
        if USE_TMA:
            rank = _bulk_adds_complete(rank)
        tl.debug_barrier()
        tl.atomic_add(lock, 1, sem="release")
