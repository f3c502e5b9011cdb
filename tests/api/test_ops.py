"""torch.library.opcheck for the flash_attn_ck ops: fake shapes/strides, schema (declared mutations),
autograd registration (the ops fall through autograd: not differentiable themselves), and eager-vs-AOT
values. Gradients come from the autograd Function around `fwd` (ops.attention): checked here against
the `bwd` op, and compiled against eager in test_compile.py.

CPU: the reference backend in fp32/bf16. GPU (tests/gpu/test_ops_gpu.py): the Triton backend in fp16/bf16.
With dropout every opcheck sub-test still applies: the AOT check reseeds torch's generators before
the eager and the compiled run, and `fwd` draws its rng_state from them, so both runs drop the same
entries; `bwd`/`bwd_out` are deterministic given the rng_state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.library import opcheck

import flash_attn_ck
from cases import OpRecorder
from flash_attn_ck.backends.reference import ReferenceBackend
from flash_attn_ck.core.errors import ArgumentError
from flash_attn_ck.core.options import OPTION_NAMES, AttentionOptions
from flash_attn_ck.ops import _FWD, _Attention, _flatten, _unflatten
from opchecks import (
    BWD_OPTIONS,
    DROPOUT,
    LAYOUTS,
    bwd_inputs,
    fwd_args,
    make_call,
    run_bwd,
    run_bwd_out,
    run_fwd,
    run_fwd_out,
)

ops = torch.ops.flash_attn_ck

# ---- CPU: the reference backend -------------------------------------------------------------------

CPU_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dropout_p", DROPOUT)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fwd_opcheck(layout, dtype, dropout_p):
    # probs alternates with the dtype so each layout sees it present and absent.
    run_fwd(layout, dtype, "cpu", dropout_p, return_probs=dtype == torch.float32, backend="reference")


@pytest.mark.parametrize("dropout_p", DROPOUT)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fwd_out_opcheck(layout, dropout_p):
    run_fwd_out(layout, torch.float32, "cpu", dropout_p, backend="reference")


@pytest.mark.parametrize("dropout_p", DROPOUT)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bwd_opcheck(layout, dtype, dropout_p):
    run_bwd(layout, dtype, "cpu", dropout_p, "reference")


@pytest.mark.parametrize("dropout_p", DROPOUT)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bwd_out_opcheck(layout, dropout_p):
    run_bwd_out(layout, torch.float32, "cpu", dropout_p, "reference")


@pytest.mark.parametrize("layout", ["batch_gqa_d13", "varlen_mqa"])
def test_a_given_rng_state_comes_back_as_a_copy(layout):
    """The forward ops' schema declares no alias of rng_state: with a given one they return a copy (opcheck's schema
    test), and so does the eager call, so mutating what came back leaves the caller's tensor as it was, eager or
    compiled alike."""
    torch.manual_seed(0)
    call = make_call(layout, torch.float32, "cpu", 0.25, False, "reference", requires_grad=False)
    given = torch.tensor([5, 0], dtype=torch.int64)
    opcheck_kwargs = {"rng_state": given}
    for op, args in ((ops.fwd.default, fwd_args(call)),
                     (ops.fwd_out.default, (*fwd_args(call)[:3], torch.randn_like(call["q"]), *fwd_args(call)[3:]))):
        results = opcheck(op, args, opcheck_kwargs, raise_exception=False)
        assert all(result == "SUCCESS" for result in results.values()), results
    q, k, v = (torch.randn(1, 6, 2, 8) for _ in range(3))
    returned = flash_attn_ck.flash_attn_fwd(q, k, v, dropout_p=0.25, rng_state=given, backend="reference")[2]
    assert torch.equal(returned, given) and returned.data_ptr() != given.data_ptr()
    returned.add_(1)
    assert given.tolist() == [5, 0]


def test_only_out_is_differentiable():
    """Gradients flow from `out` into the packed tensor; lse/probs are marked non-differentiable."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3, 2, 13, requires_grad=True)
    out, lse, probs = flash_attn_ck.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad and not probs.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    q, k, v = qkv.detach().unbind(2)
    dq, dk, dv, _ = flash_attn_ck.flash_attn_bwd(dout, q, k, v, out.detach(), lse, causal=True)
    torch.testing.assert_close(qkv.grad, torch.stack([dq, dk, dv], dim=2))


