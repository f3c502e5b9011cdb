"""The classes of edge inputs, drawn by hypothesis rather than listed as instances.

- Bad values for every argument of every public function (type, range, non-finite, device incl. meta,
  shape, slot count, aliasing, stride 0): `ArgumentError` naming the argument, and no input or
  preallocated output changed.
- Valid edge shapes against the float64 oracle: varlen rows outside every sequence, windows with
  s_q > s_k (flash-attn's documented interval), NaN/Inf in keys a row does not attend, max_seqlen bounds
  (the dropout pattern and the workspace do not depend on them); double backward refused.

The `check_*` functions take a backend and a dtype: the reference runs them here in float64; the Triton
kernels run the same functions under TRITON_INTERPRET=1 in one subprocess (`test_triton_interpreter`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flash_attn_ck as fa
from cases import OpRecorder, check_case, packed_if
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.mask import MaskInfo
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.core.problem import AttentionParams
from flash_attn_ck.pipeline.chunking import plan_chunks
from flash_attn_ck.pipeline.select import select_backend
from folders import PYTHONPATH as TEST_PYTHONPATH
from oracle import Config, naive_attention

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                    HealthCheck.function_scoped_fixture])

# ---- bad arguments ---------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
BAD_OPTIONS = {
    "dropout_p": [NAN, INF, -0.1, 1.0, "x", None, [0.1]],
    "softmax_scale": [0.0, -1.0, NAN, INF, "abc", True, [1.0]],
    "softcap": [-1.0, NAN, INF, "x", None],
    "window_size": [None, (NAN, 0), (1.7, 2), (2 ** 70, 0), (0, 2 ** 31), (-2, 0), (0,), (1, 2, 3), "ab", 3,
                    (True, 0), (0, None)],
    "causal": ["yes", 2, None, 0.5],
    "deterministic": ["no", 2, None],
    "backend": ["bogus", "REFERENCE", " reference", 123],
}
BAD_BWD_OPTIONS = {"max_workspace_bytes": [-5, 1.5, "x", True]}
BAD_VARLEN = {
    "max_seqlen_q": [-1, 2.5, "8", None],
    "max_seqlen_k": [-1, 2.5, None],
}


def _tensor_variants(t: torch.Tensor, reference: bool = False):
    """Bad versions of a tensor argument: not a tensor, wrong dtype, meta, wrong shape, strided last dim.
    `reference`: q or v, whose head dims are their own (a q of another head dim blames k, a v of another one out and
    dout: `_bwd_calls` adds that case)."""
    out = [t.tolist() if t.numel() < 50 else None, t.to(torch.int32), t.to("meta"), t.unsqueeze(0)]
    if not reference and t.shape[-1] > 1:     # (a last dim of 1 is already that shape: not a bad value)
        out.append(t[..., :1].clone())
    if t.shape[-1] > 1:
        out.append(torch.stack([t, t], -1)[..., 0])     # last dim stride 2
    return out


def _shapes(draw):
    b = draw(st.integers(1, 2))
    s_q, s_k = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    h_k = draw(st.integers(1, 2))
    h = h_k * draw(st.integers(1, 2))
    d = draw(st.sampled_from([4, 8]))
    return b, s_q, s_k, h, h_k, d


@dataclass
class _CallSpace:
    """One public function and the bad arguments to draw for it: `cases` are (argument name, the arguments it
    replaces), on top of `positional` (the function's tensors by name) and `common` (keyword arguments)."""
    fn: object
    positional: dict
    common: dict
    cases: list = field(default_factory=list)
    options: dict = field(default_factory=lambda: dict(BAD_OPTIONS))

    def add(self, name: str, bad_values) -> None:
        self.cases += [(name, {name: bad}) for bad in bad_values]


# [seed, offset] with a filler between them: the Triton kernels read the offset at the next element.
NON_CONTIGUOUS_RNG_STATE = torch.tensor([7, -1, 9, -1])[::2]


def _batch_calls(kind, q, k, v, b) -> _CallSpace:
    """flash_attn_func, flash_attn_fwd and the packed batch functions."""
    if kind == "func":
        return _CallSpace(fa.flash_attn_func, dict(q=q, k=k, v=v), {})
    if kind == "fwd":
        space = _CallSpace(fa.flash_attn_fwd, dict(q=q, k=k, v=v), {})
        space.add("seqused_k", [torch.zeros(b, dtype=torch.int32)])      # a batch call
        space.cases.append(("rng_state", {"dropout_p": 0.1, "rng_state": NON_CONTIGUOUS_RNG_STATE}))
        return space
    if kind == "qkvpacked":
        qkv = torch.stack([q, k, v], 2)
        space = _CallSpace(fa.flash_attn_qkvpacked_func, dict(qkv=qkv), {})
        space.add("qkv", (qkv[:, :, :2], torch.cat([qkv, qkv[:, :, :1]], 2), qkv.to("meta"), qkv[0]))
        return space
    kv = torch.stack([k, v], 2)
    space = _CallSpace(fa.flash_attn_kvpacked_func, dict(q=q, kv=kv), {})
    space.add("kv", (kv[:, :, :1], torch.cat([kv, kv[:, :, :1]], 2), kv.to("meta")))
    return space


def _varlen_calls(kind, q, k, v, b, s_q, s_k) -> _CallSpace:
    """The three varlen functions, with their offsets' and bounds' bad values."""
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    cu_q = torch.arange(b + 1, dtype=torch.int32) * s_q
    cu_k = torch.arange(b + 1, dtype=torch.int32) * s_k
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=s_q, max_seqlen_k=s_k)
    if kind == "varlen":
        space = _CallSpace(fa.flash_attn_varlen_func, dict(q=q, k=k, v=v), dict(varlen))
        space.add("seqused_k", (
            torch.zeros(b, dtype=torch.int64), torch.zeros(b + 1, dtype=torch.int32),
            torch.zeros(b, dtype=torch.int32, device="meta"), [0] * b, torch.full((b,), -1, dtype=torch.int32),
            torch.full((b,), s_k + 1, dtype=torch.int32)))
    elif kind == "varlen_qkvpacked":
        qkv = torch.stack([q, k, v], 1)
        space = _CallSpace(fa.flash_attn_varlen_qkvpacked_func, dict(qkv=qkv), dict(cu_seqlens=cu_q, max_seqlen=s_q))
        space.add("qkv", (qkv[:, :2], torch.cat([qkv, qkv[:, :1]], 1)))
        space.add("max_seqlen", (-1, 2.5, None))
    else:
        kv = torch.stack([k, v], 1)
        space = _CallSpace(fa.flash_attn_varlen_kvpacked_func, dict(q=q, kv=kv), dict(varlen))
        space.add("kv", (kv[:, :1], torch.cat([kv, kv[:, :1]], 1)))
    for name in ("cu_seqlens_q", "cu_seqlens_k", "cu_seqlens"):
        if name in space.common:
            cu = space.common[name]
            space.add(name, (cu.long(), cu.to("meta"), cu.flip(0).contiguous(), cu + 1, cu[:, None], [0, s_q]))
    for name, values in BAD_VARLEN.items():
        if name in space.common:
            space.add(name, values)
    space.options.pop("deterministic")   # also a positional name; covered by the batch functions
    return space


