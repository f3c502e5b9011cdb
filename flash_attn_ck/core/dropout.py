"""The dropout keep pattern, defined once for every backend that draws it itself.

`rng_state` is an int64 tensor `[seed, offset]` on the device. Each group of four columns of a row
shares one Philox-4x32-10 draw: element `(b, h, i, j)` of the attention matrix (b the sequence, h the
query head, i/j rows/columns inside the sequence) takes output word `j % 4` of the draw with the 64-bit
seed as key and the 128-bit counter

    (c0, c1, c2, c3) = (j // 4, i, low32(offset + b * heads + h), high32(offset + b * heads + h))

(`triton.language.philox(seed, c0, c1, c2, c3)`), so the Triton kernels and this PyTorch version draw
the same bits, and a kernel pays one draw (about 80 integer operations) per four scores. It is kept iff
`(bits >> 8) * 2**-24 >= p` in fp32 (24-bit uniforms are exact in both). The pattern depends on the
element's coordinates only, never on launch bounds: varlen calls with different `max_seqlen` draw the
same pattern.

The CK kernels draw their own pattern from the same `[seed, offset]` (CK's Philox layout).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Philox-4x32-10's multipliers and key increments (the Gluon kernels' gluon/dropout.py takes them from here)
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for a < 2**32 and int64 tensor b in [0, 2**32), without overflow."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    hi = (a * b_hi + ((a * b_lo) >> 16)) >> 16
    return hi & _MASK32, (a * b) & _MASK32


def philox(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor,
           c3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four output words of Philox-4x32-10 for int64 tensors of 32-bit counter words, as int64 in [0, 2**32)."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo32(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo32(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + PHILOX_KEY_A) & _MASK32, (k1 + PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def keep_mask(rng_state: tuple[int, int], p: float, batch_index: int, heads: int, head_ids: torch.Tensor,
              rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Boolean `(len(head_ids), len(rows), len(cols))`: True where the probability is kept.

    `heads`: the call's query heads; `batch_index`, `head_ids`, `rows`, `cols`: global coordinates."""
    seed, offset = rng_state
    plane = offset + batch_index * heads + head_ids.to(torch.int64)          # (H,)
    shape = (len(head_ids), len(rows), len(cols))
    cols = cols.to(torch.int64)
    c0 = ((cols >> 2) & _MASK32)[None, None, :].expand(shape)
    c1 = (rows.to(torch.int64) & _MASK32)[None, :, None].expand(shape)
    c2 = (plane & _MASK32)[:, None, None].expand(shape)
    c3 = ((plane >> 32) & _MASK32)[:, None, None].expand(shape)
    words = torch.stack(philox(seed, c0, c1, c2, c3))                       # (4, H, rows, cols)
    bits = words.gather(0, (cols & 3)[None, None, None, :].expand(1, *shape))[0]
    uniform = (bits >> 8).to(torch.float32) * (2.0 ** -24)
    return uniform >= torch.tensor(p, dtype=torch.float32)


def new_rng_state(device: torch.device) -> torch.Tensor:
    """Draw `[seed, offset]` on `device` from torch's default generator.

    A device-side draw advances the generator (consecutive calls differ) and is safe under CUDA
    graph capture: each replay draws fresh values into the same tensor."""
    seed = torch.randint(-(2 ** 63), 2 ** 63 - 1, (1,), dtype=torch.int64, device=device)
    offset = torch.randint(0, 2 ** 32, (1,), dtype=torch.int64, device=device)
    return torch.cat([seed, offset])
