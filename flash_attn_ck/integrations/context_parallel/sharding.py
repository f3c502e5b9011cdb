"""Layouts of a sequence over the ranks: which 2 of the 2W chunks each rank holds, `shard` and `unshard`."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ...core.checks import is_integer_tensor
from ...core.errors import ArgumentError
from .group import is_mesh_2d, process_group, size_rank

LAYOUTS = ("zigzag", "contiguous")


# rank, world -> the two chunk ids; "interleaved" is internal: the a2a group inside the hybrid, whose members each
# hold a piece of both of the ring shard's chunks.
_CHUNK_IDS = {"zigzag": lambda rank, world: (rank, 2 * world - 1 - rank),
              "contiguous": lambda rank, world: (2 * rank, 2 * rank + 1),
              "interleaved": lambda rank, world: (rank, world + rank)}


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, int]:
    """The two global chunk indices (of 2 * world) that `rank` holds, in local order (increasing)."""
    if layout not in _CHUNK_IDS:
        raise ArgumentError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return _CHUNK_IDS[layout](rank, world)


def _shard_ids(group, layout: str) -> tuple[int, tuple[int, int]]:
    """(W, this rank's two chunk ids of 2W). A 2-D mesh (ring dim, a2a dim) of R x A ranks (the hybrid): rank
    (r, a) holds piece a of each of its ring shard's chunks (i0, i1): chunks i0 * A + a and i1 * A + a."""
    if is_mesh_2d(group):
        (ring, r), (inner, a) = (size_rank(group.get_group(dim)) for dim in (0, 1))
        first, second = chunk_ids(r, ring, layout)
        return ring * inner, (first * inner + a, second * inner + a)
    world, rank = size_rank(process_group(group))
    return world, chunk_ids(rank, world, layout)


def sequence_bounds(length: int, cu_seqlens: torch.Tensor | None, world: int = 1) -> list[int]:
    """Sequence boundaries along the sequence dim: [0, length] dense, else cu_seqlens / world (a rank's shard)."""
    return [0, length] if cu_seqlens is None else [int(o) // world for o in cu_seqlens.tolist()]


def _split(x: torch.Tensor, seq_dim: int, bounds: list[int], parts: int) -> list[tuple[torch.Tensor, ...]]:
    """Per sequence, its `parts` equal pieces along seq_dim."""
    return [x.narrow(seq_dim, a, b - a).tensor_split(parts, dim=seq_dim) for a, b in itertools.pairwise(bounds)]


def shard(x: torch.Tensor, group=None, *, seq_dim: int = 1, layout: str = "zigzag",
          cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's shard of the full tensor `x` (every rank passes the same x): its two chunks, concatenated.
    `group`: a ProcessGroup, a 1-D DeviceMesh, or the hybrid's 2-D mesh. For (b, h, s, d) tensors pass seq_dim=2;
    "zigzag" equals torch's head-tail load balancer followed by an even split.
    Varlen (`cu_seqlens`, x packed (total, ...) with seq_dim=0): every sequence is cut into 2W chunks and the
    shard packs this rank's two chunks of each sequence, in sequence order (offsets cu_seqlens / W)."""
    world, ids = _shard_ids(group, layout)
    if not -x.dim() <= seq_dim < x.dim():
        raise ArgumentError(f"seq_dim: expected a dimension of x's {x.dim()}, got {seq_dim}")
    if cu_seqlens is not None and not (is_integer_tensor(cu_seqlens) and cu_seqlens.dim() == 1):
        raise ArgumentError(f"cu_seqlens: expected a 1-D integer tensor of offsets, got {cu_seqlens!r}")
    bounds = sequence_bounds(x.shape[seq_dim], cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != x.shape[seq_dim] or any(b < a for a, b in itertools.pairwise(bounds)):
        raise ArgumentError(f"cu_seqlens: expected non-decreasing offsets from 0 to x's {x.shape[seq_dim]} rows "
                            f"along seq_dim, got {bounds}")
    for a, b in itertools.pairwise(bounds):
        if (b - a) % (2 * world):
            raise ArgumentError(f"sequence length {b - a} must be a multiple of 2 * world size = {2 * world}")
    return torch.cat([chunks[i] for chunks in _split(x, seq_dim, bounds, 2 * world) for i in ids], dim=seq_dim)


def unshard(x: torch.Tensor, group=None, *, seq_dim: int = 1, layout: str = "zigzag",
            cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor from every rank's shard (all-gather, then the chunks back in sequence order)."""
    group = process_group(group)
    world, _ = size_rank(group)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    return in_sequence_order(gathered, world, layout, seq_dim, cu_seqlens)


def in_sequence_order(shards: list[torch.Tensor], world: int, layout: str, seq_dim: int,
                      cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    per_rank = [_split(local, seq_dim, sequence_bounds(local.shape[seq_dim], cu_seqlens, world), 2) for local in shards]
    ordered: list[torch.Tensor] = []
    for sequence in range(len(per_rank[0])):
        chunks = {index: chunk for rank, local in enumerate(per_rank)
                  for index, chunk in zip(chunk_ids(rank, world, layout), local[sequence], strict=True)}
        ordered += (chunks[index] for index in range(2 * world))
    return torch.cat(ordered, dim=seq_dim)


def rank_shards(full: torch.Tensor, world: int, layout: str) -> list[torch.Tensor]:
    """Every rank's shard of a full (b, s, ...) tensor, in rank order."""
    chunks = full.chunk(2 * world, dim=1)
    return [torch.cat([chunks[i] for i in chunk_ids(r, world, layout)], dim=1) for r in range(world)]

