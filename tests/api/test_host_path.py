"""The host path's memo (pipeline/prepare.py, pipeline/chunking.py's plans): a repeated call recomputes
nothing that depends on its signature alone, a call whose signature differs in any one field recomputes
(a wrong key would be a silent wrong answer), and the checks on values still run on every call.

CPU, reference backend. The GPU half (no host-device sync on the Triton path) is at the end (skips
without CUDA)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flash_attn_ck as fa
from cases import OpRecorder
from flash_attn_ck import ops as flash_attn_ck_ops
from flash_attn_ck.core.errors import ArgumentError, NoBackendError
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.pipeline import chunking, prepare, select


@pytest.fixture
def counted(monkeypatch):
    """Counts of the signature-only work: describing (validating) a call, choosing its backend, planning."""
    counts = dict(describe=0, choose=0, plan=0)

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(prepare, "describe_call", counting("describe", prepare.describe_call))
    monkeypatch.setattr(select, "_choose", counting("choose", select._choose))
    monkeypatch.setattr(chunking, "_plan_chunks", counting("plan", chunking._plan_chunks))
    monkeypatch.delenv(select.BACKEND_ENV, raising=False)
    monkeypatch.delenv(chunking.WORKSPACE_ENV, raising=False)
    prepare.CALLS.clear()
    return counts


def _qkv(b=2, s=9, h=2, d=16, dtype=torch.float32, requires_grad=True):
    return [torch.randn(b, s, h, d, dtype=dtype, requires_grad=requires_grad) for _ in range(3)]


def _step(q, k, v, **options):
    out = fa.flash_attn_func(q, k, v, **options)
    return out, torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_a_repeated_call_recomputes_nothing(counted, varlen):
    """Forward + backward twice with the same signature (new tensors, new values): the second describes,
    chooses and plans nothing, and its results are its own (not the first call's)."""
    def step(seed):
        torch.manual_seed(seed)
        if not varlen:
            return _step(*_qkv(), causal=True)
        q, k, v = (torch.randn(12, 2, 16, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        out = fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
        return out, torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    first = step(0)
    after_first = dict(counted)
    assert after_first["describe"] == 1 and after_first["choose"] == 1 and after_first["plan"] == 1
    second = step(1)
    assert counted == after_first, "the second call of one signature recomputed signature-only work"
    assert prepare.CALLS.hits >= 1
    assert not torch.equal(first[0], second[0])


# ---- each field of the signature, changed alone, misses ---------------------------------------------

def _base(b, s, h, d):
    torch.manual_seed(b * 100 + s)
    return dict(q=torch.randn(b, s, h, d), k=torch.randn(b, s, h, d), v=torch.randn(b, s, h, d), options={})


def _varlen_base(s, h, d):
    cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
    total = 2 * s
    return dict(q=torch.randn(total, h, d), k=torch.randn(total, h, d), v=torch.randn(total, h, d),
                options=dict(cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=s, max_seqlen_k=s))


def _strided_like(t):
    """t's values and shape with other strides (a permuted dense buffer), last dim still contiguous."""
    return t.transpose(-2, -3).contiguous().transpose(-2, -3)


# Options whose changed value is the same for every call.
_OPTION_CHANGES = dict(causal=True, window_size=(1, 0), softcap=3.0, dropout_p=0.25, softmax_scale=0.3,
                       deterministic=True)


def _change(call: dict, field: str) -> dict:
    """`call` with exactly one field of its signature changed (values of unchanged tensors are kept)."""
    c = dict(call, options=dict(call["options"]))
    if field in _OPTION_CHANGES:
        c["options"][field] = _OPTION_CHANGES[field]
    elif field in _OPERAND_CHANGES:
        _OPERAND_CHANGES[field](c)
    elif field in ("stride_q", "stride_k", "stride_v"):
        name = field[-1]
        c[name] = _strided_like(c[name])
    else:
        _change_sequence_option(c, field)
    return c


def _longer_keys(c: dict) -> None:
    grow = lambda t: torch.cat([t, t.narrow(-3, 0, 1)], dim=-3)
    c["k"], c["v"] = grow(c["k"]), grow(c["v"])
    o = c["options"]
    if "cu_seqlens_k" in o:
        o["cu_seqlens_k"] = o["cu_seqlens_k"].clone()
        o["cu_seqlens_k"][-1] += 1


def _on_meta(c: dict) -> None:
    c["q"], c["k"], c["v"] = (c[name].to("meta") for name in "qkv")
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if name in c["options"]:
            c["options"][name] = c["options"][name].to("meta")


def _replace(**made):
    """A change that replaces the named operands by functions of them."""
    def change(c: dict) -> None:
        c.update({name: make(c[name]) for name, make in made.items()})
    return change


_OPERAND_CHANGES = dict(
    seqlen_k=_longer_keys,
    heads_k=_replace(k=lambda t: t.narrow(-2, 0, 1), v=lambda t: t.narrow(-2, 0, 1)),
    head_dim=_replace(**{name: lambda t: t[..., :-1] for name in "qkv"}),
    dtype=_replace(**{name: lambda t: t.double() for name in "qkv"}),
    device=_on_meta,
)


def _change_sequence_option(c: dict, field: str) -> None:
    """ALiBi slopes and the varlen options."""
    o = c["options"]
    varlen = "cu_seqlens_q" in o
    if field == "alibi":
        o["alibi_slopes"] = torch.rand(c["q"].shape[-2])
    elif field == "max_seqlen_q":
        o["max_seqlen_q"] = o["max_seqlen_q"] - 1 if varlen else None
    elif field == "cu_seqlens_stride":
        o["cu_seqlens_q"] = torch.stack([o["cu_seqlens_q"]] * 2, dim=1)[:, 0]      # same values, stride 2
    else:
        raise AssertionError(field)


DENSE_FIELDS = ("seqlen_k", "heads_k", "head_dim", "stride_q", "stride_k", "stride_v", "dtype", "device", "causal",
                "window_size", "softcap", "dropout_p", "softmax_scale", "deterministic", "alibi")
VARLEN_FIELDS = (*DENSE_FIELDS, "max_seqlen_q", "cu_seqlens_stride")


def _prepared(call: dict):
    """(problem or the error's message, whether the memo missed)."""
    misses = prepare.CALLS.misses
    try:
        problem = prepare.prepare(call["q"], call["k"], call["v"], AttentionOptions(**call["options"])).problem
    except ArgumentError as error:
        problem = f"ArgumentError: {error}"
    return problem, prepare.CALLS.misses == misses + 1


def _fresh(call: dict):
    try:
        return describe_call(call["q"], call["k"], call["v"], AttentionOptions(**call["options"]))
    except ArgumentError as error:
        return f"ArgumentError: {error}"


@pytest.mark.parametrize("varlen, field", [(False, f) for f in DENSE_FIELDS] + [(True, f) for f in VARLEN_FIELDS])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 3), s=st.integers(2, 9), h=st.sampled_from([2, 4]), d=st.sampled_from([8, 16]))
def test_each_signature_field_changed_alone_misses(counted, varlen, field, b, s, h, d):
    """After a call is memoised, the same call with any one signature field changed misses, and what it gets
    (a problem, or the error a bad signature raises) is what a fresh description gives."""
    prepare.CALLS.clear()       # hypothesis runs every example in one fixture
    base = _varlen_base(s, h, d) if varlen else _base(b, s, h, d)
    problem, missed = _prepared(base)
    assert problem == _fresh(base)
    _, missed_again = _prepared(base)
    assert not missed_again, "the same signature missed"
    variant = _change(base, field)
    problem, missed = _prepared(variant)
    assert missed, f"{field} changed alone hit the memo of another signature"
    assert problem == _fresh(variant)


def _change_tensor_option(call: dict, field: str) -> dict:
    """`call` (varlen) with exactly one field of its tensor options or their bounds changed: the part of the
    signature that follows q, k, v and the scalar options (core.inputs.call_signature)."""
    c = dict(call, options=dict(call["options"]))
    o, heads = c["options"], call["q"].shape[-2]
    batch = o["cu_seqlens_q"].numel() - 1
    lengths_k = o["cu_seqlens_k"].diff()
    if field == "cu_seqlens_k_stride":
        o["cu_seqlens_k"] = torch.stack([o["cu_seqlens_k"]] * 2, dim=1)[:, 0]
    elif field == "cu_seqlens_q_dtype":
        o["cu_seqlens_q"] = o["cu_seqlens_q"].long()
    elif field == "seqused_k":
        o["seqused_k"] = lengths_k.to(torch.int32)
    elif field == "alibi_per_batch":      # with (h,) slopes in the base call: (b, h) ones instead
        o["alibi_slopes"] = o["alibi_slopes"].expand(batch, heads).contiguous()
    elif field == "alibi_absent":
        del o["alibi_slopes"]
    elif field == "max_seqlen_k":
        o["max_seqlen_k"] = o["max_seqlen_k"] + 1
    elif field == "out_dtype":
        o["out_dtype"] = torch.float32
        c["q"], c["k"], c["v"] = (t.to(torch.bfloat16) for t in (c["q"], c["k"], c["v"]))
        c["base_dtype"] = torch.bfloat16
    else:
        raise AssertionError(field)
    return c


TENSOR_OPTION_FIELDS = ("cu_seqlens_k_stride", "cu_seqlens_q_dtype", "seqused_k", "alibi_per_batch", "alibi_absent",
                        "max_seqlen_k", "out_dtype")


@pytest.mark.parametrize("field", TENSOR_OPTION_FIELDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=st.integers(2, 9), h=st.sampled_from([2, 4]), d=st.sampled_from([8, 16]))
def test_each_tensor_option_changed_alone_misses(counted, field, s, h, d):
    """The signature's tail (the tensor options, present only where some is given, and their bounds): after a varlen
    call with ALiBi slopes is memoised, the same call with one of them changed alone misses, and gets what a fresh
    description gives; `out_dtype` is compared on bf16 inputs, with and without it."""
    prepare.CALLS.clear()
    base = _varlen_base(s, h, d)
    base["options"]["alibi_slopes"] = torch.rand(h)
    variant = _change_tensor_option(base, field)
    if "base_dtype" in variant:       # out_dtype is checked against q's dtype: the base call has q's dtype too
        base = dict(base, **{name: variant[name] for name in ("q", "k", "v")})
        del variant["base_dtype"]
    problem, _ = _prepared(base)
    assert problem == _fresh(base)
    assert not _prepared(base)[1], "the same signature missed"
    problem, missed = _prepared(variant)
    assert missed, f"{field} changed alone hit the memo of another signature"
    assert problem == _fresh(variant)


_UNDIFFERENTIABLE = (("out", True, None, "out: the forward into a given out is not differentiable"),
                     ("out_dtype", False, torch.float32, "out_dtype: results in float32, not q's dtype, are not "
                                                         "differentiable"),
                     ("both", True, torch.float32, "out_dtype: results in float32, not q's dtype, are not "
                                                   "differentiable"))


@pytest.mark.parametrize("given_out, out_dtype, message, grad_of", [
    pytest.param(given_out, out_dtype, message, grad_of, id=f"{what}-{grad_of}")
    for what, given_out, out_dtype, message in _UNDIFFERENTIABLE
    for grad_of in ("q", "alibi_slopes", "out") if given_out or grad_of != "out"])     # out requires grad if given
def test_a_memo_hit_still_refuses_an_undifferentiable_call(counted, given_out, out_dtype, message, grad_of):
    """The API asks whether anything requires grad only where a call could not be differentiated (a given out, an
    out_dtype other than q's): after the same call without grad is memoised, each such call with grad still raises
    the same error (out_dtype's first), before the caller's out is written."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    slopes = torch.rand(2)
    out = torch.full_like(q, 7.0, dtype=out_dtype or q.dtype) if given_out else None
    {"q": q, "alibi_slopes": slopes, "out": out}[grad_of].requires_grad_(True)
    messages = []
    for memoised in (True, False):
        prepare.CALLS.clear()
        if memoised:
            with torch.no_grad():
                fa.flash_attn_fwd(q, k, v, alibi_slopes=slopes, out_dtype=out_dtype, out=out)
            if out is not None:
                out.detach().fill_(7.0)
            assert len(prepare.CALLS.entries) == 1
        with pytest.raises(ArgumentError) as error:
            fa.flash_attn_fwd(q, k, v, alibi_slopes=slopes, out_dtype=out_dtype, out=out)
        if out is not None:
            assert (out == 7.0).all(), "a failing call wrote its out"
        messages.append(str(error.value))
    assert messages[0] == messages[1] and messages[0].startswith(message), messages


def test_values_are_checked_on_every_call(counted):
    """cu_seqlens offsets are values, not signature: bad ones (same shape, dtype, device) after good ones raise."""
    q, k, v = (torch.randn(12, 2, 16) for _ in range(3))
    good = torch.tensor([0, 5, 12], dtype=torch.int32)
    fa.flash_attn_varlen_func(q, k, v, good, good, 7, 7)
    for bad, match in ((torch.tensor([0, 9, 5], dtype=torch.int32), "non-decreasing"),
                       (torch.tensor([0, 1, 12], dtype=torch.int32), "max_seqlen_q")):
        with pytest.raises(ArgumentError, match=match):
            fa.flash_attn_varlen_func(q, k, v, bad, good, 7, 7)
    with pytest.raises(ArgumentError, match="softcap"):
        fa.flash_attn_varlen_func(q, k, v, good, good, 7, 7, softcap=float("nan"))
    assert counted["describe"] == 1


def test_the_environment_is_read_on_every_call(counted, monkeypatch):
    """$FLASH_ATTN_CK_BACKEND and $FLASH_ATTN_CK_MAX_WORKSPACE_BYTES are part of what a memoised call decides."""
    q, k, v = _qkv()
    _step(q, k, v)
    monkeypatch.setenv(select.BACKEND_ENV, "ck")
    with pytest.raises(NoBackendError, match="backend 'ck' cannot run"):
        fa.flash_attn_func(q, k, v)
    monkeypatch.setenv(select.BACKEND_ENV, "reference")
    unchunked = _step(q, k, v)[1]
    peak = fa.backward_workspace(q, k, v, backends=("reference",))["reference"].peak_bytes
    monkeypatch.setenv(chunking.WORKSPACE_ENV, str(peak - 1))      # just below this call's workspace: chunks
    assert len(fa.backward_workspace(q, k, v, backends=("reference",))["reference"].chunks) > 1
    plans = counted["plan"]
    chunked = _step(q, k, v)[1]
    assert counted["plan"] == plans + 1
    for a, b in zip(unchunked, chunked):
        torch.testing.assert_close(a, b)


def test_use_backend_applies_to_memoised_calls(counted):
    """The backend instance is looked up per call: a `use_backend` block after a memoised call runs its instance,
    judged once by its own class (which may take other calls than the registered one)."""
    from flash_attn_ck.backends.reference import ReferenceBackend
    ran = []

    class Spy(ReferenceBackend):
        def forward(self, *args):
            ran.append("forward")
            super().forward(*args)
    q, k, v = _qkv(requires_grad=False)
    fa.flash_attn_func(q, k, v)
    with fa.use_backend(Spy()):
        fa.flash_attn_func(q, k, v)
    assert ran == ["forward"] and counted["choose"] == 2
    with fa.use_backend(Spy()):
        fa.flash_attn_func(q, k, v)
    assert ran == ["forward", "forward"] and counted["choose"] == 2    # the same class: the choice is memoised


# ---- the API on a memo hit: the checks a signature decides are skipped, every other one runs -------------

def _api(call: dict, seed: int = 0):
    """flash_attn_fwd of `call` without grad: (out, lse), or the error's type and message."""
    torch.manual_seed(seed)     # dropout draws its pattern from torch's generator
    try:
        with torch.no_grad():
            return fa.flash_attn_fwd(call["q"], call["k"], call["v"], **call["options"])[:2]
    except (ArgumentError, NoBackendError) as error:
        return f"{type(error).__name__}: {error}"


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("varlen, field", [(False, f) for f in DENSE_FIELDS] + [(True, f) for f in VARLEN_FIELDS])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 3), s=st.integers(2, 9), h=st.sampled_from([2, 4]), d=st.sampled_from([8, 16]))
def test_each_signature_field_changed_alone_misses_through_the_api(counted, varlen, field, b, s, h, d):
    """The API looks the signature up before its own tensor checks (ops.prepared): after a memoised call, the same
    call with any one signature field changed misses there too, and gets what it gets with an empty memo (its
    output, or the error a bad signature raises, e.g. meta tensors)."""
    prepare.CALLS.clear()
    base = _varlen_base(s, h, d) if varlen else _base(b, s, h, d)
    first = _api(base)
    assert not isinstance(first, str)
    hits = prepare.CALLS.hits
    assert _same(_api(base), first) and prepare.CALLS.hits == hits + 1, "the same signature missed"
    got = _api(_change(base, field))
    assert prepare.CALLS.hits == hits + 1, f"{field} changed alone hit the memo of another signature"
    prepare.CALLS.clear()
    assert _same(got, _api(_change(base, field)))


