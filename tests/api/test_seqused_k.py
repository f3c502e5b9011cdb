"""`seqused_k` (varlen): sequence i attends only its first `seqused_k[i]` keys.

The rule, on every backend: a call with seqused_k equals the same call on K/V truncated to the used rows
(cu_seqlens_k rebuilt from seqused_k): out, lse and dq, and dk/dv on the used rows; every other key row
gets dk = dv = 0. Drawn by hypothesis over varlen layouts (empty sequences, seqused_k 0 and full, rows
after the last sequence, GQA, causal/window/no mask, batch ALiBi slopes). The `check_*` functions take a
backend and a dtype: the reference runs them here in float64, the emulated CK backend in
tests/ck/test_ck_emulated.py, the Triton kernels under TRITON_INTERPRET=1 in one subprocess below.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_edge_cases import NAN, SETTINGS, _tol

import flash_attn_ck as fa
from flash_attn_ck.core.inputs import call_signature
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.pipeline.prepare import CALLS
from oracle import naive_attention


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(lengths, extra_q, extra_k, heads, dtype, head_dim=16, seed=3):
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(s for s, _ in lengths) + extra_q, sum(s for _, s in lengths) + extra_k
    h, h_k = heads
    q, dout = (torch.randn(total_q, h, head_dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(total_k, h_k, head_dim, generator=gen).to(dtype) for _ in range(2))
    slopes = torch.rand(len(lengths), h, generator=gen) * 0.5
    return q, k, v, dout, slopes


def _used_rows(cu_k: torch.Tensor, used) -> torch.Tensor:
    """The packed key rows the sequences use, in order."""
    return torch.cat([torch.arange(int(cu_k[i]), int(cu_k[i]) + n) for i, n in enumerate(used)])


def check_seqused_k(backend="reference", dtype=torch.float64, lengths=((3, 5), (0, 4), (4, 6), (2, 0)),
                    used=(3, 2, 0, 0), extra_q=1, extra_k=2, heads=(4, 2), causal=True, window=(-1, -1), alibi=False,
                    probs=False):
    """The rule of the module docstring, forward and backward (given dq/dk/dv filled with NaN first: every row is
    written). `probs`: also compare return_attn_probs (backends that draw the reference keep pattern)."""
    q, k, v, dout, slopes = _inputs(lengths, extra_q, extra_k, heads, dtype)
    cu_q, cu_k = _offsets(s for s, _ in lengths), _offsets(s for _, s in lengths)
    common = dict(cu_seqlens_q=cu_q, max_seqlen_q=max(s for s, _ in lengths), max_seqlen_k=max(s for _, s in lengths),
                  causal=causal, window_size=window, alibi_slopes=slopes if alibi else None, backend=backend)
    seqused_k = torch.tensor(used, dtype=torch.int32)
    ours = fa.flash_attn_fwd(q, k, v, cu_seqlens_k=cu_k, seqused_k=seqused_k, return_attn_probs=probs, **common)
    grads = [torch.full_like(t, NAN) for t in (q, k, v)]
    fa.flash_attn_bwd(dout, q, k, v, ours[0], ours[1], *grads, cu_seqlens_k=cu_k, seqused_k=seqused_k, **common)

    rows = _used_rows(cu_k, used)
    k_used, v_used, cu_used = k[rows], v[rows], _offsets(used)
    expected = fa.flash_attn_fwd(q, k_used, v_used, cu_seqlens_k=cu_used, return_attn_probs=probs, **common)
    dq, dk_used, dv_used, _ = fa.flash_attn_bwd(dout, q, k_used, v_used, expected[0], expected[1],
                                                cu_seqlens_k=cu_used, **common)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[rows], dv[rows] = dk_used, dv_used
    # Equal, not close: each sequence walks the same keys in the same tiles either way (keys past its end are
    # masked to exactly 0), so only the sequence's index differs, which nothing but dropout reads.
    pairs = [("out", ours[0], expected[0]), ("lse", ours[1], expected[1]), ("dq", grads[0], dq), ("dk", grads[1], dk),
             ("dv", grads[2], dv)]
    if probs:       # the probs' key columns are min(max_seqlen_k, total_k): fewer for the truncated K
        width = expected[3].shape[-1]
        assert not ours[3][..., width:].any()
        pairs.append(("probs", ours[3][..., :width], expected[3]))
    for name, got, want in pairs:
        assert torch.equal(got, want), f"{name}: max difference {(got.double() - want.double()).abs().max()}"


def check_seqused_k_dropout(backend="reference", dtype=torch.float64, lengths=((5, 9), (0, 3), (7, 7)), used=(6, 2, 7),
                            p=0.3):
    """With dropout the kernels draw sequence i's keep pattern at index 2i (they run 2b sequences,
    core/inputs.py): forward and backward against the float64 oracle with that pattern."""
    heads = (4, 2)
    q, k, v, dout, _ = _inputs(lengths, 0, 0, heads, dtype)
    cu_q, cu_k = _offsets(s for s, _ in lengths), _offsets(s for _, s in lengths)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(s for s, _ in lengths),
                  max_seqlen_k=max(s for _, s in lengths), seqused_k=torch.tensor(used, dtype=torch.int32),
                  causal=True, dropout_p=p, backend=backend)
    out, lse, rng_state = fa.flash_attn_fwd(q, k, v, **varlen)
    dq, dk, dv, _ = fa.flash_attn_bwd(dout, q, k, v, out, lse, **varlen, rng_state=rng_state)
    for i, n in enumerate(used):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i]) + n)
        qi, ki, vi = (t.double().requires_grad_() for t in (q[rq], k[rk], v[rk]))
        ref, _ = naive_attention(qi, ki, vi, causal=True, dropout_p=p, rng_state=rng_state, batch_index=2 * i,
                                 heads=heads[0])
        ref_grads = torch.autograd.grad(ref, (qi, ki, vi), dout[rq].double())
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out[rq], dq[rq], dk[rk], dv[rk]), (ref, *ref_grads)):
            torch.testing.assert_close(got.double(), want.detach(), **_tol(dtype), msg=name)
        unused = slice(int(cu_k[i]) + n, int(cu_k[i + 1]))
        assert (dk[unused] == 0).all() and (dv[unused] == 0).all()


@st.composite
def seqused_layouts(draw):
    """check_seqused_k's keywords: 1-3 sequences, each side 0..6 rows, seqused_k 0, full or in between."""
    lengths = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=3))
    used = [draw(st.one_of(st.just(0), st.just(s_k), st.integers(0, s_k))) for _, s_k in lengths]
    mask = draw(st.sampled_from(["none", "causal", "window"]))
    window = (draw(st.integers(-1, 4)), draw(st.integers(-1, 3))) if mask == "window" else (-1, -1)
    return dict(lengths=lengths, used=used, extra_q=draw(st.integers(0, 2)), extra_k=draw(st.integers(0, 2)),
                heads=draw(st.sampled_from([(2, 2), (4, 2), (3, 1)])), causal=mask == "causal", window=window,
                alibi=draw(st.booleans()))


