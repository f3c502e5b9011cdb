"""The Triton backend's one-launch fill of varlen rows in no sequence (backends/triton/runtime/outside_rows.py) fills
exactly what the generic form (core/rows.py) fills: random tensors (2-D along dim 1 like lse, 3-D along dim 0,
strided views), offsets ending anywhere in or past the rows, two offset tensors, several targets per launch.
On the CPU the kernel runs interpreted (TRITON_INTERPRET=1, so in a subprocess); on a GPU through the backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


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


_INTERPRETED = r"""
import json, random, torch
from tests.triton.test_outside_rows import random_fills
from flash_attn_ck.backends.triton.runtime import launch
rng = random.Random(0)
ok = []
for case in range(12):
    fills, expected = random_fills(rng.randint, "cpu")
    spec = launch.fill_outside(tuple(fills))
    if spec is not None:
        spec.launch()
    ok.append(all(torch.equal(t, e) for (_, t, _, _), e in zip(fills, expected)))
print(json.dumps(ok))
"""


def test_interpreted_fill_matches_the_generic_form():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [True] * 12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Nearly every example compiles its own variant (Triton specialises each size and stride for 1 and multiples of
# 16), so 40 took 118 s alone and passed 300 s under 14 loaded workers; the interpreted test above covers the
# same logic on the CPU.
@settings(max_examples=16, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_backend_fill_matches_the_generic_form(data, dtype):
    from flash_attn_ck.backends.triton import TritonBackend
    fills, expected = random_fills(lambda lo, hi: data.draw(st.integers(lo, hi)), "cuda", dtype)
    TritonBackend().fill_outside_sequences(*fills)
    for (_, t, _, _), e in zip(fills, expected):
        assert torch.equal(t, e)
