"""The dropout keep pattern of core/dropout.py for the Gluon kernels: Philox-4x32-10 at counter (key // 4, row,
low32(offset + plane), high32(offset + plane)), word key % 4 for each of the four keys of a draw, kept iff its top
24 bits as a uniform in [0, 1) are >= p.

A tile's draws are made in a blocked layout of (rows, keys / 4) and their words joined into the tile's own order;
the one layout conversion to the caller's layout (the matmul accumulator's, where a thread's neighbouring keys are
split across lanes) is what a quarter of the draws costs.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ....core import dropout as pattern
from .gluon_common import aggregate

ROUND_A = gl.constexpr(pattern.PHILOX_ROUND_A)
ROUND_B = gl.constexpr(pattern.PHILOX_ROUND_B)
KEY_A = gl.constexpr(pattern.PHILOX_KEY_A)
KEY_B = gl.constexpr(pattern.PHILOX_KEY_B)
ROUNDS = gl.constexpr(pattern.PHILOX_ROUNDS)


@aggregate
class Dropout:
    """One (sequence, query head)'s pattern inputs: the Philox `seed`, the counter's `plane` (offset + b * heads + h,
    int64) and the drop probability `p` (`pattern_of` builds it from the call's)."""
    seed: gl.tensor
    plane: gl.tensor
    p: gl.tensor

    @gluon.jit
    def keep(self, rows, n0, BLOCK_N: gl.constexpr, layout: gl.constexpr, KEYS_FIRST: gl.constexpr):
        """Boolean keep mask of rows `rows` (1-D, rows inside the sequence) against keys [n0, n0 + BLOCK_N) (n0 a
        multiple of 4) in `layout`: (rows, keys), or (keys, rows) with KEYS_FIRST."""
        ROWS: gl.constexpr = rows.shape[0]
        # draws spread over the tile's threads without repeats (a tile of at least 16 rows and 32 keys)
        if KEYS_FIRST:
            draws: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, gl.num_warps()], [0, 1])
            groups = gl.expand_dims(n0 // 4 + gl.arange(0, BLOCK_N // 4, layout=gl.SliceLayout(1, draws)), 1)
            rows_2d = gl.expand_dims(gl.convert_layout(rows, gl.SliceLayout(0, draws)), 0)
        else:
            draws: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [gl.num_warps(), 1], [1, 0])  # type: ignore[no-redef]
            groups = gl.expand_dims(n0 // 4 + gl.arange(0, BLOCK_N // 4, layout=gl.SliceLayout(0, draws)), 0)
            rows_2d = gl.expand_dims(gl.convert_layout(rows, gl.SliceLayout(1, draws)), 1)
        zero = (groups * 0 + rows_2d * 0).to(gl.uint32)
        c0 = zero + groups.to(gl.uint32)
        c1 = zero + rows_2d.to(gl.uint32)
        c2 = zero + (self.plane & 0xFFFFFFFF).to(gl.uint32)
        c3 = zero + ((self.plane >> 32) & 0xFFFFFFFF).to(gl.uint32)
        w0, w1, w2, w3 = philox(self.seed, c0, c1, c2, c3)
        # (..., group, 2, 2) with [k, l] = word 2k + l: key 4 * group + 2k + l once flattened
        words = gl.join(gl.join(w0, w2), gl.join(w1, w3))
        if KEYS_FIRST:
            bits = gl.reshape(gl.permute(words, (0, 2, 3, 1)), (BLOCK_N, ROWS))
        else:
            bits = gl.reshape(words, (ROWS, BLOCK_N))
        kept = (bits >> 8).to(gl.float32) * 5.960464477539063e-08 >= self.p     # 2**-24
        return gl.convert_layout(kept, layout)


@gluon.jit
def pattern_of(call, b, head):
    """The Dropout of sequence `b`'s query head `head` of the launch from the call's (int64 [seed, offset] rng_state,
    p, query heads, the launch's first query head: a launch may take a slice of the heads)."""
    rng_state, p, heads, first_head = call
    return Dropout(gl.load(rng_state), gl.load(rng_state + 1) + (b * heads + first_head + head).to(gl.int64), p)


@gluon.jit
def philox(seed, c0, c1, c2, c3):
    """The four output words of Philox-4x32-10 with the int64 `seed` as key, for uint32 counter words."""
    k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
    for _ in gl.static_range(ROUNDS):
        a = c0
        b = c2
        c0 = gl.umulhi(ROUND_B, b) ^ c1 ^ k0
        c2 = gl.umulhi(ROUND_A, a) ^ c3 ^ k1
        c1 = ROUND_B * b
        c3 = ROUND_A * a
        k0 = k0 + KEY_A
        k1 = k1 + KEY_B
    return c0, c1, c2, c3