def _bwd_calls(q, k, v, rand) -> _CallSpace:
    """flash_attn_bwd: every operand's bad values, aliased or stride-0 outputs, a missing or bad rng_state."""
    (b, s_q, h, d), (s_k, h_k) = q.shape, k.shape[1:3]
    out, lse, _ = fa.flash_attn_fwd(q, k, v, backend="reference")
    dout = rand(*q.shape)
    positional = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    space = _CallSpace(fa.flash_attn_bwd, positional, dict(dq=dq, dk=dk, dv=dv))
    for name, t in positional.items():
        space.add(name, [bad for bad in _tensor_variants(t, name in ("q", "v")) if bad is not None])
    if d > 1:       # v of another head dim d_v than the forward's: out (and dout) no longer have v's
        space.cases.append(("out", {"v": v[..., :1].clone()}))
    space.cases += [("dq", {"dq": q}), ("dk", {"dk": k}), ("dv", {"dv": v}), ("dq", {"dq": dout}),
                    ("dq", {"dq": out}), ("dk", {"dk": dv}),
                    ("dq", {"dq": dq.float()}), ("dq", {"dq": dq.to("meta")}), ("dv", {"dv": dv[..., :1]}),
                    ("rng_state", {"dropout_p": 0.1}), ("rng_state", {"dropout_p": 0.1, "rng_state": torch.zeros(2)}),
                    ("rng_state", {"dropout_p": 0.1,
                                   "rng_state": torch.zeros(2, dtype=torch.int64, device="meta")}),
                    ("rng_state", {"dropout_p": 0.1, "rng_state": NON_CONTIGUOUS_RNG_STATE})]
    # stride-0 (expanded) outputs: only bad when they expand over more than one row
    if b * s_q * h > 1:
        space.add("dq", [torch.zeros(1, 1, 1, d, dtype=q.dtype).expand(q.shape)])
    if b * s_k * h_k > 1:
        space.add("dk", [torch.zeros(d, dtype=q.dtype).expand(k.shape)])
    if b * s_q > 1 or h > 1:      # dq overlapping dout partially: a view one row into it
        flat = torch.empty(dout.numel() + d, dtype=q.dtype)
        space.cases.append(("dq", {"dq": flat[d:].view(q.shape), "dout": flat[:-d].view(q.shape)}))
    space.options.update(BAD_BWD_OPTIONS)
    return space


def _workspace_calls(q, k, v) -> _CallSpace:
    """backward_workspace (on meta tensors: it plans, runs nothing)."""
    space = _CallSpace(fa.backward_workspace, dict(q=q.to("meta"), k=k.to("meta"), v=v.to("meta")), {})
    space.options.pop("backend")
    space.options.update(BAD_BWD_OPTIONS)
    for name in ("q", "k", "v"):
        space.add(name, (space.positional[name].to(torch.int32), [1.0]))
    return space


@st.composite
def bad_calls(draw):
    """(function, args, kwargs, name the error must start with, tensors that must not change)."""
    b, s_q, s_k, h, h_k, d = _shapes(draw)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 1000)))

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    kind = draw(st.sampled_from(["func", "qkvpacked", "kvpacked", "varlen", "varlen_qkvpacked", "varlen_kvpacked",
                                 "fwd", "bwd", "workspace"]))
    if kind in ("qkvpacked", "varlen_qkvpacked"):
        h_k, s_k = h, s_q
    q, k, v = rand(b, s_q, h, d), rand(b, s_k, h_k, d), rand(b, s_k, h_k, d)
    space = _call_space(kind, q, k, v, rand)
    if kind != "workspace":
        space.common["backend"] = "reference"
        space.add("alibi_slopes", (torch.ones(h, dtype=torch.float64), torch.ones(h + 1),
                                   torch.ones(h, device="meta"), [0.1] * h))
    if kind in ("func", "fwd", "varlen"):
        for name in ("q", "k", "v"):
            space.add(name, [bad for bad in _tensor_variants(space.positional[name], name in ("q", "v"))
                             if bad is not None])
    for name, values in space.options.items():
        space.add(name, values)
    name, update = draw(st.sampled_from(space.cases))
    args = {key: update.get(key, value) for key, value in space.positional.items()}
    kwargs = {**space.common, **{key: value for key, value in update.items() if key not in args}}
    return space.fn, args, kwargs, name


