"""On a CUDA GPU: the Triton path of a call (forward, backward, a no-grad forward) never synchronises the host with
the device. The host path's memo itself: tests/api/test_host_path.py."""

from __future__ import annotations

import pytest
import torch

import flash_attn_ck as fa

# ---- GPU: no host-device synchronisation anywhere on the Triton path ---------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("seqlen", [128, 512, 2048])
def test_triton_forward_backward_never_syncs(varlen, seqlen):
    """Forward + backward (and a no-grad forward) on the Triton backend under set_sync_debug_mode("error"):
    any host-device synchronisation (a .item(), a D2H copy, a value read of cu_seqlens) raises. The first call
    compiles outside the mode; the second, memoised one is the one checked, then a third of a new signature."""
    torch.manual_seed(0)
    h, d = 4, 64
    if varlen:
        cu = torch.tensor([0, seqlen // 2, seqlen + 3], dtype=torch.int32, device="cuda")
        shape = (seqlen + 3, h, d)
    else:
        shape = (2, seqlen, h, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def step(causal):
        if varlen:
            out = fa.flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=causal, backend="triton")
        else:
            out = fa.flash_attn_func(q, k, v, causal=causal, backend="triton")
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        with torch.no_grad():
            fa.flash_attn_func(q, k, v, backend="triton") if not varlen else \
                fa.flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, backend="triton")
        return out, grads
    step(True)
    step(False)
    torch.cuda.synchronize()
    expected = step(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(True)
        step(False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # The forward is deterministic; the backward's fp32 dQ adds (TMA reduce-adds from every key tile) are not
    # ordered, so a repeat may round a gradient element to the neighbouring bf16 value.
    assert torch.equal(got[0], expected[0])
    for a, b in zip(got[1], expected[1]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
