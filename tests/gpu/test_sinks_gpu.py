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
