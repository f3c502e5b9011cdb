"""Row tiles of a row-major (n_rows, n_cols) matrix with unit column stride: the loads and stores
every kernel uses for q, k, v, dO and the gradients.

With USE_TMA (dense tensors on sm_90+, 16-byte aligned; backend.TritonBackend._tma decides) a tile
moves through a TMA tensor descriptor: rows and columns past the matrix read as zero and are never
written, no per-element masks or addresses live in registers, and Triton's pipeliner issues the
loads of the next iterations asynchronously. Otherwise (varlen, older GPUs, the interpreter by
default) masked pointer accesses with the same semantics.

Usage: `src = row_tiles(head_rows(T, *strides of T, b64, start, h), ...)` once, outside the loop;
`load_rows(src, ..., row0, ...)` inside. Strides come as launch.py's per-tensor tuples.
"""

import triton
import triton.language as tl


@triton.jit
def head_rows(base, stride_batch, stride_row, stride_head, b64, start, h):
    """Row 0 of sequence b (b64, int64; packed from row `start` when varlen), head h, of a (b, s, h, d)
    or varlen (total, h, d) tensor with (batch, row, head) strides (launch.rows3)."""
    return base + b64 * stride_batch + start.to(tl.int64) * stride_row + h.to(tl.int64) * stride_head


@triton.jit
def row_tiles(base, stride_row, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              USE_TMA: tl.constexpr):
    """What load_rows/store_rows take: a tensor descriptor with (BLOCK_R, BLOCK_C) boxes, or base."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, n_cols], strides=[stride_row, 1],
                                         block_shape=[BLOCK_R, BLOCK_C])
    else:
        return base


@triton.jit
def load_rows(src, stride_row, row0, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              USE_TMA: tl.constexpr):
    """Rows [row0, row0 + BLOCK_R), columns [0, BLOCK_C); zero outside (n_rows, n_cols)."""
    if USE_TMA:
        return src.load([row0, 0])
    else:
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        # int64: a sequence's rows may span 2**31 elements (the stores' offsets are int64 alike)
        return tl.load(src + rows[:, None].to(tl.int64) * stride_row + cols[None, :],
                       mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :], other=0.0)


@triton.jit
def store_rows(tile, base, stride_row, row0, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Store rows [row0, row0 + BLOCK_R) in base's dtype; nothing outside (n_rows, n_cols) is written."""
    value = tile.to(base.dtype.element_ty)
    if USE_TMA:
        row_tiles(base, stride_row, n_rows, n_cols, BLOCK_R, BLOCK_C, USE_TMA).store([row0, 0], value)
    else:
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        tl.store(base + rows[:, None].to(tl.int64) * stride_row + cols[None, :], value,
                 mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :])


@triton.jit
def add_rows(tile, base, stride_row, row0, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
             USE_TMA: tl.constexpr):
    """Add an fp32 tile into rows [row0, row0 + BLOCK_R) of an fp32 matrix: the TMA bulk reduce-add
    (`cp.reduce.async.bulk.tensor`) or relaxed `tl.atomic_add`."""
    if USE_TMA:
        row_tiles(base, stride_row, n_rows, n_cols, BLOCK_R, BLOCK_C, USE_TMA).atomic_add([row0, 0], tile)
    else:
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        tl.atomic_add(base + rows[:, None].to(tl.int64) * stride_row + cols[None, :], tile,
                      mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :], sem="relaxed")