def _bad_calls():
    """(what is wrong, the arguments of flash_attn_fwd of one signature with one bad argument): each good call of
    these shapes is memoised first, so the bad one meets a memo hit wherever its signature is the good one's."""
    def base():
        torch.manual_seed(0)
        return dict(q=torch.randn(2, 5, 2, 16), k=torch.randn(2, 5, 2, 16), v=torch.randn(2, 5, 2, 16), options={})

    def varlen():
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        return dict(q=torch.randn(9, 2, 16), k=torch.randn(9, 2, 16), v=torch.randn(9, 2, 16),
                    options=dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5))

    def with_(make, **changes):
        call = make()
        options = dict(call["options"])
        for name, value in changes.items():
            if name in ("q", "k", "v"):
                call[name] = value(call[name])
            else:
                options[name] = value
        return dict(call, options=options)
    def dropout():
        return with_(base, dropout_p=0.1)
    yield "k dtype", base, with_(base, k=lambda t: t.double())
    yield "v device", base, with_(base, v=lambda t: t.to("meta"))
    yield "q not a tensor", base, with_(base, q=lambda t: t.tolist())
    yield "k last dim strided", base, with_(base, k=lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2))
    yield "softcap nan", base, with_(base, softcap=float("nan"))
    yield "softmax_scale inf", base, with_(base, softmax_scale=float("inf"))
    yield "dropout_p 1", base, with_(base, dropout_p=1.0)
    yield "window_size", base, with_(base, window_size=(-2, 0))
    yield "rng_state device", dropout, with_(dropout, rng_state=torch.zeros(2, dtype=torch.int64, device="meta"))
    yield "rng_state dtype", dropout, with_(dropout, rng_state=torch.zeros(2, dtype=torch.int32))
    yield "out device", base, with_(base, out=torch.empty(2, 5, 2, 16, device="meta"))
    yield "out dtype", base, with_(base, out=torch.empty(2, 5, 2, 16, dtype=torch.float64))
    yield "alibi dtype", base, with_(base, alibi_slopes=torch.rand(2, dtype=torch.float64))
    yield "cu_seqlens values", varlen, with_(varlen, cu_seqlens_q=torch.tensor([0, 6, 5], dtype=torch.int32))
    yield "max_seqlen below a length", varlen, with_(varlen, max_seqlen_k=3)
    yield "cu_seqlens device", varlen, with_(varlen, cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32,
                                                                               device="meta"))


