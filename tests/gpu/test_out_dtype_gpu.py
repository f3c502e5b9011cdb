"""On a CUDA GPU: `out_dtype=torch.float32` on the Triton backend, within the 2x rule of math SDPA and rounded, the
default call's bits where the default runs the same kernel. The rules of out_dtype on the CPU:
tests/api/test_out_dtype.py."""

from __future__ import annotations

import pytest
import torch

from cases import seeded_inputs
from flash_attn_ck.api import flash_attn_bwd, flash_attn_fwd
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.options import AttentionOptions


def _sdpa_with_grads(q, k, v, dout, dtype, causal):
    """Math SDPA in `dtype` on (b, s, h, d) operands -> out, dq, dk, dv in that layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (t.to(dtype).transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype).transpose(1, 2))
    return tuple(t.transpose(1, 2) for t in (out, *grads))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("s, h_k, causal", [(77, 4, True), (300, 2, False), (4096, 2, True)])
def test_triton_fp32_results_on_the_gpu(s, h_k, causal):
    """The Triton backend's fp32 results on CUDA come from its one-launch kernels, also where the default call runs
    the warp-specialised ones (s4096): within the 2x rule of math SDPA in bf16, and rounded, the default call's bits
    wherever the default runs the same kernel."""
    from flash_attn_ck.backends.registry import backend_instance
    from tests.oracle import assert_close_2x
    q, k, v, dout = (t.cuda() for t in seeded_inputs(torch.bfloat16, b=1, s_q=s, s_k=s, h=4, h_k=h_k, d=128))
    options = dict(causal=causal, backend="triton")
    out, lse, _ = flash_attn_fwd(q, k, v, **options)
    grads = flash_attn_bwd(dout, q, k, v, out, lse, **options)[:3]
    out32, lse32, _ = flash_attn_fwd(q, k, v, out_dtype=torch.float32, **options)
    grads32 = flash_attn_bwd(dout, q, k, v, out, lse, out_dtype=torch.float32, **options)[:3]
    ref = _sdpa_with_grads(q, k, v, dout, torch.float64, causal)
    pt = _sdpa_with_grads(q, k, v, dout, torch.bfloat16, causal)
    for name, ours, r, p in zip(("out", "dq", "dk", "dv"), (out32, *grads32), ref, pt, strict=True):
        assert ours.dtype == torch.float32, name
        assert_close_2x(name, ours, r, p)
    backend = backend_instance("triton")
    problem = describe_call(q, k, v, AttentionOptions(causal=causal))
    if backend.forward_kernel(problem).startswith("forward "):
        assert torch.equal(out32.to(torch.bfloat16), out) and torch.equal(lse32, lse)
    if h_k == 4 and backend.backward_plan(problem).kernel.startswith("bwd_main (one launch"):
        assert all(torch.equal(g32.to(torch.bfloat16), g) for g32, g in zip(grads32, grads, strict=True))
