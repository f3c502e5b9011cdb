"""GPU tests of the Triton backend (skipped without CUDA): the feature grid through the public API
(backend="triton") against the float64 oracle of tests/oracle.py under the 2x rule (docs/semantics.md), both GQA
epilogues, both dQ modes, varlen with empty sequences, and bit-identical deterministic repeats."""

from __future__ import annotations

import pytest
import torch

from cases import COMMON_FEATURES, HEAD_DIMS, check_case, feature_case, head_dim_case, make_inputs, run_ours
from oracle import Config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flash_attn_ck.backends import base  # noqa: E402
from flash_attn_ck.backends.triton import TritonBackend  # noqa: E402


# The test shapes are short (config.SHORT_SEQLEN), where the defaults move tiles by pointers; the
# use_tma=True rows force TMA loads, stores and bulk reduce-adds so that those paths are tested too.
@pytest.fixture(params=[dict(), dict(dq_mode="pass"), dict(gqa_epilogue="accumulate"), dict(dq_mode="atomic"),
                        dict(use_tma=True), dict(use_tma=True, gqa_epilogue="accumulate")],
                ids=["defaults", "loop-pass", "accumulate", "atomic-dq", "tma", "tma-accumulate"])
def backend_options(request):
    """Install a TritonBackend with the given options as the one the dispatcher hands out."""
    saved = base._instances.get("triton")
    base._instances["triton"] = TritonBackend(**request.param)
    yield request.param
    if saved is None:
        base._instances.pop("triton", None)
    else:
        base._instances["triton"] = saved


def _check(cfg: Config, seed: int = 0):
    check_case(cfg, backend="triton", device="cuda", seed=seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims(head_dim, dtype):
    _check(head_dim_case(head_dim, dtype))


FEATURES = {
    **COMMON_FEATURES,
    "softcap": dict(softcap=8.0),
    "alibi_softcap_window": dict(alibi=True, softcap=5.0, window=(40, 3)),
    "dropout": dict(dropout_p=0.17),
    "dropout_causal_gqa": dict(dropout_p=0.3, causal=True, heads_q=6, heads_k=2),
}



@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_features(name, head_dim):
    _check(feature_case(FEATURES[name], head_dim))


@pytest.mark.parametrize("name", ["mqa_causal", "window", "alibi_softcap_window", "dropout_causal_gqa"])
def test_features_other_modes(name, backend_options):
    _check(feature_case(FEATURES[name], 80))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_empty_sequences(causal, backend_options):
    seqlens = [(37, 80), (0, 50), (130, 9), (64, 0), (1, 1), (0, 0), (200, 211)]
    cfg = Config(seqlens=seqlens, heads_q=4, heads_k=2, head_dim=96, causal=causal)
    out, (dq, dk, dv) = check_case(cfg, backend="triton", device="cuda")
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    # the keys of the sequence without queries (rows 80..130) get zero gradients
    assert dk[80:130].abs().max() == 0 and dv[80:130].abs().max() == 0


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("options", [dict(), dict(gqa_epilogue="accumulate"),
                                     dict(gqa_epilogue="accumulate", use_tma=True)],
                         ids=["loop", "accumulate", "accumulate-tma"])
def test_deterministic_bit_identical(options, varlen):
    saved = base._instances.get("triton")
    base._instances["triton"] = TritonBackend(**options)
    try:
        seqlens = [(700, 900), (0, 64), (1024, 1024)] if varlen else None
        cfg = Config(batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=16, heads_k=2, head_dim=128, causal=False,
                     deterministic=True, seqlens=seqlens)
        q, k, v, dout, slopes = make_inputs(cfg, "cuda", seed=3)
        first = run_ours(cfg, q, k, v, dout, slopes, backend="triton")[3]
        for _ in range(20):
            again = run_ours(cfg, q, k, v, dout, slopes, backend="triton")[3]
            for a, b in zip(first, again):
                assert torch.equal(a, b)
    finally:
        base._instances["triton"] = saved if saved is not None else TritonBackend()


def test_plan_names_every_buffer():
    from flash_attn_ck.frontend.mask import MaskInfo
    from flash_attn_ck.frontend.problem import AttentionProblem
    mask = MaskInfo.from_flash_args(True, (-1, -1), 8192, 8192)
    p = AttentionProblem(2, 8192, 8192, 32, 8, 128, torch.bfloat16, torch.device("cuda"), mask, 0.088,
                         deterministic=True)
    loop = TritonBackend().backward_plan(p)
    assert [b.name for b in loop.buffers] == ["softmax_d"] and not loop.reduce_expanded_kv
    acc = TritonBackend(gqa_epilogue="accumulate").backward_plan(p)
    assert [b.name for b in acc.buffers] == ["softmax_d", "dk_accum", "dv_accum", "dkv_semaphore"]
    assert acc.buffers[1].shape == (2, 8, 8192, 128)