# A given out only without grad (a forward into it is not differentiable) and where out is not the bad argument.
_BAD_CALL_CASES = [pytest.param(what, good, bad, into, grad, id=f"{grad_id}-{into_id}-{what}")
                   for what, good, bad in _bad_calls()
                   for into, into_id in ((False, "new_out"), (True, "given_out"))
                   for grad, grad_id in ((False, "no_grad"), (True, "grad"))
                   if not (into and (grad or "out" in bad["options"]))]


@pytest.mark.parametrize("what, good, bad, into, grad", _BAD_CALL_CASES)
def test_a_memo_hit_still_rejects_a_bad_call_before_writing(counted, what, good, bad, into, grad):
    """A good call, memoised, then a bad call of the same shapes: the same ArgumentError (naming the argument) as
    with an empty memo, raised before the caller's out is written; with grad mode on (the autograd Function's
    path) or off."""
    out = torch.full_like(good()["q"], 7.0) if into else None
    given = {} if out is None else dict(out=out)
    messages = []
    for memoised in (True, False):
        prepare.CALLS.clear()
        if memoised:
            call = good()
            fa.flash_attn_fwd(call["q"], call["k"], call["v"], **call["options"])
            assert len(prepare.CALLS.entries) == 1
        with torch.set_grad_enabled(grad), pytest.raises(ArgumentError) as error:
            fa.flash_attn_fwd(bad["q"], bad["k"], bad["v"], **bad["options"], **given)
        if out is not None:
            assert (out == 7.0).all(), "a failing call wrote its out"
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    named = "max_seqlen_k" if what.startswith("max_seqlen") else "q" if what.startswith("q") else what.split()[0]
    assert messages[0].startswith(named), messages[0]


