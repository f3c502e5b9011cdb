"""Backends: capabilities declared as data and the refusals made from them, selection, and configured
instances (`backend=` instances and `use_backend`)."""

from __future__ import annotations

import contextlib
import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_attn_ck as fa
from cases import MASK_KIND_CASES
from flash_attn_ck.backends.reference import ReferenceBackend
from flash_attn_ck.backends.registry import all_backend_classes, backend_class
from flash_attn_ck.core.mask import MaskInfo, MaskKind
from flash_attn_ck.core.problem import AttentionProblem
from flash_attn_ck.pipeline.select import BACKEND_ENV, select_backend


def problem(device="cpu", dtype=torch.bfloat16, **kw):
    return AttentionProblem(batch=1, seqlen_q=16, seqlen_k=16, heads_q=2, heads_k=2, head_dim=64, dtype=dtype,
                            device=torch.device(device), mask=MaskInfo.from_flash_args(False, (-1, -1), 16, 16),
                            softmax_scale=0.125, **kw)


# Each declared capability, a problem that needs it, and the sentence a backend without it must give.
FEATURES = [("supports_alibi", dict(has_alibi=True), "ALiBi is not supported"),
            ("supports_softcap", dict(softcap=3.0), "softcap is not supported"),
            ("supports_dropout", dict(dropout_p=0.1), "dropout is not supported"),
            ("supports_varlen", dict(varlen=True, total_q=16, total_k=16), "varlen is not supported"),
            ("supports_deterministic", dict(deterministic=True), "deterministic mode is not supported")]


def test_every_backend_declares_capabilities():
    """Every registered backend loads, declares its capabilities as data (its own device types and dtypes,
    a boolean per feature), and each declaration decides a refusal: a feature declared unsupported gives
    its reason, a supported one none; a device type or dtype outside the declared sets gives a reason."""
    classes = all_backend_classes()
    assert sorted(cls.name for cls in classes) == ["ck", "reference", "triton"]
    for cls in classes:
        assert cls.device_types and cls.dtypes, f"{cls.name}: no device types or dtypes declared (module failed?)"
        device = sorted(cls.device_types)[0]
        for flag, features, sentence in FEATURES:
            declared = getattr(cls, flag)
            assert isinstance(declared, bool), (cls.name, flag)
            reasons = cls.not_supported_reasons(problem(device=device, **features))
            assert (sentence in reasons) is (not declared), (cls.name, flag, reasons)
        outside = next(t for t in ("meta", "cpu", "cuda") if t not in cls.device_types)
        assert any(f"device type {outside!r}" in r for r in cls.not_supported_reasons(problem(device=outside)))
        if torch.float64 not in cls.dtypes:
            assert any("dtype float64" in r for r in cls.not_supported_reasons(problem(device=device,
                                                                                       dtype=torch.float64)))


@pytest.mark.parametrize("kind", list(MaskKind), ids=lambda kind: kind.name.lower())
def test_mask_kinds_are_refused_from_the_declaration(kind):
    """Each backend's `mask_kinds` decides its refusal: a problem of a declared kind gets no mask reason, one
    of another kind exactly one, naming that kind and the declared ones in words; asking for the backend
    by name fails with it."""
    for cls in all_backend_classes():
        device = sorted(cls.device_types)[0]
        p = replace(problem(device=device), mask=MASK_KIND_CASES[kind].build(16, 16))
        mask_reasons = [r for r in cls.not_supported_reasons(p) if r.startswith("mask:")]
        if kind in cls.mask_kinds:
            assert mask_reasons == [], (cls.name, mask_reasons)
            continue
        assert len(mask_reasons) == 1 and kind.value in mask_reasons[0], (cls.name, mask_reasons)
        named = mask_reasons[0].split("runs:")[1]
        assert all((other.value in named) == (other in cls.mask_kinds) for other in MaskKind), (cls.name, named)
        with pytest.raises(fa.NoBackendError, match=re.escape(mask_reasons[0])):
            select_backend(p, cls.name)