def _call_space(kind, q, k, v, rand) -> _CallSpace:
    b, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
    if kind == "bwd":
        return _bwd_calls(q, k, v, rand)
    if kind == "workspace":
        return _workspace_calls(q, k, v)
    if kind.startswith("varlen"):
        return _varlen_calls(kind, q, k, v, b, s_q, s_k)
    return _batch_calls(kind, q, k, v, b)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


@settings(max_examples=400, **SETTINGS)
@given(call=bad_calls())
def test_bad_arguments_are_named_and_mutate_nothing(call, monkeypatch):
    fn, args, kwargs, name = call
    monkeypatch.delenv("FLASH_ATTN_CK_BACKEND", raising=False)
    monkeypatch.delenv("FLASH_ATTN_CK_MAX_WORKSPACE_BYTES", raising=False)
    real = [t for t in _tensors((args, kwargs)) if t.device.type != "meta"]
    before = [t.clone() for t in real]
    with pytest.raises(fa.ArgumentError) as error:
        fn(*args.values(), **kwargs)
    message = str(error.value)
    assert re.match(rf"^{re.escape(name)}\b", message), f"expected the message to name {name!r}: {message}"
    for t, saved in zip(real, before):
        assert torch.equal(t, saved) or (torch.isnan(t) == torch.isnan(saved)).all(), "an argument was modified"


@pytest.mark.parametrize("variable, value", [("FLASH_ATTN_CK_BACKEND", "bogus"), ("FLASH_ATTN_CK_BACKEND", "REFERENCE"),
                                             ("FLASH_ATTN_CK_BACKEND", " reference"),
                                             ("FLASH_ATTN_CK_MAX_WORKSPACE_BYTES", "-5"),
                                             ("FLASH_ATTN_CK_MAX_WORKSPACE_BYTES", "lots")])