def test_a_memoised_meta_signature_does_not_let_meta_tensors_through(counted):
    """The memo also holds signatures prepared by the pipeline alone (meta tensors plan workspaces): the API still
    refuses meta tensors after one is memoised (a hit on meta decides no device check)."""
    q, k, v = (torch.randn(1, 4, 2, 8, device="meta") for _ in range(3))
    prepare.prepare(q, k, v, AttentionOptions())
    with pytest.raises(ArgumentError, match=r"^q: a meta tensor has no data"):
        fa.flash_attn_func(q, k, v)


def test_saved_tensor_hooks_reach_the_backward(counted):
    """The Function's backward runs on the tensors autograd unpacks (identical objects unless saved-tensor hooks
    give others, e.g. offloading): with hooks that unpack copies, the gradients are the same."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(9, 2, 16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    slopes = torch.rand(2)

    def step():
        out = fa.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, alibi_slopes=slopes)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    plain = step()
    unpacked = []

    def unpack(t):
        unpacked.append(t)
        return t.clone()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        hooked = step()
    assert any(t is cu for t in unpacked) and any(t is slopes for t in unpacked)
    for a, b in zip(plain, hooked):
        assert torch.equal(a, b)


# ---- flash_attn_bwd: eagerly the op's implementation itself, with the op's results and errors ------------

def _bwd_call(case: str, seed: int = 0) -> tuple[tuple, dict]:
    """flash_attn_bwd's (positional, keyword) arguments for `case`, from a forward of the same options."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if case == "out_dtype" else torch.float32
    if case.startswith("varlen"):
        cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
        q, k, v = torch.randn(8, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
        options = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=5, causal=True,
                       seqused_k=torch.tensor([3, 5], dtype=torch.int32), deterministic=True)
    else:
        q, k, v = (torch.randn(2, 6, 2, 12, dtype=dtype) for _ in range(3))
        options = dict(causal=True)
        if case == "dense_gqa_alibi_window":
            k, v = k[..., :1, :].contiguous(), v[..., :1, :].contiguous()
            options = dict(alibi_slopes=torch.rand(2), window_size=(2, 1), softcap=4.0)
        elif case == "dropout":
            options["dropout_p"] = 0.3
        elif case == "out_dtype":
            options["out_dtype"] = torch.float32
        elif case == "chunked":     # just below the whole call's workspace: chunks
            plan = fa.backward_workspace(q, k, v, causal=True, backends=("reference",))["reference"]
            options["max_workspace_bytes"] = plan.peak_bytes - 1
    with torch.no_grad():
        out, lse, rng_state = fa.flash_attn_fwd(q, k, v, **{n: o for n, o in options.items()
                                                          if n not in ("out_dtype", "max_workspace_bytes")})
    for t in (q, k, v):     # grad mode is on in the tests: nothing the backward computes may record a graph
        t.requires_grad_(True)
    keyword = dict(options, rng_state=rng_state)
    if case == "into":
        keyword.update(dq=torch.full_like(q, 7.0), dk=torch.full_like(k, 7.0), dv=torch.full_like(v, 7.0))
    return (torch.randn_like(out), q, k, v, out, lse), keyword


