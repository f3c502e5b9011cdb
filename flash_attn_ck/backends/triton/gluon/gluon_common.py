"""What the warp-specialised Gluon kernels (fwd_ws.py, bwd_ws.py) share: sequence bounds, the visible
query/key ranges, the mask, the matmul against a tile of a TMA ring, and the host-side TMA descriptors (boxes
of one head over 3-D (rows, heads, head_dim) views).

The mask follows scores.py's conventions: bottom-right aligned per sequence (`shift = len_k - len_q`;
0 for top-left); row i keeps key j iff `j >= i + shift - left` (with a left bound), `j <= i + shift + right`
(with a right bound) and `j < len_k`. The helpers are elementwise in rows/cols, so a caller may use either
orientation (the forward's S, the backward's S^T).
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate, base_value

from .. import config

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)


@gluon.jit
def hardware_tanh(x):
    """tanh of fp32 scores by the GPU's own approximation (`tanh.approx.f32`, one MUFU op; relative error about
    2^-11, under a bf16 score's rounding). one_launch/scores.accurate_tanh takes an exp2 and a reciprocal, two MUFU ops
    more beside the softmax's exp2 per score: the softmax step is bound by that unit at d64 and d128, where the
    matmuls of a score take fewer cycles than three MUFU ops (the interpreter-run one-launch kernels keep it)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


def aggregate(cls: type) -> type:
    """Triton's aggregate (a value of named fields that jit functions pass and return as one) with, unless the class
    writes its own, a constructor taking the fields in their order (constexpr fields from plain values too)."""
    if "__init__" not in cls.__dict__:
        fields = cls.__annotations__

        def __init__(self, *values):
            assert len(values) == len(fields), f"{cls.__name__}: {len(values)} values for fields {list(fields)}"
            for name, value in zip(fields, values):
                setattr(self, name, gl.constexpr(value) if fields[name] is gl.constexpr else value)
        cls.__init__ = gluon.constexpr_function(__init__)  # type: ignore[misc]
    return _aggregate(cls)


@gluon.constexpr_function
def runtime_or_constexpr(value):
    """An aggregate's field from a kernel argument: a tensor, or the constexpr Triton made of it (None, or an int
    equal to 1, which a launch specialises) wrapped so that a jit function can return the aggregate."""
    return value if isinstance(value, gl.tensor) else gl.constexpr(value)


# ---- the call's sequences and mask ----------------------------------------------------------
@aggregate
class Sequences:
    """Where each sequence of the call lies: packed (VARLEN: cu_seqlens) or dense (b * max rows); and, for a varlen
    launch that has one, its schedule (varlen_schedule.py: an int32 (rows, 2) tensor of [sequence, tile] items padded
    with [-1, -1], run on a grid (heads, rows)), else a constexpr None, which compiles no schedule code."""
    cu_seqlens_q: gl.tensor
    cu_seqlens_k: gl.tensor
    seqlen_q: base_value   # a tensor, or the constexpr 1 a launch makes of it
    seqlen_k: base_value
    VARLEN: gl.constexpr
    schedule: base_value   # a tensor, or constexpr None

    @gluon.constexpr_function
    def __init__(self, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN, schedule):
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        self.seqlen_q, self.seqlen_k = runtime_or_constexpr(seqlen_q), runtime_or_constexpr(seqlen_k)
        self.VARLEN = gl.constexpr(VARLEN)
        self.schedule = runtime_or_constexpr(schedule)

    @gluon.jit
    def scheduled_item(self):
        """(sequence, tile) of this program's row of the schedule (program_id(1)); the sequence is -1 on the padding
        past the real items."""
        row = self.schedule + 2 * gl.program_id(1)
        return gl.load(row), gl.load(row + 1)

    @gluon.jit
    def query(self, b):
        """(first row in the 2-D view, length) of query sequence b."""
        return sequence(self.cu_seqlens_q, b, self.seqlen_q, self.VARLEN)

    @gluon.jit
    def key(self, b):
        """(first row in the 2-D view, length) of key sequence b."""
        return sequence(self.cu_seqlens_k, b, self.seqlen_k, self.VARLEN)


@gluon.jit
def sequence(cu_seqlens, b, max_len, VARLEN: gl.constexpr):
    """(first row in the 2-D view, length) of sequence b."""
    if VARLEN:
        start = gl.load(cu_seqlens + b)
        length = gl.load(cu_seqlens + b + 1) - start
    else:
        start = b * max_len
        length = max_len
    return start, length