def test_backward_allocates_no_gradient_for_lse(monkeypatch):
    """lse/rng_state/probs take no gradient, so autograd must not build zero gradients for them and
    pass them to the Function's backward (an lse-sized allocation and fill kernel per backward)."""
    received = []
    backward = _Attention.backward

    def spy(ctx, dout, *others):
        received.extend(others)
        return backward(ctx, dout, *others)
    monkeypatch.setattr(_Attention, "backward", staticmethod(spy))
    q, k, v = (torch.randn(2, 9, 2, 16, requires_grad=True) for _ in range(3))
    out, lse, _ = flash_attn_ck.flash_attn_fwd(q, k, v, causal=True)
    dq, _, _ = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert received == [None, None, None], "autograd materialised gradients for lse/rng_state/probs"
    assert dq.abs().sum() > 0


def _attention_grads(causal=True):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 11, 4, 16, requires_grad=True) for _ in range(3))
    k2, v2 = (torch.randn(2, 7, 2, 16, requires_grad=True) for _ in range(2))   # GQA, s_q != s_k
    out, _, _ = flash_attn_ck.flash_attn_fwd(q, k2, v2, causal=causal, dropout_p=0.2)
    return [out.detach(), *torch.autograd.grad(out, (q, k2, v2), torch.randn_like(out))]


def test_eager_calls_bypass_the_dispatcher(monkeypatch):
    """Plain eager mode calls the ops' implementations directly (and the backward reuses the
    forward's validated problem): no dispatcher round trip per call."""
    def refuse(*args, **kwargs):
        raise AssertionError("the op ran in plain eager mode")
    monkeypatch.setattr("flash_attn_ck.ops._fwd_op", refuse)
    monkeypatch.setattr("flash_attn_ck.ops._fwd_out_op", refuse)
    monkeypatch.setattr("flash_attn_ck.ops._bwd_op", refuse)
    grads = _attention_grads()
    assert all(g.abs().sum() > 0 for g in grads)
    q = torch.randn(2, 5, 2, 16)
    out = torch.empty_like(q)
    assert flash_attn_ck.flash_attn_fwd(q, q, q, out=out)[0] is out


def test_dispatch_modes_see_the_ops():
    """Under a dispatch mode (FakeTensorMode, FlopCounterMode, ...) the Function goes through the ops,
    which the mode sees as one op per direction; the values equal the eager (direct) path's."""
    eager = _attention_grads()
    with OpRecorder() as recorder:
        recorded = _attention_grads()
    assert "flash_attn_ck.fwd.default" in recorder.seen and "flash_attn_ck.bwd.default" in recorder.seen
    for a, b in zip(eager, recorded):
        assert torch.equal(a, b)


_VARLEN = dict(cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 2, 5],
                                                                                                  dtype=torch.int32))


@pytest.mark.parametrize("given", [
    dict(),
    dict(causal=1, window_size=[3, np.int64(2)], softcap=1, dropout_p=0, softmax_scale=np.float32(0.5)),
    dict(_VARLEN, max_seqlen_q=np.int64(3), max_seqlen_k=3, alibi_slopes=torch.rand(2), deterministic=1,
         return_attn_probs=True, backend="reference", seqused_k=torch.tensor([1, 3], dtype=torch.int32)),
    dict(_VARLEN, backend=ReferenceBackend()),     # max_seqlen None: flattened as 0
], ids=["defaults", "normalised", "varlen", "instance"])
@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "compiling"])
def test_the_function_rebuilds_its_checked_options_as_the_checks_would(given, compiling, monkeypatch):
    """The Function rebuilds its options from `attention`'s flattening of checked ones without checking them
    again: every field is exactly what the checks make of the same arguments (types included). While dynamo
    traces (torch 2.11 cannot trace the fast copy) the copy goes through the constructor, with the same result."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    flat = _flatten(AttentionOptions(**given), _FWD)
    unchecked, checked = _unflatten(flat, _FWD, checked=True), _unflatten(flat, _FWD)
    for name in OPTION_NAMES:
        a, b = getattr(unchecked, name), getattr(checked, name)
        assert a is b or (type(a), a) == (type(b), b), (name, a, b)


def test_the_ops_check_the_values_they_are_given():
    """Anyone may call the ops with raw values, so they check them (only the Function skips the checks)."""
    call = make_call("batch_bhsd", torch.float32, "cpu", 0.0, False, "reference", requires_grad=False)
    dout, out, lse, _, rng_state = bwd_inputs(call)
    with pytest.raises(ArgumentError, match="dropout_p"):
        ops.fwd(*fwd_args(dict(call, dropout_p=1.5)))
    options = tuple(dict(call, softcap=-1.0)[name] for name in BWD_OPTIONS)
    with pytest.raises(ArgumentError, match="softcap"):
        ops.bwd(dout, call["q"], call["k"], call["v"], out, lse, *options, rng_state, "reference")