BWD_CASES = ("dense", "dense_gqa_alibi_window", "dropout", "into", "out_dtype", "chunked", "varlen_seqused_k")


@pytest.mark.parametrize("case", BWD_CASES)
def test_flash_attn_bwd_runs_the_implementation_directly(case, monkeypatch):
    """Eagerly flash_attn_bwd runs the op's implementation without the dispatcher (no boxing, no second build of
    its options), and its results are exactly what the op gives under a dispatch mode (which routes it through
    the `bwd` / `bwd_out` op, as under torch.compile)."""
    positional, keyword = _bwd_call(case)
    with OpRecorder() as mode:
        through_op = fa.flash_attn_bwd(*positional, **{n: t.clone() if n in ("dq", "dk", "dv") else t
                                                       for n, t in keyword.items()})
    op = "flash_attn_ck.bwd_out.default" if case == "into" else "flash_attn_ck.bwd.default"
    assert op in mode.seen

    def no_op(*args, **kwargs):
        raise AssertionError("an eager flash_attn_bwd went through the dispatcher")
    monkeypatch.setattr(flash_attn_ck_ops, "_bwd_op", no_op)
    monkeypatch.setattr(flash_attn_ck_ops, "_bwd_out_op", no_op)
    direct = fa.flash_attn_bwd(*positional, **keyword)
    for a, b in zip(direct, through_op):
        assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
    assert all(not t.requires_grad and t.grad_fn is None for t in direct)
    if case == "into":
        assert all(a is keyword[name] for a, name in zip(direct, ("dq", "dk", "dv")))


