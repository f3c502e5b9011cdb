"""On a CUDA GPU: learnable sinks on the Triton kernels, the one-launch ones and the warp-specialised ones, against
the float64 oracle (docs/semantics.md §Learnable sinks); the CPU tests: tests/api/test_sinks.py."""

from __future__ import annotations

import pytest
import torch

from cases import check_case
from oracle import Config
from sink_cases import BASE, CASES, SINK_DTYPES

# ---- on a GPU: the Triton kernels, the one-launch ones and the warp-specialised ones -------------------------

# Long enough, at d64/d128, for the plan to take the warp-specialised forward and backward.
GLUON_CASES = {
    "d128_gqa_causal": dict(batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=8, heads_k=2, head_dim=128, causal=True),
    "d64_gqa": dict(batch=1, seqlen_q=2048, seqlen_k=2048, heads_q=8, heads_k=1, head_dim=64),
    "d128_window": dict(batch=1, seqlen_q=1024, seqlen_k=1536, heads_q=4, heads_k=4, head_dim=128, window=(256, 0)),
    "d128_varlen": dict(batch=3, seqlen_q=1024, seqlen_k=1024, heads_q=8, heads_k=2, head_dim=128, causal=True,
                        seqlens=[(700, 1024), (0, 300), (1024, 513)]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sink", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES) + sorted(GLUON_CASES))
def test_triton_kernels_on_the_gpu_with_a_sink(name, sink):
    fields = {**BASE, **CASES[name]} if name in CASES else GLUON_CASES[name]
    check_case(Config(**fields, sink_dtype=SINK_DTYPES[sink], dtype=torch.bfloat16), backend="triton", device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_deterministic_with_a_sink_is_bit_identical_on_the_gpu():
    cfg = Config(**GLUON_CASES["d128_varlen"], deterministic=True, sink_dtype=torch.float32, dtype=torch.bfloat16)
    (out_a, grads_a), (out_b, grads_b) = (check_case(cfg, backend="triton", device="cuda") for _ in range(2))
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


# ---- fwd_ws taking the sink in its epilogue (operators.FwdWs.takes_sink) ---------------------------------------

def _sinks_given_to_fwd_ws(monkeypatch) -> list:
    """The sinks fwd_ws's launches were given (each must be the call's, not None)."""
    from flash_attn_ck.backends.triton.gluon import fwd_ws
    given, real = [], fwd_ws.launch
    monkeypatch.setattr(fwd_ws, "launch", lambda *args, **kwargs: (given.append(kwargs["sink"]), real(*args, **kwargs)))
    return given


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(GLUON_CASES))
def test_fwd_ws_with_the_sink_in_its_kernel_on_the_gpu(monkeypatch, name):
    import flash_attn_ck as fa
    from flash_attn_ck.backends.triton import TritonBackend
    given = _sinks_given_to_fwd_ws(monkeypatch)
    # A fresh backend: the registered one keeps each problem's recorded launches (runtime/replay.py), and a worker
    # that ran this shape with the fold before would replay fwd_ws without the sink.
    with fa.use_backend(TritonBackend()):
        check_case(Config(**GLUON_CASES[name], sink_dtype=torch.bfloat16, dtype=torch.bfloat16), backend="triton",
                   device="cuda")
    assert given and all(sink is not None for sink in given), "fwd_ws ran the forward with the sink"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fwd_ws_takes_special_sinks_as_the_fold_does_on_the_gpu(monkeypatch):
    """Sinks of +-inf, far above and below the scores and NaN, rows without keys (an empty sequence): fwd_ws's
    in-kernel sink gives the out and lse that the fold around it gives."""
    import flash_attn_ck as fa
    from flash_attn_ck.backends.triton import TritonBackend
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [(700, 1024), (0, 300), (1024, 0), (513, 513)]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor([pair[i] for pair in lengths]).cumsum(0).tolist()],
                               dtype=torch.int32, device="cuda") for i in (0, 1))
    q = torch.randn(int(cu_q[-1]), 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(int(cu_k[-1]), 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    sink = torch.tensor([float("-inf"), float("inf"), 60.0, -60.0, float("nan"), 0.0, 2.0, -2.0], device="cuda")

    def forward():
        return fa.flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1024, max_seqlen_k=1024,
                                 causal=True, learnable_sink=sink, backend=TritonBackend())[:2]
    folded_out, folded_lse = forward()
    given = _sinks_given_to_fwd_ws(monkeypatch)
    out, lse = forward()
    assert given and all(s is not None for s in given), "fwd_ws ran the forward with the sink"
    for name, ours, folded in (("lse", lse, folded_lse), ("out", out.float(), folded_out.float())):
        assert torch.equal(ours.isnan(), folded.isnan()), name
        assert torch.equal(ours.isinf() & (ours > 0), folded.isinf() & (folded > 0)), name
    finite = lse.isfinite()
    torch.testing.assert_close(lse[finite], folded_lse[finite], atol=1e-4, rtol=1e-5)
    # the fold rounds out twice (kernel and fold), the kernel once: within a bf16 ulp of each other
    torch.testing.assert_close(out.float().nan_to_num(), folded_out.float().nan_to_num(), atol=1e-2, rtol=1e-2)