def test_bad_environment_is_named(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(fa.ArgumentError, match=f"^{variable}="):
        fa.flash_attn_func(q, q, q).sum().backward()


def test_empty_environment_means_unset(monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_CK_BACKEND", "")
    monkeypatch.setenv("FLASH_ATTN_CK_MAX_WORKSPACE_BYTES", "")
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    fa.flash_attn_func(q, q, q).sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("variable, option", [("FLASH_ATTN_CK_TRITON_GQA", "gqa_epilogue"),
                                              ("FLASH_ATTN_CK_TRITON_DQ", "dq_mode")])
def test_triton_environment_errors_name_the_variable(monkeypatch, variable, option):
    pytest.importorskip("triton")
    from flash_attn_ck.backends.triton import TritonBackend
    from flash_attn_ck.backends.triton import backend as triton_backend
    env = {"gqa_epilogue": triton_backend.GQA_ENV, "dq_mode": triton_backend.DQ_ENV}[option]
    monkeypatch.setenv(env, "bogus")
    with pytest.raises(ValueError, match=f"^{env}="):
        TritonBackend()
    with pytest.raises(ValueError, match=f"^{option}="):
        TritonBackend(**{option: "bogus"})


def test_backward_workspace_reports_a_backend_that_fails_to_import(monkeypatch):
    from flash_attn_ck.backends import registry
    monkeypatch.setitem(registry._BACKEND_MODULES, "ck", "flash_attn_ck.backends.no_such_module")
    q = torch.empty(1, 16, 2, 64, dtype=torch.bfloat16, device="meta")
    report = fa.backward_workspace(q, q, q)
    assert isinstance(report["ck"], str) and "failed to load" in report["ck"]
    assert not isinstance(report["reference"], str)


# ---- valid edge shapes against the oracle ------------------------------------------------------------

def _tol(dtype):
    return dict(atol=1e-9, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-2, rtol=2e-2)


def _oracle(q, k, v, dout, causal, window, mask_keep=None):
    """float64 naive attention of one sequence: out, lse, dq, dk, dv (autograd)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(q, k, v, causal=causal, window=window)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check_rows_outside_sequences(backend="reference", dtype=torch.float64, lengths=((3, 5), (0, 2), (4, 1)),
                                 extra_q=3, extra_k=2, heads=(4, 2), causal=True, exact_max=False, cap_fraction=None):
    """cu_seqlens[-1] < total: rows after it are in no sequence. out/dq/dk/dv 0, lse +inf; the sequences'
    rows as the oracle (preallocated outputs filled with NaN first: everything is written). `exact_max`:
    max_seqlen is the longest length (0 when every sequence is empty on a side), else one more;
    `cap_fraction`: the backward runs under that fraction of its unchunked peak workspace."""
    gen = torch.Generator().manual_seed(1)
    total_q = sum(s for s, _ in lengths) + extra_q
    total_k = sum(s for _, s in lengths) + extra_k
    h, h_k = heads
    q, dout = (torch.randn(total_q, h, 16, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(total_k, h_k, 16, generator=gen).to(dtype) for _ in range(2))
    cu_q = torch.tensor([0, *torch.tensor([s for s, _ in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([s for _, s in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    bound = 0 if exact_max else 1
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(s for s, _ in lengths) + bound,
                  max_seqlen_k=max(s for _, s in lengths) + bound, causal=causal, backend=backend)
    out, lse, _ = fa.flash_attn_fwd(q, k, v, **varlen)
    grads = [torch.full_like(t, NAN) for t in (q, k, v)]
    cap = None if cap_fraction is None else _cap(q, k, v, varlen, cap_fraction)
    fa.flash_attn_bwd(dout, q, k, v, out, lse, *grads, **varlen, max_workspace_bytes=cap)
    dq, dk, dv = grads
    end_q, end_k = int(cu_q[-1]), int(cu_k[-1])
    assert (out[end_q:] == 0).all() and (dq[end_q:] == 0).all(), "query rows in no sequence: out and dq are 0"
    assert (lse[:, end_q:] == INF).all(), "query rows in no sequence: lse is +inf"
    assert (dk[end_k:] == 0).all() and (dv[end_k:] == 0).all(), "key rows in no sequence: dk and dv are 0"
    for i in range(len(lengths)):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        ref = _oracle(q[rq], k[rk], v[rk], dout[rq], causal, (-1, -1))
        for name, ours, expected in zip(("out", "dq", "dk", "dv"), (out[rq], dq[rq], dk[rk], dv[rk]),
                                        (ref[0], *ref[2:])):
            torch.testing.assert_close(ours.double(), expected, **_tol(dtype), msg=name)
        finite = torch.isfinite(ref[1])
        assert torch.equal(torch.isfinite(lse[:, rq]), finite)


def _cap(q, k, v, options, fraction: float) -> int:
    """The smallest cap of at least `fraction` of the backward's unchunked peak workspace that its smallest chunk
    fits, on the backend `options` name or hold."""
    options = AttentionOptions(**options)
    problem = describe_call(q, k, v, options)
    backend = select_backend(problem, options.backend)
    params = AttentionParams(q, k, v, options.cu_seqlens_q, options.cu_seqlens_k)
    peak = plan_chunks(problem, backend, None).peak_bytes
    for cap in range(int(peak * fraction), peak, max(1, peak // 64)):
        try:
            plan_chunks(problem, backend, cap, params)
            return cap
        except fa.WorkspaceError:
            continue
    return peak


# Varlen layouts with empty sequences on either side, rows after the last sequence, exact or generous
# max_seqlen, MHA/GQA/MQA and group sizes that split unevenly. A third of the draws empty one side of every
# sequence, so an exact max_seqlen_q or max_seqlen_k of 0 beside rows after the last sequence (a zero-size grid
# for a kernel that sizes its grid from it) comes up in every run, not in one of a few dozen.
_LENGTH = st.integers(0, 6)
EMPTY_SEQUENCE_LAYOUTS = dict(
    lengths=st.one_of(*(st.lists(pair, min_size=1, max_size=3) for pair in (
        st.tuples(_LENGTH, _LENGTH), st.tuples(st.just(0), _LENGTH), st.tuples(_LENGTH, st.just(0))))),
    extra_q=st.integers(0, 3), extra_k=st.integers(0, 3), heads=st.sampled_from([(2, 2), (4, 2), (2, 1), (3, 1)]),
    causal=st.booleans(), exact_max=st.booleans())


@settings(max_examples=30, deadline=None)
@given(total=st.integers(1, 12), end=st.integers(0, 12), dim=st.integers(0, 2))
def test_device_form_of_the_outside_rows_fill(total, end, dim):
    """core/rows.py's sync-free form (used off the CPU) fills exactly what the CPU form fills."""
    from flash_attn_ck.core.rows import fill_by_mask, fill_outside_sequences
    end = min(end, total)
    shape = [3, 3, 3]
    shape[dim] = total
    cu = torch.tensor([0, end], dtype=torch.int32)
    a = torch.randn(shape)
    b = a.clone()
    fill_outside_sequences(a, cu, dim, float("inf"))
    fill_by_mask(b, cu, dim, float("inf"))
    assert torch.equal(a, b) and (a.narrow(dim, end, total - end) == INF).all()


@settings(max_examples=30, **SETTINGS)
@given(**EMPTY_SEQUENCE_LAYOUTS, cap_fraction=st.sampled_from([None, 0.5, 0.3]))
def test_rows_outside_sequences(lengths, extra_q, extra_k, heads, causal, exact_max, cap_fraction):
    check_rows_outside_sequences("reference", torch.float64, lengths, extra_q, extra_k, heads, causal, exact_max,
                                 cap_fraction)


def check_window(backend="reference", dtype=torch.float64, s_q=10, s_k=3, window=(1, 5), causal=False, seqlens=None):
    """flash-attn's documented interval, exactly: batch or varlen (each sequence by its own lengths)."""
    gen = torch.Generator().manual_seed(2)
    lengths = seqlens or [(s_q, s_k)]
    parts = []
    for lq, lk in lengths:
        parts.append([torch.randn(n, 2, 8, generator=gen).to(dtype) for n in (lq, lk, lk, lq)])
    q, k, v, dout = (torch.cat([p[i] for p in parts]) for i in range(4))
    opts = dict(causal=causal, window_size=window, backend=backend)
    if seqlens is None:
        q, k, v, dout = (t[None] for t in (q, k, v, dout))
    else:
        cu_q = torch.tensor([0, *torch.tensor([a for a, _ in lengths]).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor([b for _, b in lengths]).cumsum(0).tolist()], dtype=torch.int32)
        opts.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(a for a, _ in lengths),
                    max_seqlen_k=max(b for _, b in lengths))
    out, lse, _ = fa.flash_attn_fwd(q, k, v, **opts)
    dq, dk, dv, _ = fa.flash_attn_bwd(dout, q, k, v, out, lse, **opts)
    flat = (lambda t: t[0]) if seqlens is None else (lambda t: t)
    start_q = start_k = 0
    for lq, lk in lengths:
        rq, rk = slice(start_q, start_q + lq), slice(start_k, start_k + lk)
        ref = _oracle(flat(q)[rq], flat(k)[rk], flat(v)[rk], flat(dout)[rq], causal, window)
        for name, ours, expected in zip(("out", "dq", "dk", "dv"), (flat(out)[rq], flat(dq)[rq], flat(dk)[rk],
                                                                    flat(dv)[rk]), (ref[0], *ref[2:])):
            torch.testing.assert_close(ours.double(), expected, **_tol(dtype), msg=name)
        start_q, start_k = start_q + lq, start_k + lk


@settings(max_examples=60, **SETTINGS)
@given(s_q=st.integers(1, 14), s_k=st.integers(1, 14), left=st.integers(-1, 16), right=st.integers(-1, 16),
       causal=st.booleans(), varlen=st.booleans(), data=st.data())
def test_windows_follow_the_documented_interval(s_q, s_k, left, right, causal, varlen, data):
    seqlens = None
    if varlen:
        seqlens = data.draw(st.lists(st.tuples(st.integers(0, 14), st.integers(0, 14)), min_size=1, max_size=3))
    check_window("reference", torch.float64, s_q, s_k, (left, right), causal, seqlens)


def test_window_issue_instance():
    """s_q = 10, s_k = 3, window (1, 5): row 0 attends no key (flash-attention's CK frontend gave it 3)."""
    q = torch.randn(1, 10, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64)
    out, lse, _ = fa.flash_attn_fwd(q, k, k, window_size=(1, 5), backend="reference")
    assert lse[0, 0, 0] == INF and (out[0, 0] == 0).all()
    assert MaskInfo.from_flash_args(False, (1, 5), 10, 3).keep(torch.arange(10), torch.arange(3)).sum(1).tolist() == \
        [0, 0, 1, 2, 3, 3, 3, 3, 3, 2]      # keys [i - 8, i - 2]


def _tile_visits(keep: torch.Tensor, tile_m: int, tile_n: int) -> torch.Tensor:
    """Element (i, j): whether row i's query tile visits key j's tile (some pair of the two tiles attends)."""
    s_q, s_k = keep.shape
    padded = torch.zeros(-(-s_q // tile_m) * tile_m, -(-s_k // tile_n) * tile_n, dtype=torch.bool)
    padded[:s_q, :s_k] = keep
    tiles = padded.unflatten(0, (-1, tile_m)).unflatten(2, (-1, tile_n)).any(3).any(1)
    return tiles.repeat_interleave(tile_m, 0)[:s_q].repeat_interleave(tile_n, 1)[:, :s_k]


def check_nonfinite_masked_keys(backend="reference", dtype=torch.float64, s=40, window=(8, 0), causal=False, bad=20,
                                value=NAN, where="kv", tile=(1, 1)):
    """A NaN/Inf in key `bad` (K, V or both) of sequence 0 reaches no row that does not attend it: out and dq
    of the rows that do not reach it, dk/dv of the keys those rows alone attend, and all of sequence 1, match
    the oracle with the bad value replaced by 0. `tile`: the granularity of the guarantee (1: per element,
    the reference; the Triton kernels' tiles: per query tile x key tile, docs/semantics.md)."""
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, s, 2, 8, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, s, 1, 8, generator=gen).to(dtype) for _ in range(2))
    k_bad, v_bad = k.clone(), v.clone()
    if "k" in where:
        k_bad[0, bad] = value
    if "v" in where:
        v_bad[0, bad] = value
    opts = dict(causal=causal, window_size=window, backend=backend)
    out, lse, _ = fa.flash_attn_fwd(q, k_bad, v_bad, **opts)
    dq, dk, dv, _ = fa.flash_attn_bwd(dout, q, k_bad, v_bad, out, lse, **opts)
    keep = MaskInfo.from_flash_args(causal, window, s, s).keep(torch.arange(s), torch.arange(s))
    touched = _tile_visits(keep, *tile)
    dirty_rows = touched[:, bad]
    dirty_keys = (touched & dirty_rows[:, None]).any(0)
    clean_rows, clean_keys = ~dirty_rows, ~dirty_keys
    for b in range(2):
        ref = _oracle(q[b], k[b], v[b], dout[b], causal, window)
        rows = clean_rows if b == 0 else torch.ones(s, dtype=torch.bool)
        keys = clean_keys if b == 0 else torch.ones(s, dtype=torch.bool)
        for name, ours, expected, sel in (("out", out[b], ref[0], rows), ("dq", dq[b], ref[2], rows),
                                          ("dk", dk[b], ref[3], keys), ("dv", dv[b], ref[4], keys)):
            assert torch.isfinite(ours[sel]).all(), f"{name}: a non-finite value reached a row that does not attend it"
            torch.testing.assert_close(ours[sel].double(), expected[sel], **_tol(dtype), msg=name)
    return int(clean_rows.sum()), int(clean_keys.sum())


@settings(max_examples=40, **SETTINGS)
@given(s=st.integers(2, 40), left=st.integers(-1, 10), right=st.integers(-1, 10), causal=st.booleans(),
       value=st.sampled_from([NAN, INF, -INF]), where=st.sampled_from(["k", "v", "kv"]), data=st.data())
def test_nonfinite_values_in_unattended_keys(s, left, right, causal, value, where, data):
    bad = data.draw(st.integers(0, s - 1))
    check_nonfinite_masked_keys("reference", torch.float64, s, (left, right), causal, bad, value, where)


def test_nonfinite_issue_instance():
    """s = 100 causal, v[0, -1] = nan: only row 99 attends that key, so only row 99 is NaN."""
    q = torch.randn(1, 100, 2, 8, dtype=torch.float64)
    v = q.clone()
    v[0, -1] = NAN
    out = fa.flash_attn_func(q, q, v, causal=True, backend="reference")
    assert torch.isnan(out).any(-1).any(-1)[0].nonzero().flatten().tolist() == [99]


def check_varlen_nonfinite_elsewhere(backend="reference", dtype=torch.float64):
    """NaN in the keys of another sequence and in key/query rows of no sequence changes nothing."""
    gen = torch.Generator().manual_seed(4)
    cu_q = torch.tensor([0, 7, 19], dtype=torch.int32)
    cu_k = torch.tensor([0, 11, 20], dtype=torch.int32)
    q, dout = (torch.randn(22, 2, 8, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(23, 2, 8, generator=gen).to(dtype) for _ in range(2))
    opts = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=12, max_seqlen_k=11, causal=True, backend=backend)
    clean = fa.flash_attn_fwd(q, k, v, **opts)
    clean_grads = fa.flash_attn_bwd(dout, q, k, v, clean[0], clean[1], **opts)
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    k2[3], v2[3] = NAN, INF                       # sequence 0's key 3 (sequence 1 has keys 11..19)
    k2[20:], v2[20:], q2[19:] = NAN, NAN, NAN      # rows in no sequence
    out, lse, _ = fa.flash_attn_fwd(q2, k2, v2, **opts)
    dq, dk, dv, _ = fa.flash_attn_bwd(dout, q2, k2, v2, out, lse, **opts)
    for ours, expected in ((out[7:19], clean[0][7:19]), (dq[7:19], clean_grads[0][7:19]),
                           (dk[11:20], clean_grads[1][11:20]), (dv[11:20], clean_grads[2][11:20])):
        torch.testing.assert_close(ours, expected, **_tol(dtype))
    assert (out[19:] == 0).all() and (dq[19:] == 0).all() and (dk[20:] == 0).all() and (dv[20:] == 0).all()


def test_varlen_nonfinite_elsewhere():
    check_varlen_nonfinite_elsewhere("reference", torch.float64)


# ---- max_seqlen is a bound, not data --------------------------------------------------------------------

def check_dropout_independent_of_max_seqlen(backend="reference", dtype=torch.float64):
    """Varlen dropout: forward and backward with different (valid) max_seqlen bounds draw one pattern."""
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v, dout = (torch.randn(12, 2, 16, generator=gen).to(dtype) for _ in range(4))
    base = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, dropout_p=0.3, backend=backend)
    results = []
    for max_fwd, max_bwd in ((7, 7), (7, 12), (12, 9)):
        torch.manual_seed(0)
        out, lse, rng = fa.flash_attn_fwd(q, k, v, max_seqlen_q=max_fwd, max_seqlen_k=max_fwd, **base)
        grads = fa.flash_attn_bwd(dout, q, k, v, out, lse, max_seqlen_q=max_bwd, max_seqlen_k=max_bwd,
                                  rng_state=rng, **base)[:3]
        results.append((out, *grads))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b), "the keep pattern depends on max_seqlen"


