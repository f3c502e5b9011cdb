"""ROCm GPU tests of the CK backend: the public API with backend="ck" against the float64 oracle
of tests/oracle.py under the 2x rule (docs/semantics.md §Correctness), as the other backends' GPU tests do.

Skipped unless torch is a ROCm build with a visible GPU and the CK library loads (the Docker
image builds it). These tests have never run in this project's CI: no AMD GPU exists there.
CK draws its own dropout pattern (not the project's Philox layout), so dropout is checked by
properties that hold for any pattern instead of against the oracle.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.rocm
if torch.version.hip is None or not torch.cuda.is_available():
    pytest.skip("needs a ROCm build of torch and an AMD GPU", allow_module_level=True)

import flash_attn_ck as fa  # noqa: E402
from flash_attn_ck.backends.ck import CkBackend  # noqa: E402

if CkBackend.unavailable_reason():
    pytest.skip(f"CK backend unavailable: {CkBackend.unavailable_reason()}", allow_module_level=True)

from cases import (  # noqa: E402
    COMMON_FEATURES,
    FEATURE_BASE,
    HEAD_DIMS,
    check_case,
    check_mask_kind,
    feature_case,
    head_dim_case,
    make_inputs,
    mask_kind_grid,
    run_ours,
)
from oracle import Config  # noqa: E402

CK_HEAD_DIMS = [d for d in HEAD_DIMS if d >= 32]   # the grid the CK tests were written for


def _check(cfg: Config, seed: int = 0):
    return check_case(cfg, backend="ck", device="cuda", seed=seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", CK_HEAD_DIMS)
def test_head_dims(head_dim, dtype):
    _check(head_dim_case(head_dim, dtype))


FEATURES = {
    **COMMON_FEATURES,
    "alibi_window": dict(alibi=True, window=(40, 3)),
    "deterministic_gqa": dict(deterministic=True, heads_q=6, heads_k=2, causal=True),
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_features(name, head_dim):
    _check(feature_case(FEATURES[name], head_dim))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind,seqlens", mask_kind_grid(CkBackend.mask_kinds))
def test_every_declared_mask_kind_matches_the_oracle(kind, seqlens, head_dim):
    check_mask_kind(CkBackend(), kind, seqlens, device="cuda", head_dim=head_dim)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_empty_sequences(causal, deterministic):
    seqlens = [(37, 80), (0, 50), (130, 9), (64, 0), (1, 1), (0, 0), (200, 211)]
    _check(Config(seqlens=seqlens, heads_q=4, heads_k=2, head_dim=96, causal=causal, deterministic=deterministic))


@pytest.mark.parametrize("varlen", [False, True])
def test_deterministic_backward_is_bit_identical(varlen):
    cfg = Config(**FEATURE_BASE, head_dim=128, deterministic=True, causal=True,
                 seqlens=[(300, 257), (129, 400)] if varlen else None)
    q, k, v, dout, slopes = make_inputs(cfg, "cuda")
    first = run_ours(cfg, q, k, v, dout, slopes, backend="ck")[3]
    for _ in range(3):
        again = run_ours(cfg, q, k, v, dout, slopes, backend="ck")[3]
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("heads_k", [4, 2])
def test_dropout_forward_and_backward_share_the_pattern(heads_k):
    """out is linear in v (out = A v, A the dropped and rescaled probabilities) and dv = A^T dout,
    so sum(out * dout) == sum(v * dv) only when both passes draw the same keep pattern."""
    cfg = Config(**{**FEATURE_BASE, "heads_k": heads_k}, head_dim=64, dropout_p=0.3, dtype=torch.float16)
    q, k, v, dout, _ = make_inputs(cfg, "cuda")
    out, lse, rng_state = fa.flash_attn_fwd(q, k, v, dropout_p=cfg.dropout_p, backend="ck")
    dv = fa.flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=cfg.dropout_p, rng_state=rng_state, backend="ck")[2]
    forward_side = (out.double() * dout.double()).sum()
    backward_side = (v.double() * dv.double()).sum()
    assert torch.allclose(forward_side, backward_side, rtol=2e-2), (forward_side, backward_side)
    # The same rng_state replays the same pattern (dv has no atomics: bit-identical).
    again = fa.flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=cfg.dropout_p, rng_state=rng_state, backend="ck")[2]
    assert torch.equal(dv, again)


def test_dropout_mean_is_preserved():
    """Kept probabilities are scaled by 1/(1-p): with v = 1 every output stays 1 on average."""
    cfg = Config(batch=4, seqlen_q=256, seqlen_k=256, heads_q=8, heads_k=8, head_dim=64, dropout_p=0.25,
                 dtype=torch.bfloat16)
    q, k, _, _, _ = make_inputs(cfg, "cuda")
    v = torch.ones_like(k)
    out = fa.flash_attn_func(q, k, v, dropout_p=cfg.dropout_p, backend="ck")
    assert abs(out.float().mean().item() - 1.0) < 0.01


def test_softcap_is_refused():
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(fa.NoBackendError, match="softcap"):
        fa.flash_attn_func(q, q, q, softcap=5.0, backend="ck")


def test_runs_on_the_current_stream():
    cfg = Config(**FEATURE_BASE, head_dim=128, causal=True)
    q, k, v, dout, slopes = make_inputs(cfg, "cuda")
    expected = fa.flash_attn_func(q, k, v, causal=True, backend="ck")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = fa.flash_attn_func(q, k, v, causal=True, backend="ck")
    stream.synchronize()
    assert torch.equal(expected, got)
