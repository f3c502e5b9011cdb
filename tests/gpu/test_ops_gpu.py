"""On a CUDA GPU: torch.library.opcheck of the flash_attn_ck ops on the Triton backend in fp16/bf16, every layout
of opchecks.py (the CPU form on the reference backend: tests/api/test_ops.py)."""

from __future__ import annotations

import pytest
import torch

from opchecks import DROPOUT, LAYOUTS, run_bwd, run_bwd_out, run_fwd, run_fwd_out

# ---- GPU: the Triton backend ----------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dropout_p", DROPOUT)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", ["fwd", "fwd_out", "bwd", "bwd_out"])
@pytest.mark.gpu
@requires_cuda
def test_triton_opcheck(op, layout, dtype, dropout_p):
    if op == "fwd":
        run_fwd(layout, dtype, "cuda", dropout_p, return_probs=dtype == torch.float16, backend="triton")
    elif op == "fwd_out":
        run_fwd_out(layout, dtype, "cuda", dropout_p, "triton")
    elif op == "bwd":
        run_bwd(layout, dtype, "cuda", dropout_p, "triton")
    else:
        run_bwd_out(layout, dtype, "cuda", dropout_p, "triton")