def test_dropout_independent_of_max_seqlen():
    check_dropout_independent_of_max_seqlen()


def test_generous_max_seqlen_plans_from_real_lengths():
    """4-token sequences with max_seqlen 2**20 fit the default cap, on the real lengths."""
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    q = torch.randn(8, 2, 16, dtype=torch.float64)
    results = []
    for bound in (4, 2 ** 20):
        opts = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=bound, max_seqlen_k=bound, backend="reference",
                    deterministic=True)
        out, lse, _ = fa.flash_attn_fwd(q, q, q, **opts)
        results.append((out, *fa.flash_attn_bwd(q, q, q, q, out, lse, **opts)))
        planning = {key: value.to("meta") if isinstance(value, torch.Tensor) else value
                    for key, value in opts.items() if key != "backend"}
        plan = fa.backward_workspace(q.to("meta"), q.to("meta"), q.to("meta"), **planning)
        assert all(not isinstance(p, str) and p.peak_bytes < 1 << 20 for p in plan.values()), plan
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---- any value of any option: checked before it reaches an op's schema ----------------------------------

def _fresh(make):
    return st.builds(make)


# Values of every type and range an option could be given: beyond int64 (the schemas' ints), beyond any float,
# non-finite, containers, strings, numpy scalars, tensors of several dtypes and shapes.
ANY_VALUE = st.one_of(
    st.sampled_from([0, 1, 3, -1, -2, 2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70, -2 ** 63 - 1,
                     10 ** 400, -10 ** 400]),
    st.integers(), st.floats(),
    st.sampled_from([None, True, False, "x", "", b"1", [1, 2], [0.5], (), (1,), {}, 1j, object(), np.int64(3),
                     np.float32(0.5), np.bool_(True)]),
    _fresh(lambda: torch.tensor(1)), _fresh(lambda: torch.tensor(0.5)), _fresh(lambda: torch.tensor(True)),
    _fresh(lambda: torch.tensor([0, 3, 5], dtype=torch.int32)), _fresh(lambda: torch.tensor([0, 3, 5])),
    _fresh(lambda: torch.zeros(2, dtype=torch.int64)), _fresh(lambda: torch.ones(2, dtype=torch.float32)),
    _fresh(lambda: torch.zeros(5, 2, 8, dtype=torch.float32)))
