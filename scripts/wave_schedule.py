"""How much a grid's CTA order costs at the end of a launch: a model, not a measurement.

CTAs start in grid order (x fastest) on whichever SM frees first; each runs for a time proportional to its
steps. Under a causal mask a backward CTA's steps fall with its key tile index (a forward CTA's with its
query tile's distance from the end), so a tile-major grid, (tiles, batch, heads), leaves long CTAs of the last
heads running after the others finish, and a key-major grid, (heads, batch, tiles), starts every long CTA first.
Prints the makespan of both orders against the ideal (total steps / SMs) for the benchmark's causal shapes.

    python scripts/wave_schedule.py [--sms 132]
"""

from __future__ import annotations

import argparse
import heapq


def makespan(lengths: list[int], sms: int) -> int:
    """Greedy list scheduling in the given order: each CTA starts on the SM that frees first."""
    free = [0] * sms
    for length in lengths:
        heapq.heappush(free, heapq.heappop(free) + length)
    return max(free)


def orders(tiles: int, heads: int, steps) -> tuple[list[int], list[int]]:
    """CTA lengths in tile-major order (tile fastest) and key-major order (heads fastest)."""
    per_tile = [steps(n) for n in range(tiles)]
    return [per_tile[n] for _ in range(heads) for n in range(tiles)], \
        [per_tile[n] for n in range(tiles) for _ in range(heads)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (H100/H200 SXM: 132)")
    args = ap.parse_args()
    # (name, CTAs along the tile axis, batch x heads (kv heads for the backward), steps of tile n)
    shapes = [
        ("bwd d128 s8192 b2 h16, 64x128 tiles", 64, 2 * 16, lambda n: 128 - 2 * n),
        ("bwd GQA 32/8 d128 s8192 b2", 64, 2 * 8, lambda n: 4 * (128 - 2 * n)),
        ("bwd d128 s2048 b8 h16", 16, 8 * 16, lambda n: 32 - 2 * n),
        ("bwd GQA 32/8 d128 s2048 b8", 16, 8 * 8, lambda n: 4 * (32 - 2 * n)),
        ("bwd d64 s8192 b2 h32", 64, 2 * 32, lambda n: 128 - 2 * n),
        ("fwd d128 s8192 b2 h16, 128x128 tiles", 64, 2 * 16, lambda n: 64 - n),
    ]
    for name, tiles, heads, steps in shapes:
        tile_major, key_major = orders(tiles, heads, steps)
        ideal = sum(tile_major) / args.sms
        a, b = makespan(tile_major, args.sms), makespan(key_major, args.sms)
        print(f"{name}: tile-major {ideal / a:.3f} of ideal, key-major {ideal / b:.3f} (x{a / b:.3f})")


if __name__ == "__main__":
    main()