def _bad_backward(what: str) -> tuple[tuple, dict]:
    positional, keyword = _bwd_call("dropout" if what == "rng_state missing" else "dense")
    dout, q, k, v, out, lse = positional
    if what == "lse shape":
        lse = lse[:, :1]
    elif what == "dout dtype":
        dout = dout.double()
    elif what == "dq aliases q":
        keyword["dq"] = q
    elif what == "backend type":
        keyword["backend"] = 123
    elif what == "rng_state missing":
        keyword["rng_state"] = None
    elif what == "out_dtype":
        keyword["out_dtype"] = torch.float64
    else:
        raise AssertionError(what)
    return (dout, q, k, v, out, lse), keyword


@pytest.mark.parametrize("what", ["lse shape", "dout dtype", "dq aliases q", "backend type", "rng_state missing",
                                  "out_dtype"])
def test_flash_attn_bwd_direct_refuses_what_the_op_refuses(what):
    """A bad flash_attn_bwd raises the same ArgumentError eagerly (the implementation called directly) as through
    the op, before a given dq is written."""
    messages = []
    for through_op in (False, True):
        positional, keyword = _bad_backward(what)
        with OpRecorder() if through_op else contextlib.nullcontext(), pytest.raises(ArgumentError) as error:
            fa.flash_attn_bwd(*positional, **keyword)
        messages.append(str(error.value))
        assert keyword.get("dq") is not positional[1] or torch.equal(keyword["dq"], positional[1])
    assert messages[0] == messages[1], messages


