"""Where a rank's two local chunks lie in its shard (dense or varlen) and the flash-attn arguments of calls on them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...core.errors import ArgumentError
from .sharding import sequence_bounds


@dataclass(frozen=True)
class Chunks:
    """Where a rank's two local chunks lie in its shard, as indices `x[sel]`, and the flash-attn arguments of a
    call on them. Dense: (b, 2c, ...) shards, chunk i = rows [ic, (i + 1)c). Varlen: (total, ...) shards packing
    each sequence's two chunks; chunk i of every sequence = the packed rows `rows[i]` (int64 indices), and a
    call on them is varlen with `cu` (int32, one chunk per sequence) for queries and `seen * cu` for keys."""

    c: int = 0
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    cu: torch.Tensor | None = None
    cu_seen: tuple[torch.Tensor, torch.Tensor] | None = None   # keys of one chunk, of both chunks
    max_c: int = 0
    sequences: int = 1

    @staticmethod
    def varlen(cu_seqlens: torch.Tensor, world: int, device: torch.device) -> Chunks:
        bounds = sequence_bounds(0, cu_seqlens, world)
        lengths = [(b - a) // 2 for a, b in itertools.pairwise(bounds)]
        first, second = (torch.cat([torch.arange(a + i * n, a + (i + 1) * n) for a, n in zip(bounds, lengths)]
                                   + [torch.zeros(0, dtype=torch.int64)]).to(device) for i in (0, 1))
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        return Chunks(rows=(first, second), cu=cu, cu_seen=(cu, cu * 2), max_c=max(lengths, default=0),
                      sequences=len(lengths))

    @property
    def empty(self) -> bool:
        return (self.c if self.rows is None else self.rows[0].numel()) == 0

    def q(self, i: int) -> tuple:
        """Local chunk i of q, out, dout (seq dim 1 dense, 0 varlen)."""
        return (slice(None), slice(i * self.c, (i + 1) * self.c)) if self.rows is None else (self.rows[i],)

    def rows_of(self, q_chunks: tuple[int, ...]) -> tuple:
        """The local rows of q, out, dout of one or both local chunks (both: the whole shard)."""
        return self.q(q_chunks[0]) if len(q_chunks) == 1 else (slice(None),)

    def row_workspace(self, buffer: torch.Tensor, count: int) -> torch.Tensor:
        """A view of `buffer` (shaped like q) with the shape of `count` local chunks, for flash_attn_bwd's dq."""
        return buffer[:, :count * self.c] if self.rows is None else buffer[:count * self.rows[0].numel()]

    def keys(self, seen: int) -> tuple:
        """The first `seen` chunks of a held K/V block (per sequence)."""
        if self.rows is None:
            return (slice(None), slice(0, seen * self.c))
        return (slice(None),) if seen == 2 else (self.rows[0],)

    def workspace(self, buffer: torch.Tensor, seen: int) -> torch.Tensor:
        """A view of `buffer` (shaped like k) with the shape of `seen` chunks, for flash_attn_bwd to write."""
        return buffer[self.keys(seen)] if self.rows is None else buffer[:seen * self.rows[0].numel()]

    def options(self, seen: int, q_count: int = 1) -> dict:
        """The varlen arguments of a call on `q_count` local query chunks and `seen` key chunks of a block."""
        if self.cu_seen is None:
            return {}
        return dict(cu_seqlens_q=self.cu_seen[q_count - 1], cu_seqlens_k=self.cu_seen[seen - 1],
                    max_seqlen_q=q_count * self.max_c, max_seqlen_k=seen * self.max_c)


# Varlen chunk indices per cu_seqlens tensor: reading cu_seqlens (a host sync on a GPU) and building the
# index tensors happens once per tensor and layout, not in every layer's forward and backward.
_VARLEN_CHUNKS = WeakIdKeyDictionary()


def varlen_chunks(cu_seqlens: torch.Tensor, world: int, device: torch.device) -> tuple[Chunks, int]:
    """The chunks of a rank's varlen shard and the rows it holds (total / W)."""
    # An inference tensor has no version counter (and may change inside inference_mode): never kept.
    version = None if cu_seqlens.is_inference() else cu_seqlens._version
    key = (version, world, device)
    cached = None if version is None else _VARLEN_CHUNKS.get(cu_seqlens)
    if cached is None or cached[0] != key:
        bounds = sequence_bounds(0, cu_seqlens)
        if bounds[0] != 0 or any(b < a for a, b in itertools.pairwise(bounds)):
            raise ArgumentError(f"cu_seqlens: expected non-decreasing offsets from 0, got {bounds}")
        if any((b - a) % (2 * world) for a, b in itertools.pairwise(bounds)):
            raise ArgumentError(f"cu_seqlens: every sequence length must be a multiple of 2 * world size = "
                                f"{2 * world}, got offsets {bounds}")
        cached = (key, Chunks.varlen(cu_seqlens, world, device), bounds[-1] // world)
        if version is not None:
            _VARLEN_CHUNKS[cu_seqlens] = cached
    return cached[1:]

