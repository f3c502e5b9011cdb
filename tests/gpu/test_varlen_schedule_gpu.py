"""On a CUDA GPU: both builders of backends/triton/runtime/varlen_schedule.py (torch ops and the Triton kernel) run
without a host sync and give the plain-Python model's schedule. The model against brute force, and the Triton builder
interpreted: tests/triton/test_varlen_schedule.py."""

from __future__ import annotations

import pytest
import torch

from cases import cumulative

pytest.importorskip("triton")

from flash_attn_ck.backends.triton.runtime import varlen_schedule as vs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_triton", [True, False])
def test_both_builders_run_on_the_gpu_without_a_host_sync(use_triton):
    """The schedule of a packed pack with empty and 1-token documents, built under CUDA's sync debug mode
    "error" (any host sync raises), equals the model's."""
    seqlens = [0, 1, 700, 5, 0, 3000, 1, 129, 128, 64]
    cu = cumulative(seqlens)
    walk = vs.TileWalk(128, 64, True, -1, 0)
    bound = vs.schedule_bound(cu[-1], len(seqlens), 128)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    vs.build_schedule(cu_dev, cu_dev, walk, bound, use_triton=use_triton)     # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        built = vs.build_schedule(cu_dev, cu_dev, walk, bound, use_triton=use_triton)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert built.cpu().tolist() == vs.schedule_model(cu, cu, walk, bound)