@settings(max_examples=60, **SETTINGS)
@given(layout=seqused_layouts())
def test_seqused_k_equals_truncated_keys(layout):
    check_seqused_k("reference", torch.float64, **layout, probs=True)


def test_seqused_k_with_dropout():
    check_seqused_k_dropout("reference", torch.float64)


def test_varlen_func_gradients_through_autograd():
    """flash_attn_varlen_func(seqused_k=) differentiates into the truncated call's gradients (unused keys: 0)."""
    lengths, used = ((4, 7), (3, 2), (5, 5)), (3, 0, 5)
    q, k, v, dout, _ = _inputs(lengths, 0, 0, (4, 2), torch.float64)
    cu_q, cu_k = _offsets(s for s, _ in lengths), _offsets(s for _, s in lengths)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=True,
                                    seqused_k=torch.tensor(used, dtype=torch.int32))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    rows = _used_rows(cu_k, used)
    k_used, v_used = (t.detach()[rows].requires_grad_() for t in (k, v))
    q_again = q.detach().requires_grad_()
    expected = fa.flash_attn_varlen_func(q_again, k_used, v_used, cu_q, _offsets(used), 5, 7, causal=True)
    dq, dk_used, dv_used = torch.autograd.grad(expected, (q_again, k_used, v_used), dout)
    unused = torch.ones(k.shape[0], dtype=torch.bool)
    unused[rows] = False
    assert torch.equal(out, expected) and torch.equal(grads[0], dq)
    for got, want in ((grads[1], dk_used), (grads[2], dv_used)):
        assert torch.equal(got[rows], want) and not got[unused].any()


def test_a_changed_seqused_k_signature_misses():
    """The memoised problem depends on seqused_k (2b sequences, its checks): a call that differs only in
    seqused_k's presence, dtype or shape must not reuse another's problem."""
    lengths = ((3, 4), (2, 5))
    q, k, v, _, _ = _inputs(lengths, 0, 0, (2, 2), torch.float64)
    cu_q, cu_k = _offsets(s for s, _ in lengths), _offsets(s for _, s in lengths)

    def call(seqused_k):
        return fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, seqused_k=seqused_k)

    def signature(seqused_k):
        return call_signature(q, k, v, AttentionOptions(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3,
                                                        max_seqlen_k=5, seqused_k=seqused_k))

    used = torch.tensor([2, 5], dtype=torch.int32)
    assert len({signature(None), signature(used), signature(used.long()), signature(used[:1])}) == 4
    CALLS.clear()
    truncated = call(used)
    full = call(None)
    assert CALLS.misses == 2 and CALLS.hits == 0
    assert not torch.equal(truncated, full)
    assert torch.equal(call(torch.tensor([4, 5], dtype=torch.int32)), full)     # same signature, all keys
    assert CALLS.hits == 1
    for bad, message in ((used.long(), "expected dtype int32"), (used[:1], r"expected shape \(2,\)"),
                         (torch.tensor([2, 6], dtype=torch.int32), "expected each value")):
        with pytest.raises(fa.ArgumentError, match=f"^seqused_k: {message}"):
            call(bad)


# ---- the same checks on the Triton kernels, interpreted ---------------------------------------------

_TRITON_RUNNER = r"""
import torch
from flash_attn_ck.backends.triton import TritonBackend
TritonBackend.device_types = frozenset({"cuda", "cpu"})
import test_seqused_k as t
from hypothesis import given, settings
half = torch.float16
t.check_seqused_k("triton", half, probs=True)
t.check_seqused_k("triton", half, ((9, 20), (0, 5), (17, 17)), (20, 3, 0), 1, 0, (4, 1), False, (3, 2), alibi=True)
t.check_seqused_k_dropout("triton", half)
@settings(max_examples=5, database=None, **t.SETTINGS)
@given(layout=t.seqused_layouts())
def layouts(layout):
    t.check_seqused_k("triton", half, **layout)
layouts()
print("PASS")
"""


def test_triton_interpreter():
    pytest.importorskip("triton")
    from test_triton_interpret import _INTERPRETER_PATCH, _interpret
    _interpret(_INTERPRETER_PATCH + _TRITON_RUNNER, "")