def test_row_chunks_only_where_generic_windows_run():
    """A query-row chunk of a masked call is a generic (y, x) window (pipeline/chunking.py): a backend that
    takes row chunks must declare that kind."""
    for cls in all_backend_classes():
        assert not cls.supports_row_chunks or MaskKind.GENERIC in cls.mask_kinds, cls.name


def test_cpu_default_is_reference(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(problem()).name == "reference"


def test_environment_variable_selects_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "ck")
    with pytest.raises(fa.NoBackendError, match=r"backend 'ck' cannot run"):
        select_backend(problem())
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert select_backend(problem()).name == "reference"


def test_reference_is_not_chosen_automatically_on_accelerators(monkeypatch):
    """On a CUDA problem the reference backend can run (no capability refuses it, and asking for it
    works), yet automatic selection never picks the slow oracle: without a GPU backend that fits, the
    error names the rule; with one, that backend is chosen."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    cuda = problem(device="cuda")
    assert backend_class("reference").not_supported_reasons(cuda) == []
    assert select_backend(cuda, "reference").name == "reference"
    gpu_backend_fits = any(not backend_class(name).not_supported_reasons(cuda) for name in ("triton", "ck"))
    if gpu_backend_fits:
        assert select_backend(cuda).name != "reference"
    else:
        with pytest.raises(fa.NoBackendError, match=r"\n  reference: not chosen automatically on cuda \(pass"):
            select_backend(cuda)


def test_declared_features_become_reasons():
    ck = backend_class("ck")
    reasons = ck.not_supported_reasons(problem(softcap=3.0))
    assert any("softcap is not supported" in r for r in reasons)
    reasons = ck.not_supported_reasons(problem(dtype=torch.float32))
    assert any("dtype float32" in r for r in reasons)


def test_fp32_runs_only_on_reference():
    q = torch.randn(1, 4, 2, 8)
    out = fa.flash_attn_func(q, q, q)
    assert out.dtype == torch.float32
    with pytest.raises(fa.NoBackendError, match=r"triton: .*dtype float32"):
        fa.flash_attn_func(q, q, q, backend="triton")


# ---- configured instances: `backend=` and `use_backend` ----------------------------------------

class CountingReference(ReferenceBackend):
    """The reference backend, counting its kernel calls (a stand-in for a configured backend)."""

    def __init__(self):
        self.calls = []

    def forward(self, *args):
        self.calls.append("forward")
        super().forward(*args)

    def backward(self, *args):
        self.calls.append("backward")
        super().backward(*args)


def qkv():
    torch.manual_seed(0)
    return [torch.randn(2, 5, 2, 8, requires_grad=True) for _ in range(3)]


def test_backend_instance_runs_forward_and_backward():
    q, k, v = qkv()
    mine = CountingReference()
    out = fa.flash_attn_func(q, k, v, causal=True, backend=mine)
    out.sum().backward()
    assert mine.calls == ["forward", "backward"]
    expected = fa.flash_attn_func(*[t.detach() for t in (q, k, v)], causal=True, backend="reference")
    assert torch.equal(out.detach(), expected)


def test_backend_instance_through_the_ops():
    """flash_attn_bwd dispatches through torch.ops, whose schema carries the instance as a key."""
    q, k, v = (t.detach() for t in qkv())
    mine = CountingReference()
    out, lse, _ = fa.flash_attn_fwd(q, k, v, backend=mine)
    fa.flash_attn_bwd(torch.ones_like(out), q, k, v, out, lse, backend=mine)
    assert mine.calls == ["forward", "backward"]


def test_use_backend_installs_an_instance_for_a_block():
    q, k, v = qkv()
    mine = CountingReference()
    with fa.use_backend(mine):
        fa.flash_attn_func(q, k, v, backend="reference").sum().backward()
    assert mine.calls == ["forward", "backward"]
    fa.flash_attn_func(q, k, v, backend="reference")          # outside the block: the default instance
    assert mine.calls == ["forward", "backward"]


def test_use_backend_rejects_non_backends():
    with pytest.raises(TypeError, match="Backend instances"), fa.use_backend("reference"):
        pass


def test_backend_instance_that_cannot_run_says_why():
    q, k, v = (t.detach() for t in qkv())
    mine = type("CudaOnlyReference", (CountingReference,), {"device_types": frozenset({"cuda"})})()
    with pytest.raises(fa.NoBackendError, match="backend 'reference' cannot run"):
        fa.flash_attn_func(q, k, v, backend=mine)


# ---- the backward runs on the forward's backend ---------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(change=st.sampled_from(["leave use_backend", "enter use_backend", "set env", "unset env"]),
       request=st.sampled_from([None, "reference"]), low_level=st.booleans(), compiled_path=st.booleans())
def test_the_backward_runs_on_the_forward_backend(change, request, low_level, compiled_path):
    """Property: whatever changes between a forward and its backward (a use_backend block left or entered,
    $FLASH_ATTN_CK_BACKEND set or unset), a backward that asks what its forward asked runs on the forward's instance:
    through autograd (eagerly or through the ops, as compiled graphs call them) and through flash_attn_fwd/_bwd."""
    import os
    from unittest import mock

    from flash_attn_ck import ops
    first, second = CountingReference(), CountingReference()
    q, k, v = qkv()
    env = {BACKEND_ENV: "reference"} if change == "unset env" else {}
    with mock.patch.dict(os.environ, env), mock.patch.object(ops, "_direct", return_value=not compiled_path):
        with fa.use_backend(first) if change != "enter use_backend" else contextlib.nullcontext():
            if low_level:
                out, lse, _ = fa.flash_attn_fwd(*(t.detach() for t in (q, k, v)), backend=request)
            else:
                out = fa.flash_attn_func(q, k, v, backend=request)
        with contextlib.ExitStack() as later:
            if change == "enter use_backend":
                later.enter_context(fa.use_backend(second))
            if change == "set env":
                later.enter_context(mock.patch.dict(os.environ, {BACKEND_ENV: "ck"}))
            if change == "unset env":
                os.environ.pop(BACKEND_ENV)
            if low_level:
                fa.flash_attn_bwd(torch.ones_like(out), *(t.detach() for t in (q, k, v)), out, lse, backend=request)
            else:
                out.sum().backward()
    ran = first if change != "enter use_backend" else None
    assert second.calls == []
    if ran is not None:
        assert ran.calls == ["forward", "backward"]


def test_a_backward_asking_another_backend_gets_it():
    """The forward's instance is kept only for a backward that asks what the forward asked: an explicit other request
    is the caller's."""
    q, k, v = (t.detach() for t in qkv())
    first, second = CountingReference(), CountingReference()
    out, lse, _ = fa.flash_attn_fwd(q, k, v, backend=first)
    fa.flash_attn_bwd(torch.ones_like(out), q, k, v, out, lse, backend=second)
    assert first.calls == ["forward"] and second.calls == ["backward"]


# ---- use_backend: the installed instance is what is judged ------------------------------------

class FussyReference(CountingReference):
    """A configured reference backend that takes no causal call (its class says so)."""

    @classmethod
    def extra_reasons(cls, problem):
        return ["this configuration takes no causal call"] if problem.mask.is_causal else []


@pytest.mark.parametrize("request_", [None, "reference"], ids=["automatic", "by-name"])
def test_use_backend_judges_the_installed_instance(request_):
    """A call asking for "reference" (or automatic) inside use_backend(instance) is judged by the instance's own
    capabilities, before and after a call judged by the registered class (no stale memo either way)."""
    q, k, v = (t.detach() for t in qkv())
    fa.flash_attn_func(q, k, v, causal=True, backend=request_)          # the registered class takes it
    with fa.use_backend(FussyReference()), pytest.raises(fa.NoBackendError, match="takes no causal call"):
        fa.flash_attn_func(q, k, v, causal=True, backend=request_)
    fa.flash_attn_func(q, k, v, causal=True, backend=request_)          # and again outside
