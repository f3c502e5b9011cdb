"""Random fills of varlen rows in no sequence for the Triton backend's one-launch fill (interpreted:
tests/triton/test_outside_rows.py; compiled: tests/gpu/test_outside_rows_gpu.py), with what the generic form
(core/rows.py) makes of them."""

from __future__ import annotations

import torch


def random_fills(draw_int, device, dtype=torch.float32):
    """(fills for the backend, the same fills made by core/rows.py on copies): 1-4 targets over two offset
    tensors, each a 3-D (rows, h, d) tensor (possibly a strided view) or a 2-D (h, rows) one."""
    from flash_attn_ck.core.rows import fill_all_outside_sequences
    offsets = []
    for _ in range(2):
        lengths = [draw_int(0, 40) for _ in range(draw_int(1, 3))]
        offsets.append(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device))
    fills, expected = [], []
    for _ in range(draw_int(1, 4)):
        cu = offsets[draw_int(0, 1)]
        rows = int(cu[-1]) + draw_int(0, 70)
        heads, d = draw_int(1, 5), draw_int(1, 40)
        value = (0.0, float("inf"), -1.5)[draw_int(0, 2)]
        if draw_int(0, 1):
            base = torch.randn(rows, heads + draw_int(0, 2), d + draw_int(0, 3), device=device).to(dtype)
            t, dim = base[:, :heads, :d], 0
        else:
            t, dim = torch.randn(heads, rows, device=device).to(dtype), 1
        alone = t.clone()
        fill_all_outside_sequences(cu, (alone, dim, value))
        fills.append((cu, t, dim, value))
        expected.append(alone)
    return fills, expected