@pytest.mark.parametrize("through_op", [False, True], ids=["direct", "op"])
@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_a_missing_max_seqlen_is_named_missing_on_every_path(name, through_op):
    """A varlen flash_attn_fwd / flash_attn_bwd without a max_seqlen raises the same "missing" error eagerly (the
    implementation called directly) and through the ops (under a dispatch mode, as under torch.compile): the ops'
    schema keeps None (an int there would turn it into a bound of 0, and an empty call)."""
    positional, keyword = _bwd_call("varlen_seqused_k")
    keyword[name] = None
    expected = rf"^{name}: varlen calls need .* \(missing: {name}\)"
    with OpRecorder() if through_op else contextlib.nullcontext():
        with pytest.raises(ArgumentError, match=expected):
            fa.flash_attn_bwd(*positional, **keyword)
        with pytest.raises(ArgumentError, match=expected):
            fa.flash_attn_fwd(*positional[1:4], **{n: t for n, t in keyword.items() if n != "rng_state"})


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 2)), min_size=1, max_size=4),
       end=st.integers(0, 9))
def test_one_mask_fills_every_tensor_as_the_cpu_form_does(rows, end):
    """core/rows.py's device form shares a mask between tensors with as many rows (along any dim): each is
    filled exactly as the CPU form fills it alone."""
    from flash_attn_ck.core.rows import fill_all_outside_sequences, fill_by_masks
    cu = torch.tensor([0, end], dtype=torch.int32)
    fills, expected = [], []
    for index, (total, dim) in enumerate(rows):
        shape = [2, 3, 2]
        shape[dim] = total
        t = torch.randn(shape)
        alone = t.clone()
        fill_all_outside_sequences(cu, (alone, dim, float(index)))
        fills.append((t, dim, float(index)))
        expected.append(alone)
    fill_by_masks(cu, *fills)
    for (t, _, _), alone in zip(fills, expected):
        assert torch.equal(t, alone)


