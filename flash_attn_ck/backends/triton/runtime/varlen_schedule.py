"""A varlen launch's tile schedule, built on the device from cu_seqlens without a host sync.

A varlen launch of the warp-specialised kernels on a plain grid has `batch x tiles(max_seqlen)` programs per head and
most of them exit at once (every sequence shorter than the longest); the ones that work start in grid order,
so a pack's long tiles may start last. The schedule lists the real work items instead: every (sequence,
tile) of the axis the kernel's CTAs own (key tiles for the backward, query tiles for the forward), the most
steps first (steps: the tiles of the other axis that the CTA walks under the call's mask), ties in (sequence,
tile) order. It is an int32 tensor `(bound, 2)` of `[sequence, tile]` rows padded with `[-1, -1]`, where
`bound = total rows // block + batch` (`schedule_bound`) is known on the host from the tensors' shapes and
bounds the real item count (`sum ceil(len / block) <= total // block + batch`), so the launch grid is sized
without reading cu_seqlens back. A kernel then runs grid `(heads, bound)`, heads fastest: program
`(h, p)` takes item `p` for head `h`, exits on `-1`, and every head's longest items start first.

Two builders give the same tensor: a small Triton kernel (one program, one launch; `TRITON_MAX_ITEMS`
bounds its sort) and torch ops (searchsorted + a stable sort), both free of host syncs.
`schedule_model` is the plain-Python statement of the same schedule that the tests hold both to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import LaunchSpec

# Above this many items the Triton builder's one-program sort gets too large; the torch ops take over.
TRITON_MAX_ITEMS = 8192


@dataclass(frozen=True)
class TileWalk:
    """What one CTA of a kernel owns and walks. `owns_keys`: the CTA owns a key tile and walks query tiles
    (the backward), else it owns a query tile and walks key tiles (the forward). `left`/`right`: the call's
    window (-1: unbounded; causal is right = 0), aligned bottom-right unless `top_left`."""
    own_block: int
    walk_block: int
    owns_keys: bool
    left: int = -1
    right: int = -1
    top_left: bool = False

    def __post_init__(self):
        if self.own_block < 1 or self.walk_block < 1:
            raise ValueError(f"TileWalk: blocks must be positive, got {self.own_block} x {self.walk_block}")


def schedule_bound(total_rows: int, batch: int, block: int) -> int:
    """Items the schedule holds: at least the real (sequence, tile) count of any lengths that sum to at most
    `total_rows` (ceil(n / block) = floor((n - 1) / block) + 1 for n >= 1, and the floors sum to at most
    floor(total_rows / block))."""
    return total_rows // block + batch


def item_steps(len_q, len_k, tile, walk: TileWalk):
    """Tiles of the walked axis that own tile `tile` of a sequence sees under the mask (0: none): of ints (the model),
    or elementwise of int64 tensors (the torch builder), by the same arithmetic."""
    elementwise = isinstance(tile, torch.Tensor)
    minimum = torch.minimum if elementwise else min
    shift = 0 if walk.top_left else len_k - len_q
    own_len, walk_len = (len_k, len_q) if walk.owns_keys else (len_q, len_k)
    first, last = tile * walk.own_block, minimum((tile + 1) * walk.own_block, own_len) - 1
    # Query i sees keys [i + shift - left, i + shift + right]; a key j is seen by queries
    # [j - shift - right, j - shift + left]. Over a tile of consecutive rows the union is an interval.
    below, above = (walk.right, walk.left) if walk.owns_keys else (walk.left, walk.right)
    offset = -shift if walk.owns_keys else shift
    lo = 0 if below < 0 else (first + offset - below).clamp(min=0) if elementwise else max(0, first + offset - below)
    hi = walk_len - 1 if above < 0 else minimum(walk_len - 1, last + offset + above)
    steps = hi // walk.walk_block - lo // walk.walk_block + 1
    return torch.where(lo <= hi, steps, 0) if elementwise else steps if lo <= hi else 0


def schedule_model(cu_seqlens_q: list[int], cu_seqlens_k: list[int], walk: TileWalk, bound: int) -> list[list[int]]:
    """The schedule in plain Python: every (sequence, tile), the most steps first, ties in (sequence, tile)
    order, padded with [-1, -1] to `bound` rows."""
    items = []
    for b in range(len(cu_seqlens_q) - 1):
        len_q, len_k = cu_seqlens_q[b + 1] - cu_seqlens_q[b], cu_seqlens_k[b + 1] - cu_seqlens_k[b]
        own_len = len_k if walk.owns_keys else len_q
        for tile in range(-(-own_len // walk.own_block)):
            items.append((-item_steps(len_q, len_k, tile, walk), b, tile))
    items.sort()
    if len(items) > bound:
        raise ValueError(f"schedule_model: {len(items)} items exceed the bound {bound}")
    return [[b, tile] for _, b, tile in items] + [[-1, -1]] * (bound - len(items))


def build_schedule(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, walk: TileWalk, bound: int,
                   use_triton: bool | None = None) -> torch.Tensor:
    """The schedule, int32 `(bound, 2)` on cu_seqlens' device, without a host sync. `bound`: at least
    `schedule_bound(rows of the owned axis, batch, walk.own_block)`. `use_triton`: the one-launch Triton
    builder (default: on CUDA up to TRITON_MAX_ITEMS items), else torch ops."""
    if use_triton is None:
        use_triton = cu_seqlens_q.is_cuda and bound <= TRITON_MAX_ITEMS
    if use_triton:
        return _build_triton(cu_seqlens_q, cu_seqlens_k, walk, bound)
    return _build_torch(cu_seqlens_q, cu_seqlens_k, walk, bound)


# ---- torch ops ---------------------------------------------------------------------------------
def _build_torch(cu_seqlens_q, cu_seqlens_k, walk: TileWalk, bound: int) -> torch.Tensor:
    device, batch = cu_seqlens_q.device, cu_seqlens_q.shape[0] - 1
    if batch == 0 or bound == 0:
        return torch.full((bound, 2), -1, dtype=torch.int32, device=device)
    len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    own_len = len_k if walk.owns_keys else len_q
    tiles = (own_len + walk.own_block - 1) // walk.own_block
    ends = torch.cumsum(tiles, 0)
    item = torch.arange(bound, device=device)
    seq = torch.searchsorted(ends, item, right=True)        # the sequence whose tiles hold this item
    real = seq < batch
    seq = seq.clamp(max=batch - 1)
    tile = item - (ends[seq] - tiles[seq])
    steps = torch.where(real, item_steps(len_q[seq], len_k[seq], tile, walk), -1)
    order = torch.sort(steps, descending=True, stable=True).indices
    rows = torch.stack([torch.where(real, seq, -1), torch.where(real, tile, -1)], dim=1)
    return rows[order].to(torch.int32)


# ---- Triton ------------------------------------------------------------------------------------
def _build_triton(cu_seqlens_q, cu_seqlens_k, walk: TileWalk, bound: int) -> torch.Tensor:
    out = torch.empty((bound, 2), dtype=torch.int32, device=cu_seqlens_q.device)
    if bound == 0:
        return out
    if bound > TRITON_MAX_ITEMS:
        raise ValueError(f"build_schedule: {bound} items exceed the Triton builder's {TRITON_MAX_ITEMS}")
    # through launch_kernel, as every launch of the backend (its compiled-kernel cache; a replay records it)
    launch_spec(cu_seqlens_q, cu_seqlens_k, walk, bound, out).launch()
    return out


def launch_spec(cu_seqlens_q, cu_seqlens_k, walk: TileWalk, bound: int, out: torch.Tensor | None = None) -> LaunchSpec:
    """The builder's one launch (schedule_kernel) into `out`, int32 (bound, 2) (a new one on cu_seqlens' device by
    default)."""
    if out is None:
        out = torch.empty((bound, 2), dtype=torch.int32, device=cu_seqlens_q.device)
    return LaunchSpec(schedule_kernel, (1,), dict(
        cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, out=out, batch=cu_seqlens_q.shape[0] - 1, bound=bound, left=walk.left,
        right=walk.right, OWN_BLOCK=walk.own_block, WALK_BLOCK=walk.walk_block, OWNS_KEYS=walk.owns_keys,
        TOP_LEFT=walk.top_left, ITEMS=triton.next_power_of_2(bound)), schedule_warps(bound), 3)


def schedule_warps(bound: int) -> int:
    """Warps of the builder's one program: its sort holds 512 items a warp without spills (ptxas, sm_90a:
    8192 items spill 836 bytes with 4 warps, none with 16)."""
    return max(4, min(16, triton.next_power_of_2(bound) // 512))


@triton.jit
def locate(cu_q, cu_k, batch, item, OWN_BLOCK: tl.constexpr, OWNS_KEYS: tl.constexpr):
    """(sequence, tile, len_q, len_k) of each item index (sequence -1 past the last tile)."""
    seq = tl.full(item.shape, -1, tl.int32)
    tile = tl.zeros(item.shape, tl.int32)
    len_q = tl.zeros(item.shape, tl.int32)
    len_k = tl.zeros(item.shape, tl.int32)
    start = 0
    b = 0
    while b < batch:    # not range(batch): triton 3.6's interpreter takes no runtime range bound with NumPy >= 2.3
        lq = tl.load(cu_q + b + 1) - tl.load(cu_q + b)
        lk = tl.load(cu_k + b + 1) - tl.load(cu_k + b)
        tiles = tl.cdiv(lk if OWNS_KEYS else lq, OWN_BLOCK)
        here = (item >= start) & (item < start + tiles)
        seq = tl.where(here, b, seq)
        tile = tl.where(here, item - start, tile)
        len_q = tl.where(here, lq, len_q)
        len_k = tl.where(here, lk, len_k)
        start += tiles
        b += 1
    return seq, tile, len_q, len_k


@triton.jit
def schedule_kernel(cu_q, cu_k, out, batch, bound, left, right, OWN_BLOCK: tl.constexpr,
                    WALK_BLOCK: tl.constexpr, OWNS_KEYS: tl.constexpr, TOP_LEFT: tl.constexpr,
                    ITEMS: tl.constexpr):
    item = tl.arange(0, ITEMS)
    seq, tile, len_q, len_k = locate(cu_q, cu_k, batch, item, OWN_BLOCK, OWNS_KEYS)
    # item_steps, elementwise
    shift = 0 if TOP_LEFT else len_k - len_q
    own_len = len_k if OWNS_KEYS else len_q
    walk_len = len_q if OWNS_KEYS else len_k
    below = right if OWNS_KEYS else left
    above = left if OWNS_KEYS else right
    offset = -shift if OWNS_KEYS else shift
    first = tile * OWN_BLOCK
    last = tl.minimum(first + OWN_BLOCK, own_len) - 1
    lo = tl.where(below < 0, 0, tl.maximum(first + offset - below, 0))
    hi = tl.where(above < 0, walk_len - 1, tl.minimum(walk_len - 1, last + offset + above))
    steps = tl.where(lo <= hi, hi // WALK_BLOCK - lo // WALK_BLOCK + 1, 0)
    steps = tl.where(seq >= 0, steps, -1)            # padding after every real item
    # most steps first, ties by item index: sort (steps_max - steps) * ITEMS + item, ascending
    key = (tl.max(steps, 0) - steps).to(tl.int64) * ITEMS + item
    ordered = (tl.sort(key, 0) % ITEMS).to(tl.int32)
    seq, tile, _, _ = locate(cu_q, cu_k, batch, ordered, OWN_BLOCK, OWNS_KEYS)
    keep = item < bound
    tl.store(out + 2 * item, seq, mask=keep)
    tl.store(out + 2 * item + 1, tl.where(seq >= 0, tile, -1), mask=keep)
