"""On a CUDA GPU: the small transformer block of compiled_block.py through `torch.compile(fullgraph=True)` on the
Triton backend, inductor throughout, against eager (the CPU form and the rest: tests/api/test_compile.py)."""

from __future__ import annotations

import pytest
import torch

from compiled_block import check_compiled_matches_eager

# ---- GPU: the Triton backend ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("varlen, dropout_p", [(False, 0.0), (True, 0.0), (False, 0.2), (True, 0.2)],
                         ids=["batch", "varlen", "batch-dropout", "varlen-dropout"])
def test_block_compiles_and_matches_eager_gpu(varlen, dropout_p):
    # fp16 end to end: inductor fuses the norms/MLP differently from eager, a few ulps apart.
    check_compiled_matches_eager("cuda", torch.float16, "triton", varlen, dropout_p, atol=1e-2, rtol=1e-2)