def test_backends_made_per_call_are_not_kept_alive_by_the_memo():
    """A backend instance passed per call (`backend=ReferenceBackend()`) keys its own memo entries (chunk plans,
    kernel choices): the memo of the call's problem is emptied when it holds MEMO_ENTRIES, so at most that many
    such backends stay alive, while one reused backend keeps its entries (no re-planning per call)."""
    import gc
    import weakref

    from flash_attn_ck.backends.reference import ReferenceBackend
    from flash_attn_ck.core.problem import MEMO_ENTRIES
    q = torch.randn(1, 4, 1, 8, requires_grad=True)
    made = []
    for _ in range(MEMO_ENTRIES + 40):
        backend = ReferenceBackend()
        made.append(weakref.ref(backend))
        fa.flash_attn_func(q, q, q, backend=backend).sum().backward()
    del backend
    gc.collect()
    alive = sum(ref() is not None for ref in made)
    assert 0 < alive <= MEMO_ENTRIES
    problem = prepare.prepare(q, q, q, AttentionOptions(backend=ReferenceBackend())).problem
    kept = ReferenceBackend()
    fa.flash_attn_func(q, q, q, backend=kept).sum().backward()
    entries = {key: value for key, value in problem.memo.items() if kept in key}
    for _ in range(5):
        fa.flash_attn_func(q, q, q, backend=kept).sum().backward()
    assert entries and all(problem.memo[key] is value for key, value in entries.items())