OPTIONS = ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
           "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k")


@settings(max_examples=300, **SETTINGS)
@given(direction=st.sampled_from(["fwd", "bwd", "bwd_out"]), data=st.data(), through_ops=st.booleans())
def test_any_option_value_is_checked_before_the_schema(direction, data, through_ops, monkeypatch):
    """flash_attn_fwd/bwd given any value for one option (or optional tensor) either run or raise ArgumentError
    naming it (WorkspaceError for a cap too small): never the dispatcher's raw schema error, an OverflowError
    or another exception."""
    monkeypatch.delenv("FLASH_ATTN_CK_MAX_WORKSPACE_BYTES", raising=False)
    names = OPTIONS + {"fwd": ("return_attn_probs", "out"), "bwd": ("rng_state", "max_workspace_bytes"),
                       "bwd_out": ("rng_state", "max_workspace_bytes", "dq", "dk", "dv")}[direction]
    name = data.draw(st.sampled_from(names), label="argument")
    value = data.draw(st.one_of(ANY_VALUE, st.tuples(ANY_VALUE, ANY_VALUE)) if name == "window_size" else ANY_VALUE,
                      label="value")
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(5, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(7, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    options = dict(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                   cu_seqlens_k=torch.tensor([0, 4, 7], dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=4,
                   backend="reference")
    out, lse, _ = fa.flash_attn_fwd(q, k, v, **options)
    if direction == "fwd":
        call = functools.partial(fa.flash_attn_fwd, q, k, v, **options)
    else:
        grads = {} if direction == "bwd" else dict(zip(("dq", "dk", "dv"), map(torch.empty_like, (q, k, v))))
        call = functools.partial(fa.flash_attn_bwd, dout, q, k, v, out, lse, **grads, **options,
                                 rng_state=torch.tensor([1, 2]))
    try:
        with OpRecorder() if through_ops else contextlib.nullcontext():
            call(**{name: value})
    except fa.ArgumentError as error:
        assert re.match(rf"^{name}\b", str(error)), f"expected the message to name {name!r}: {error}"
    except fa.WorkspaceError:
        assert name == "max_workspace_bytes"


# ---- double backward ----------------------------------------------------------------------------------

def _shared_inputs(sharing: str):
    """(leaves, f): leaves requiring grad and a function of them calling the API with them shared as named."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
    opts = dict(causal=True, backend="reference")
    b, s, h, d = 1, 3, 1, 4       # small: gradgradcheck differentiates numerically element by element
    if sharing == "varlen q=k=v":
        cu = torch.tensor([0, 1, 3], dtype=torch.int32)
        return [leaf(s, h, d)], lambda x: fa.flash_attn_varlen_func(x, x, x, cu, cu, 2, 2, **opts)
    if sharing == "qkvpacked":
        return [leaf(b, s, 3, h, d)], lambda qkv: fa.flash_attn_qkvpacked_func(qkv, **opts)
    if sharing == "kvpacked":
        return [leaf(b, s, h, d), leaf(b, s, 2, h, d)], lambda q, kv: fa.flash_attn_kvpacked_func(q, kv, **opts)
    slots = {"distinct": "qkv", "q=k": "xxv", "k=v": "qxx", "q=v": "xkx", "q=k=v": "xxx"}[sharing]
    names = sorted(set(slots))
    leaves = [leaf(b, s, h, d) for _ in names]

    def f(*tensors):
        given = dict(zip(names, tensors))
        return fa.flash_attn_func(*(given[slot] for slot in slots), **opts)
    return leaves, f


@settings(max_examples=40, **SETTINGS)
@given(sharing=st.sampled_from(["distinct", "q=k", "k=v", "q=v", "q=k=v", "qkvpacked", "kvpacked", "varlen q=k=v"]),
       route=st.sampled_from(["backward", "grad", "grad allow_unused", "gradgradcheck"]), data=st.data())
def test_double_backward_raises(sharing, route, data):
    """Differentiating a gradient raises the README's error whatever the inputs share and however the second
    derivative is asked for (a graph's own backward, autograd.grad of one input, with allow_unused,
    gradgradcheck): never a None, a zero or a "not used in the graph"."""
    leaves, f = _shared_inputs(sharing)
    if route == "gradgradcheck":
        with pytest.raises(RuntimeError, match="the attention backward is not differentiable"):
            torch.autograd.gradgradcheck(f, leaves)
        return
    grads = torch.autograd.grad(f(*leaves).square().sum(), leaves, create_graph=True)
    penalty = grads[data.draw(st.integers(0, len(grads) - 1), label="gradient")].square().sum()
    wrt = leaves[data.draw(st.integers(0, len(leaves) - 1), label="with respect to")]
    differentiate = penalty.backward if route == "backward" else functools.partial(
        torch.autograd.grad, penalty, wrt, allow_unused=route == "grad allow_unused")
    with pytest.raises(RuntimeError, match="the attention backward is not differentiable"):
        differentiate()


def test_first_order_gradients_unchanged_by_create_graph():
    leaves, f = _shared_inputs("q=k=v")
    plain = torch.autograd.grad(f(*leaves).square().sum(), leaves)
    graphed = torch.autograd.grad(f(*leaves).square().sum(), leaves, create_graph=True)
    assert torch.equal(plain[0], graphed[0]) and graphed[0].requires_grad
    # Without create_graph nothing changes: plain gradients, no graph.
    assert not plain[0].requires_grad


# ---- the same checks on the Triton kernels, interpreted ---------------------------------------------------

_TRITON_RUNNER = r"""
import sys
import numpy as np
import triton.runtime.interpreter as interp
_patch_tensor = interp._patch_lang_tensor
def _patched(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
interp._patch_lang_tensor = _patched
import torch
from flash_attn_ck.backends.triton import TritonBackend, config
TritonBackend.device_types = frozenset({"cuda", "cpu"})
import test_edge_cases as t
half = torch.float16
tile = (config.INTERPRETER.forward.block_m, config.INTERPRETER.forward.block_n)
assert tile == (16, 16), tile
t.check_rows_outside_sequences("triton", half)
t.check_rows_outside_sequences("triton", half, ((0, 4), (0, 3)), 2, 1, (2, 2), True, exact_max=True)
t.check_rows_outside_sequences("triton", half, ((0, 9), (6, 9)), 0, 0, (3, 1), False, cap_fraction=0.5)
from hypothesis import given, settings, strategies as st
@settings(max_examples=6, database=None, **t.SETTINGS)
@given(**t.EMPTY_SEQUENCE_LAYOUTS, cap_fraction=st.sampled_from([None, 0.5, 0.3]))
def empty_sequence_layouts(**layout):
    t.check_rows_outside_sequences("triton", half, **layout)
empty_sequence_layouts()
t.check_window("triton", half, 10, 3, (1, 5))
t.check_window("triton", half, 40, 9, (3, 20))
t.check_window("triton", half, seqlens=[(20, 5), (7, 12), (0, 3), (15, 15)], window=(2, 9))
t.check_window("triton", half, 33, 20, (-1, 4), causal=False)
rows, keys = t.check_nonfinite_masked_keys("triton", half, s=96, window=(8, 0), bad=40, tile=tile)
assert (rows, keys) == (64, 48), (rows, keys)      # rows 32..63 and keys 16..63 share tiles with key 40
t.check_nonfinite_masked_keys("triton", half, s=96, window=(8, 0), bad=40, where="k", value=float("inf"), tile=tile)
t.check_varlen_nonfinite_elsewhere("triton", half)
t.check_dropout_independent_of_max_seqlen("triton", half)
print("PASS")
"""


def test_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=TEST_PYTHONPATH)
    env.pop("FLASH_ATTN_CK_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _TRITON_RUNNER], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# a case by name, for debugging: PYTHONPATH=tests python tests/api/test_edge_cases.py check_window
if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]() or "ok"))


@settings(max_examples=20, deadline=None)
@given(missing=st.sets(st.sampled_from(["cu_seqlens", "max_seqlen"]), min_size=1), total=st.integers(1, 12))
def test_a_packed_varlen_call_names_its_own_missing_arguments(missing, total):
    """flash_attn_varlen_qkvpacked_func has one cu_seqlens and one max_seqlen: a call missing either names exactly
    the arguments it has, each once (was 'need cu_seqlens, cu_seqlens, max_seqlen and max_seqlen (missing:
    max_seqlen, max_seqlen)')."""
    qkv = torch.randn(total, 3, 2, 8)
    given_args = dict(cu_seqlens=torch.tensor([0, total], dtype=torch.int32), max_seqlen=total)
    given_args.update(dict.fromkeys(missing))
    with pytest.raises(fa.ArgumentError) as caught:
        fa.flash_attn_varlen_qkvpacked_func(qkv, **given_args)
    message = str(caught.value)
    assert message.startswith(f"{sorted(missing)[0]}: varlen calls need cu_seqlens and max_seqlen "
                              f"(missing: {', '.join(sorted(missing))})"), message
    assert "_q" not in message and "_k" not in message


@settings(max_examples=30, **SETTINGS)
@given(stride=st.integers(2, 5), start=st.integers(0, 3), backward=st.booleans(), varlen=st.booleans())
def test_a_non_contiguous_rng_state_is_refused_before_anything_is_written(stride, start, backward, varlen):
    """rng_state [seed, offset] in a strided view (its values right, its elements apart): an ArgumentError naming it,
    from the forward and the backward alike, before an output is written (the kernels would read the offset at the
    next element: another keep pattern, silently)."""
    gen = torch.Generator().manual_seed(stride * 10 + start)
    q, k, v, extra = packed_if(varlen, *(torch.randn(2, 5, 2, 8, generator=gen) for _ in range(3)))
    storage = torch.full((start + stride + 1,), -1, dtype=torch.int64)
    storage[start], storage[start + stride] = 7, 9
    rng_state = storage[start::stride][:2]
    assert rng_state.tolist() == [7, 9] and rng_state.stride(0) == stride
    out, lse, _ = fa.flash_attn_fwd(q, k, v, dropout_p=0.3, rng_state=torch.tensor([7, 9]), backend="reference",
                                    **extra)
    targets = [torch.full_like(t, 7.0) for t in (q, k, v)] if backward else [torch.full_like(out, 7.0)]
    if backward:
        call = functools.partial(fa.flash_attn_bwd, torch.ones_like(out), q, k, v, out, lse, *targets)
    else:
        call = functools.partial(fa.flash_attn_fwd, q, k, v, out=targets[0])
    with pytest.raises(fa.ArgumentError, match=r"^rng_state: expected a contiguous \[seed, offset\] tensor"):
        call(dropout_p=0.3, rng_state=rng_state, backend="reference", **extra)
    assert all(bool((t == 7.0).all()) for t in targets)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 24), min_size=1, max_size=3), st.sampled_from([16, 40]), st.sampled_from([16, 68]),
       st.integers(0, 3))
def test_fp32_rows_that_attend_one_key_meet_the_2x_rule(queries, head_dim, head_dim_v, seed):
    """Rows of sequences with one key (and a sequence of one query row) in fp32 on the reference backend: autograd's
    softmax gives them dS = P (dP - D) = 0, and so does the backend (it computes fp32 calls' backward in fp64, where
    fp32's rowsum(dO * O) and dO . v differ by a unit of their rounding: 6-23x pt's error of the call)."""
    lengths = [(s_q, 1) for s_q in queries] + [(1, 13)]
    check_case(Config(seqlens=lengths, heads_q=6, heads_k=2, head_dim=head_dim, head_dim_v=head_dim_v,
                      dtype=torch.float32), seed=seed)
