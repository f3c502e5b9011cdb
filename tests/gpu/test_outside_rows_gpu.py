"""On a CUDA GPU: the Triton backend's one-launch fill of varlen rows in no sequence
(backends/triton/runtime/outside_rows.py) fills exactly what the generic form (core/rows.py) fills, compiled. The
same logic interpreted on the CPU: tests/triton/test_outside_rows.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from row_fills import random_fills

pytest.importorskip("triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Nearly every example compiles its own variant (Triton specialises each size and stride for 1 and multiples of
# 16), so 40 took 118 s alone and passed 300 s under 14 loaded workers; the interpreted test on the CPU
# (tests/triton/test_outside_rows.py) covers the same logic.
@settings(max_examples=16, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_backend_fill_matches_the_generic_form(data, dtype):
    from flash_attn_ck.backends.triton import TritonBackend
    fills, expected = random_fills(lambda lo, hi: data.draw(st.integers(lo, hi)), "cuda", dtype)
    TritonBackend().fill_outside_sequences(*fills)
    for (_, t, _, _), e in zip(fills, expected):
        assert torch.equal(t, e)
