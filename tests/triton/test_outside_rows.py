"""The Triton backend's one-launch fill of varlen rows in no sequence (backends/triton/runtime/outside_rows.py) fills
exactly what the generic form (core/rows.py) fills: random tensors (2-D along dim 1 like lse, 3-D along dim 0,
strided views), offsets ending anywhere in or past the rows, two offset tensors, several targets per launch.
Here the kernel runs interpreted (TRITON_INTERPRET=1, so in a subprocess); compiled on a GPU:
tests/gpu/test_outside_rows_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

_INTERPRETED = r"""
import json, random, torch
from tests.row_fills import random_fills
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
