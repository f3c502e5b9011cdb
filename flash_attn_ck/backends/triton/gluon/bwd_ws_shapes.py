"""Host-side shapes of the warp-specialised backward (bwd_ws.py) that the workspace plan needs without
importing Gluon."""

from __future__ import annotations


def semaphore_tiles(seqlen_q: int, tile) -> int:
    """Query tiles per (batch, head) that the deterministic mode orders with one semaphore each."""
    return max(1, -(-seqlen_q // tile.block_m))
