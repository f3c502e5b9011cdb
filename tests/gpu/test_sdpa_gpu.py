"""GPU tests of the SDPA provider (flash_attn_ck/integrations/sdpa.py; skipped without CUDA): the real
"FLASH_ATTN_CK" registration on the CUDA key, activated as a user would, on bf16 CUDA tensors, against SDPA's
math backend (float64 and bf16 on the same device) under the 2x rule (tests/oracle.py). A spy on the adapters'
`flash_attn_fwd` proves the provider ran. tests/integrations/test_sdpa.py holds the CPU versions and the layout checks.

torch's CUDA `_fused_sdp_choice` never picks flash for `is_causal` with s_q != s_k (FA2 is bottom-right),
so SDPA's top-left causal on non-square shapes is tested through the aten op the provider overrides."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention as attention
import torch.nn.functional as F
from sdpa_support import TinyAttention, activated, forward_spy
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ck.integrations.sdpa as provider
from cases import make_inputs, run_oracle, varlen_meta
from oracle import Config, assert_close_2x

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:Warning only once for all operators:UserWarning")]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEVICE = "cuda"


@pytest.fixture
def active():
    with activated(provider.PROVIDER):
        yield


@pytest.fixture
def spy():
    with forward_spy() as fwd:
        yield fwd


def inputs(b, h, h_k, s_q, s_k, d, seed=0):
    """(b, h, s, d) bf16 CUDA tensors: q, k, v, dout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s_q, d, generator=g)
    k, v = (torch.randn(b, h_k, s_k, d, generator=g) for _ in range(2))
    dout = torch.randn(b, h, s_q, d, generator=g)
    return tuple(t.to(DEVICE, torch.bfloat16) for t in (q, k, v, dout))


def with_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def math_sdpa(q, k, v, dout, dtype, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return with_grads(lambda *t: F.scaled_dot_product_attention(*t, **kwargs),
                          *(t.to(dtype) for t in (q, k, v, dout)))


def assert_2x_math(ours, q, k, v, dout, **kwargs):
    ref, pt = math_sdpa(q, k, v, dout, torch.float64, **kwargs), math_sdpa(q, k, v, dout, torch.bfloat16, **kwargs)
    for name, o, r, p in zip(("out", "dq", "dk", "dv"), ours, ref, pt, strict=True):
        assert o.shape == r.shape and o.dtype == torch.bfloat16 and o.is_cuda, name
        assert_close_2x(name, o.cpu(), r.cpu(), p.cpu())


@pytest.mark.parametrize("causal,s_q,s_k", [(False, 128, 128), (True, 128, 128), (False, 77, 190),
                                            (True, 190, 190)])
@pytest.mark.parametrize("h,h_k", [(4, 4), (4, 1)])
def test_sdpa_matches_math(active, spy, causal, s_q, s_k, h, h_k):
    """F.scaled_dot_product_attention with the flash backend forced runs our kernels (MHA and GQA)."""
    q, k, v, dout = inputs(2, h, h_k, s_q, s_k, 64)
    kwargs = dict(is_causal=causal, enable_gqa=h != h_k)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ours = with_grads(lambda *t: F.scaled_dot_product_attention(*t, **kwargs), q, k, v, dout)
    assert spy.call_count == 1
    assert_2x_math(ours, q, k, v, dout, **kwargs)


@pytest.mark.parametrize("s_q,s_k,h_k", [(64, 150, 2), (150, 64, 4), (1, 97, 1)])
def test_top_left_causal_on_the_aten_op(active, spy, s_q, s_k, h_k):
    """SDPA's top-left causal with s_q != s_k (both directions), through the op the provider overrides."""
    q, k, v, dout = inputs(2, 4, h_k, s_q, s_k, 64, seed=1)
    op = lambda *t: torch.ops.aten._scaled_dot_product_flash_attention(*t, is_causal=True, scale=0.1)[0]
    ours = with_grads(op, q, k, v, dout)
    assert spy.call_count == 1
    assert_2x_math(ours, q, k, v, dout, is_causal=True, scale=0.1, enable_gqa=h_k != 4)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_through_flash_attention_forward(active, spy, causal):
    """aten::_flash_attention_forward with cum_seq_q/k (FA2's bottom-right causal), forward and backward by
    torch's autograd formula, against the per-sequence oracle in float64 and bf16."""
    cfg = Config(seqlens=[(40, 70), (1, 33), (130, 130)], heads_q=4, heads_k=2, head_dim=64,
                 causal=causal)
    q, k, v, dout, _ = make_inputs(cfg, DEVICE, seed=2)
    cu_q, cu_k, max_q, max_k = varlen_meta(cfg, DEVICE)
    op = lambda *t: torch.ops.aten._flash_attention_forward(*t, cu_q, cu_k, max_q, max_k, 0.0, causal, False)[0]
    ours = with_grads(op, q, k, v, dout)
    assert spy.call_count == 1
    cpu = [t.cpu() for t in (q, k, v, dout)]
    ref, pt = (run_oracle(cfg, *cpu, None, None, dtype) for dtype in (torch.float64, torch.bfloat16))
    for name, o, r, p in zip(("out", "dq", "dk", "dv"), ours, (ref[0], *ref[2:]), (pt[0], *pt[2:]), strict=True):
        assert o.shape == r.shape and o.is_cuda, name
        assert_close_2x(name, o.cpu(), r, p)


def test_compile_fullgraph(active, spy):
    """torch.compile(fullgraph=True, inductor) of a bf16 model using SDPA: the compiled graph calls the provider
    and matches eager, forward and parameter gradients."""
    torch._dynamo.reset()
    model = TinyAttention(dim=64, head_dim=64).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 96, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    results = []
    for fn in (model, compiled):
        model.zero_grad()
        out = fn(x)
        out.float().square().sum().backward()
        results.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
    assert spy.call_count == 2, "eager and compiled forward both ran the provider"
    for eager, comp in zip(*results, strict=True):
        assert ((comp.float() - eager.float()).norm() / eager.float().norm()).item() < 2e-2


def test_restore_really_restores(spy):
    """Activate, run (the provider is called), restore: SDPA runs torch's own flash kernel again, with its bits."""
    q, k, v, dout = inputs(2, 4, 2, 128, 128, 64, seed=4)
    sdpa = lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        native = with_grads(sdpa, q, k, v, dout)
        attention.activate_flash_attention_impl(provider.PROVIDER)
        try:
            ours = with_grads(sdpa, q, k, v, dout)
        finally:
            attention.restore_flash_attention_impl()
        assert spy.call_count == 1
        restored = with_grads(sdpa, q, k, v, dout)
    assert spy.call_count == 1, "after restore the provider is not called"
    assert torch.equal(native[0], restored[0]), "after restore SDPA's own forward gives its own bits again"
    for a, b in zip(native, restored, strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    assert_2x_math(ours, q, k, v, dout, is_causal=True, enable_gqa=True)