@aggregate
class Mask:
    """The call's mask (the module docstring's conventions), from the host's launch.GluonMask: its runtime values
    (`window`: the bounds left, right >= 0) and its compile-time flags (`flags`, the kernels' `CALL.MASK`). A new
    mask kind is a flag of launch.MaskFlags (a value of GluonMask.window if it has one), its rule in the methods
    here, and its value where operators.mask_args reads the problem: no kernel changes."""
    left: base_value   # tensors, or the constexpr 1 a launch makes of a bound of 1
    right: base_value
    TOP_LEFT: gl.constexpr
    HAS_LEFT: gl.constexpr
    HAS_RIGHT: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, window, flags):
        self.left, self.right = (runtime_or_constexpr(bound) for bound in window)
        self.TOP_LEFT = gl.constexpr(flags.TOP_LEFT)
        self.HAS_LEFT = gl.constexpr(flags.HAS_LEFT)
        self.HAS_RIGHT = gl.constexpr(flags.HAS_RIGHT)

    @gluon.jit
    def shift(self, len_q, len_k):
        """The diagonal's offset: 0 top-left, len_k - len_q bottom-right."""
        return 0 if self.TOP_LEFT else len_k - len_q

    @gluon.jit
    def query_range(self, n0, len_q, shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Query rows [lo, hi) that see keys [n0, n0 + BLOCK_N); lo is a multiple of BLOCK_M."""
        lo = 0
        hi = len_q
        if self.HAS_RIGHT:
            lo = gl.maximum(n0 - shift - self.right, 0)
            lo = (lo // BLOCK_M) * BLOCK_M
        if self.HAS_LEFT:
            hi = gl.minimum(n0 + BLOCK_N + self.left - shift, len_q)
        return lo, hi

    @gluon.jit
    def key_range(self, m0, len_q, len_k, shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Keys [lo, hi) that query rows [m0, min(m0 + BLOCK_M, len_q)) see; lo is a multiple of BLOCK_N."""
        lo = 0
        hi = len_k
        if self.HAS_LEFT:
            lo = gl.maximum(m0 + shift - self.left, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        if self.HAS_RIGHT:
            hi = gl.minimum(gl.minimum(m0 + BLOCK_M, len_q) + shift + self.right, len_k)
        return lo, hi

    @gluon.jit
    def key_tiles(self, m0, len_q, len_k, shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(first key, number of key tiles of BLOCK_N keys from it) that cover `key_range`."""
        lo, hi = self.key_range(m0, len_q, len_k, shift, BLOCK_M, BLOCK_N)
        return lo, gl.maximum(gl.cdiv(hi - lo, BLOCK_N), 0)

    @gluon.jit
    def unmasked_key_tiles(self, m0, rows, len_q, len_k, shift, n_lo, n_tiles, BLOCK_N: gl.constexpr):
        """Tiles [first, end), 0 <= first <= end <= n_tiles, of the `n_tiles` key tiles from key `n_lo` (`key_tiles`)
        whose every key every query row of [m0, min(m0 + rows, len_q)) sees (for m0 >= len_q, rows never written,
        some such range): the keys all rows see start where the last row's `key_range` does and end where the first
        row's does (both bounds grow with the row). Numerators stay non-negative, so the divisions read the same in
        a kernel (truncating) and in Python (flooring)."""
        seen_lo = self.key_range(gl.minimum(m0 + rows, len_q) - 1, len_q, len_k, shift, 1, 1)[0]
        seen_hi = self.key_range(m0, len_q, len_k, shift, 1, 1)[1]
        first = gl.minimum(gl.cdiv(gl.maximum(seen_lo - n_lo, 0), BLOCK_N), n_tiles)
        end = gl.maximum(gl.minimum(gl.maximum(seen_hi - n_lo, 0) // BLOCK_N, n_tiles), first)
        return first, end

    @gluon.jit
    def first_key_tile(self, m0, shift, BLOCK_N: gl.constexpr):
        """The first key tile (of BLOCK_N keys) that sees query row m0, and so the query tile starting there (its later
        rows reach no further left): the deterministic mode's dQ adds into that query tile start from it."""
        first = 0
        if self.HAS_LEFT:
            first = gl.cdiv(gl.maximum(m0 - BLOCK_N - self.left + shift + 1, 0), BLOCK_N)
        return first

    @gluon.jit
    def tile_needs_mask(self, m0, n0, len_k, shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """False when every (row, key) of rows [m0, m0 + BLOCK_M) x keys [n0, n0 + BLOCK_N) is kept."""
        partial = n0 + BLOCK_N > len_k
        if self.HAS_LEFT:
            partial = partial | (n0 < m0 + BLOCK_M - 1 + shift - self.left)
        if self.HAS_RIGHT:
            partial = partial | (n0 + BLOCK_N - 1 > m0 + shift + self.right)
        return partial

    @gluon.jit
    def keep(self, rows, cols, len_k, shift):
        """Whether query `rows` see key `cols` (broadcast elementwise)."""
        keep = cols < len_k
        if self.HAS_LEFT:
            keep = keep & (cols >= rows + shift - self.left)
        if self.HAS_RIGHT:
            keep = keep & (cols <= rows + shift + self.right)
        return keep


@gluon.jit
def probs_transposed(mask, sT, lse2, scale_log2, offs_m, offs_n, m0, n0, len_k, shift, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr):
    """The backward's P^T = exp2(S^T * scale * log2e - lse * log2e) of keys `offs_n` (rows) x queries `offs_m`
    (columns) from raw scores S^T and lse·log2e per query, 0 where the mask drops the pair (checked only on tiles
    that need it)."""
    pT = gl.exp2(sT * scale_log2 - gl.expand_dims(lse2, 0))
    if mask.tile_needs_mask(m0, n0, len_k, shift, BLOCK_M, BLOCK_N):
        keep = mask.keep(gl.expand_dims(offs_m, 0), gl.expand_dims(offs_n, 1), len_k, shift)
        pT = gl.where(keep, pT, 0.0)
    return pT


# ---- a ring of shared-memory tiles --------------------------------------------------------------
@aggregate
class Ring:
    """STAGES tiles in shared memory, (rows, cols) or (rows, 1, cols) (a descriptor's box of one head), each behind
    a "ready" mbarrier (its TMA load has landed) and an "empty" one (its readers are done). Step i uses slot
    i % STAGES in phase (i // STAGES) & 1; rings that are filled and released together share barriers."""
    bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.jit
    def tile(self, step):
        """The (rows, cols) tile of step `step`."""
        return slot(self.bufs, step % self.STAGES)

    @gluon.jit
    def wait_ready(self, step):
        mbarrier.wait(self.ready.index(step % self.STAGES), (step // self.STAGES) & 1)

    @gluon.jit
    def release(self, step):
        """This reader is done with the slot of `step` (its wgmma reading it has completed)."""
        mbarrier.arrive(self.empty.index(step % self.STAGES), count=1)

    @gluon.jit
    def issue_mma(self, a_smem, zero, step):
        """Issue acc = A B^T (async wgmma, both operands in shared memory) against B = the tile of `step`, once it
        has landed: the forward's S = Q K^T, the backward's S^T = K Q^T and dP^T = V dO^T."""
        stage = step % self.STAGES
        mbarrier.wait(self.ready.index(stage), (step // self.STAGES) & 1)
        return warpgroup_mma(a_smem, slot(self.bufs, stage).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def slot(buffers, i):
    """Buffer i of a ring of (rows, cols) tiles, or of (rows, 1, cols) tiles (a descriptor's box of one head),
    as a (rows, cols) tile."""
    tile = buffers.index(i)
    return tile.reshape([tile.shape[0], tile.shape[len(tile.shape) - 1]])


# ---- host side: TMA descriptors over 2-D row views ---------------------------------------------
# Called per tensor per launch, and small calls are host-bound: shapes and strides are read once each.
def rows_view(t, varlen: bool):
    """(rows, heads * head_dim, row stride) of a q/k/v-like tensor seen as one 2-D matrix, or None
    when its rows are not uniform (heads not adjacent, or a batch stride other than s * row stride)."""
    shape, strides = t.shape, t.stride()
    d = shape[-1]
    if strides[-1] != 1 or strides[-2] != d:
        return None
    if varlen:
        return shape[0], shape[1] * d, strides[0]
    b, s = shape[0], shape[1]
    if b > 1 and strides[0] != s * strides[1]:
        return None
    return b * s, shape[2] * d, strides[1]


def _uniform(t, varlen: bool):
    """(uniform_rows(t), its rows_view)."""
    view = rows_view(t, varlen)
    if view is not None and t.data_ptr() % 16 == 0 and (view[2] * t.element_size()) % 16 == 0:
        return t, view
    t = t.clone(memory_format=torch.contiguous_format)
    return t, rows_view(t, varlen)


def uniform_rows(t, varlen: bool):
    """`t` itself when a TMA descriptor can view its rows (uniform rows, 16-byte aligned), else a fresh contiguous
    copy (a copy even of a contiguous tensor whose base is not 16-byte aligned: `contiguous()` would return it)."""
    return _uniform(t, varlen)[0]


@functools.cache
def _box_layout(box: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a box (made once: descriptors are made per call)."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gl_dtype)


def descriptor(t, varlen: bool, block_rows: int, block_cols: int | None = None):
    """A host TMA descriptor over `t`'s 3-D view (rows, heads, head_dim) with (block_rows, 1, head_block(head_dim))
    boxes of one head (config.head_block; coordinates [row, head, 0]): columns past head_dim read as zeros and are
    not written, so a head dim that is not a power of two is padded in shared memory only. `block_cols`: boxes of
    that many columns instead (coordinates [row, head, first column])."""
    return _descriptor(t, rows_view(t, varlen), block_rows, block_cols)


def uniform_descriptor(t, varlen: bool, block_rows: int, block_cols: int | None = None):
    """(uniform_rows(t), the descriptor over it): its rows viewed once; boxes of `block_cols` columns (None: the head
    block)."""
    t, view = _uniform(t, varlen)
    return t, _descriptor(t, view, block_rows, block_cols)


def _descriptor(t, view, block_rows: int, block_cols: int | None = None):
    rows, cols, row_stride = view
    d = t.shape[-1]
    box = (block_rows, 1, block_cols or config.head_block(d))
    return TensorDescriptor(t, [rows, cols // d, d], [row_stride, d, 1], list(box), _box_layout(box, t.dtype))
