"""Every validation rule raises an ArgumentError naming the argument, before anything is written."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_attn_ck as fa
from flash_attn_ck import ArgumentError

B, S_Q, S_K, H, H_K, D = 2, 5, 7, 4, 2, 16


def tensors(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S_Q, H, D, generator=g).to(dtype)
    k = torch.randn(B, S_K, H_K, D, generator=g).to(dtype)
    v = torch.randn(B, S_K, H_K, D, generator=g).to(dtype)
    return q, k, v


def strided_last_dim(shape):
    """Random bf16 values whose last dimension has stride 2."""
    return torch.randn(*shape[:-1], 2 * shape[-1]).bfloat16()[..., ::2]


FORWARD_CASES = {
    # name: (mutator of (q, k, v, kwargs), regex the message must contain)
    "q not a tensor": (lambda q, k, v, kw: ([1.0], k, v, kw), r"^q: expected a torch.Tensor"),
    "q wrong rank": (lambda q, k, v, kw: (q[0], k, v, kw), r"^q: expected 4 dimensions"),
    "int dtype": (lambda q, k, v, kw: (q.to(torch.int32), k, v, kw), r"^q: expected dtype"),
    "k dtype differs": (lambda q, k, v, kw: (q, k.half(), v, kw), r"^k: expected the dtype of q"),
    "v dtype differs": (lambda q, k, v, kw: (q, k, v.half(), kw), r"^v: expected the dtype of q"),
    "q last dim strided": (lambda q, k, v, kw: (strided_last_dim(q.shape), k, v, kw),
                           r"^q: expected a contiguous last dimension"),
    "head dim too large": (lambda q, k, v, kw: (*(torch.randn(1, 2, 1, 264).bfloat16() for _ in range(3)), kw),
                           r"^q: head dim must be in 1\.\.256"),
    "heads do not divide": (lambda q, k, v, kw: (torch.randn(B, S_Q, 3, D).bfloat16(), k, v, kw),
                            r"^k: the number of key/value heads \(2\) must divide"),
    "k shape": (lambda q, k, v, kw: (q, k[:1], v, kw), r"^k: expected shape"),
    "v shape": (lambda q, k, v, kw: (q, k, v[:, :3], kw), r"^v: expected shape"),
    "window": (lambda q, k, v, kw: (q, k, v, {**kw, "window_size": (-2, 0)}), r"^window_size: expected"),
    "dropout": (lambda q, k, v, kw: (q, k, v, {**kw, "dropout_p": 1.0}), r"^dropout_p: expected a probability"),
    "softcap": (lambda q, k, v, kw: (q, k, v, {**kw, "softcap": -1.0}), r"^softcap: expected"),
    "scale": (lambda q, k, v, kw: (q, k, v, {**kw, "softmax_scale": 0.0}),
              r"^softmax_scale: expected a finite positive"),
    "alibi dtype": (lambda q, k, v, kw: (q, k, v, {**kw, "alibi_slopes": torch.ones(H, dtype=torch.float64)}),
                    r"^alibi_slopes: expected dtype float32"),
    "alibi shape": (lambda q, k, v, kw: (q, k, v, {**kw, "alibi_slopes": torch.ones(H + 1)}),
                    r"^alibi_slopes: expected shape \(4,\) or \(2, 4\)"),
}


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_forward_checks_name_the_argument(case):
    mutate, pattern = FORWARD_CASES[case]
    q, k, v, kwargs = mutate(*tensors(), {})
    with pytest.raises(ArgumentError, match=pattern):
        fa.flash_attn_func(q, k, v, **kwargs)


def varlen_inputs():
    q = torch.randn(9, H, D).bfloat16()
    k = torch.randn(12, H_K, D).bfloat16()
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    return q, k, k.clone(), cu_q, cu_k


@pytest.mark.parametrize("change,pattern", [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int64)), r"^cu_seqlens_q: expected dtype int32"),
    (dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), r"^cu_seqlens_k: expected shape \(3,\)"),
    (dict(cu_seqlens_q=torch.tensor([0, 6, 4], dtype=torch.int32)), r"^cu_seqlens_q: expected non-decreasing"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 13], dtype=torch.int32)), r"^cu_seqlens_k: expected .* at most 12"),
    (dict(max_seqlen_q=3), r"^max_seqlen_q: 3 is smaller than the longest sequence"),
])
def test_varlen_checks_name_the_argument(change, pattern):
    q, k, v, cu_q, cu_k = varlen_inputs()
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=7)
    args.update(change)
    with pytest.raises(ArgumentError, match=pattern):
        fa.flash_attn_varlen_func(q, k, v, **args)


def forward_once():
    q, k, v = tensors()
    out, lse, _ = fa.flash_attn_fwd(q, k, v)
    dout = torch.randn_like(out)
    return q, k, v, out, lse, dout


BACKWARD_CASES = {
    "dout dtype": (lambda a: {**a, "dout": a["dout"].half()}, r"^dout: expected dtype bfloat16"),
    "out shape": (lambda a: {**a, "out": a["out"][:, :2]}, r"^out: expected shape"),
    "lse dtype": (lambda a: {**a, "softmax_lse": a["softmax_lse"].double()}, r"^softmax_lse: expected dtype float32"),
    "lse shape": (lambda a: {**a, "softmax_lse": a["softmax_lse"][:, :1]}, r"^softmax_lse: expected shape \(2, 4, 5\)"),
    "dq dtype": (lambda a: {**a, "dq": torch.zeros(B, S_Q, H, D, dtype=torch.float16)},
                 r"^dq: expected dtype bfloat16"),
    "dk shape": (lambda a: {**a, "dk": torch.zeros(B, S_K, H, D, dtype=torch.bfloat16)},
                 r"^dk: expected shape \(2, 7, 2, 16\)"),
    "dv stride": (lambda a: {**a, "dv": strided_last_dim((B, S_K, H_K, D))},
                  r"^dv: expected a contiguous last dimension"),
    "dq requires grad": (lambda a: {**a, "dq": a["dq"].clone().requires_grad_()}, r"^dq: requires grad"),
    "dv requires grad (non-leaf)": (lambda a: {**a, "dv": torch.zeros(B, S_K, H_K, D, requires_grad=True).bfloat16()},
                                    r"^dv: requires grad"),
    "rng_state missing": (lambda a: {**a, "dropout_p": 0.1}, r"^rng_state: required when dropout_p > 0"),
    "rng_state dtype": (lambda a: {**a, "dropout_p": 0.1, "rng_state": torch.zeros(2, dtype=torch.int32)},
                        r"^rng_state: expected dtype int64"),
    # a given rng_state is checked as the forward checks it, dropout or not
    "rng_state shape without dropout": (lambda a: {**a, "rng_state": torch.zeros(3, 2, dtype=torch.int64)},
                                        r"^rng_state: expected 1 dimensions"),
    "rng_state dtype without dropout": (lambda a: {**a, "rng_state": torch.zeros(2)},
                                        r"^rng_state: expected dtype int64"),
}


@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_backward_checks_name_the_argument_and_touch_nothing(case):
    q, k, v, out, lse, dout = forward_once()
    args = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse,
                dq=torch.full((B, S_Q, H, D), 3.0, dtype=torch.bfloat16),
                dk=torch.full((B, S_K, H_K, D), 3.0, dtype=torch.bfloat16))
    mutate, pattern = BACKWARD_CASES[case]
    args = mutate(args)
    snapshot = {name: t.clone() for name, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ArgumentError, match=pattern):
        fa.flash_attn_bwd(**args)
    for name, before in snapshot.items():
        assert torch.equal(args[name], before), f"{name} was modified by a failing call"


def test_unsupported_combination_names_backend_and_reason():
    q, k, v = tensors()
    with pytest.raises(fa.NoBackendError, match=r"backend 'ck' cannot run.*\n  ck: .*"):
        fa.flash_attn_func(q, k, v, softcap=5.0, backend="ck")


def test_unknown_backend_is_an_error():
    q, k, v = tensors()
    with pytest.raises(ValueError, match=r"backend='nope': expected one of"):
        fa.flash_attn_func(q, k, v, backend="nope")


def test_block_table_is_refused():
    q, k, v, cu_q, cu_k = varlen_inputs()
    with pytest.raises(ArgumentError, match=r"^block_table"):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, block_table=torch.zeros(1))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_views_of_one_buffer_in_two_storages_are_seen_to_share(data):
    """tensors_overlap on tensors whose storages are views of one buffer (torch.from_numpy of two slices of one
    array): whenever numpy says they share memory, so does tensors_overlap; byte spans that do not meet never
    count as shared."""
    from flash_attn_ck.core.checks import tensors_overlap
    buffer = np.zeros(64, np.float32)

    def view():
        start = data.draw(st.integers(0, 63))
        return buffer[start:data.draw(st.integers(start + 1, 64)):data.draw(st.integers(1, 3))]

    a, b = view(), view()
    overlap = tensors_overlap(torch.from_numpy(a), torch.from_numpy(b))
    if np.shares_memory(a, b):
        assert overlap
    spans = [(x.ctypes.data, x.ctypes.data + ((x.size - 1) * x.strides[0] + x.itemsize)) for x in (a, b)]
    if spans[0][1] <= spans[1][0] or spans[1][1] <= spans[0][0]:
        assert not overlap


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("kind", ["sparse", "nested"])
def test_a_tensor_without_strides_is_named(name, kind):
    """q, k or v in a sparse layout or nested: ArgumentError naming it (the kernels read elements by strides)."""
    q, k, v = tensors(torch.float32)
    given = dict(q=q, k=k, v=v)
    if kind == "sparse":
        given[name] = given[name].to_sparse()
        expected = rf"^{name}: expected a dense \(strided\) tensor, got layout sparse_coo"
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # nested tensors warn that their API is a prototype
            given[name] = torch.nested.nested_tensor(list(given[name]))
        expected = rf"^{name}: expected a dense \(strided\) tensor, got a nested tensor"
    with pytest.raises(ArgumentError, match=expected):
        fa.flash_attn_func(given["q"], given["k"], given["v"], backend="reference")


@settings(max_examples=60, deadline=None)
@given(longest=st.integers(1, 9), max_seqlen=st.integers(0, 12), batch=st.integers(1, 3))
def test_the_packed_varlen_function_names_its_own_arguments(longest, max_seqlen, batch):
    """flash_attn_varlen_qkvpacked_func has one cu_seqlens and one max_seqlen: its errors never name the _q/_k
    arguments of the function it calls."""
    lengths = [longest] + [1] * (batch - 1)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    qkv = torch.randn(int(cu[-1]), 3, 2, 8)
    try:
        fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max_seqlen, backend="reference")
    except ArgumentError as error:
        assert max_seqlen < longest
        assert re.search(r"\b(cu_seqlens|max_seqlen)_[qk]\b", str(error)) is None, str(error)
        assert str(error).startswith("max_seqlen: ")
    else:
        assert max_seqlen >= longest


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["softmax_scale", "softcap"]),
       value=st.one_of(st.floats(min_value=float(np.finfo(np.float32).max), exclude_min=True, allow_infinity=False),
                       st.integers(min_value=int(np.finfo(np.float32).max) + 2 ** 105)))
def test_a_scale_float32_cannot_hold_is_refused_before_writing(name, value):
    """softmax_scale and softcap reach the kernels as fp32: a finite Python number above float32's largest would
    arrive as inf (out 0 or NaN, lse inf, no error). ArgumentError naming the argument, `out=` untouched."""
    q, k, v = tensors()
    out = torch.full_like(q, 7.0)
    with pytest.raises(ArgumentError, match=rf"^{name}: expected .* float32 holds"):
        fa.flash_attn_fwd(q, k, v, out=out, backend="reference", **{name: value})
    assert (out == 7.0).all()


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.floats(min_value=0.0, max_value=float(np.finfo(np.float32).tiny), exclude_min=True,
                                 exclude_max=True),
                       st.just(float(np.finfo(np.float32).smallest_subnormal))))
def test_a_softcap_float32_cannot_hold_as_a_normal_number_is_refused(value):
    """A softcap below float32's smallest normal is 0 or a subnormal in the kernels, where a zero score over it is
    NaN (0 * inf): ArgumentError naming softcap, `out=` untouched; the smallest normal itself runs, finite."""
    q, k, v = tensors()
    out = torch.full_like(q, 7.0)
    with pytest.raises(ArgumentError, match=r"^softcap: expected .* normal number"):
        fa.flash_attn_fwd(q, k, v, out=out, backend="reference", softcap=value)
    assert (out == 7.0).all()
    tiny = float(np.finfo(np.float32).tiny)
    assert fa.flash_attn_func(torch.zeros_like(q), k, v, backend="reference", softcap=tiny).isfinite().all()


@settings(max_examples=40, deadline=None)
@given(sides=st.tuples(st.integers(-1, 8), st.integers(-1, 8)), kind=st.sampled_from(["dict", "set", "keys"]))
def test_a_window_without_order_is_refused(sides, kind):
    """window_size is (left, right): a mapping or a set (whose tuple() is its keys, in an order of its own) is
    refused naming window_size, whatever its entries."""
    window = {"dict": lambda: dict.fromkeys(sides), "set": lambda: set(sides),
              "keys": lambda: dict.fromkeys(sides).keys()}[kind]()
    q, k, v = tensors()
    with pytest.raises(ArgumentError, match=r"^window_size: expected \(left, right\)"):
        fa.flash_attn_func(q, k, v, window_size=window, backend="reference")


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_an_output_whose_strides_do_not_nest_is_refused_saying_so(data):
    """An `out` torch cannot prove free of overlap and whose strides do not nest: refused, the message saying the
    strides must nest (not that elements overlap, which they may not); one with a zero stride: overlapping."""
    q, k, v = tensors(torch.float32)
    shape = q.shape
    # strides (big, big, step, 1) with step > D: the first two dims step by one stride, so they do not nest
    big = data.draw(st.integers(D * H + 1, 4 * D * H), label="big")
    out = torch.zeros(big * (shape[0] + shape[1]) + H * D * 4).as_strided(shape, (big, big, D + 3, 1))
    with pytest.raises(ArgumentError, match=r"^out: an output's strides must nest"):
        fa.flash_attn_fwd(q, k, v, out=out, backend="reference")
    expanded = torch.zeros(shape[1:]).expand(shape)
    with pytest.raises(ArgumentError, match=r"^out: an output must not have overlapping elements"):
        fa.flash_attn_fwd(q, k, v, out=expanded, backend="reference")


@pytest.mark.parametrize("which", ["q", "k"])
def test_the_op_names_q_for_a_meta_q_beside_real_tensors(which):
    """Straight to the op (no API in front): a meta q beside real k, v is named as q, however the device check
    runs; a real q beside a meta k names k."""
    q, k, v = tensors()
    q, k = (q.to("meta"), k) if which == "q" else (q, k.to("meta"))
    pattern = r"^q: a meta tensor beside k on cpu" if which == "q" else r"^k: expected a tensor on cpu"
    with pytest.raises(ArgumentError, match=pattern):
        torch.ops.flash_attn_ck.fwd(q, k, v, None, None, None, None, None, None, 0.0, None, False, -1, -1, 0.0,
                                    False, False, "reference")


def test_an_op_backend_key_of_no_live_instance_is_an_argument_error():
    q, k, v = tensors()
    with pytest.raises(ArgumentError, match=r"^backend: 'reference@1' names no backend instance alive"):
        torch.ops.flash_attn_ck.fwd(q, k, v, None, None, None, None, None, None, 0.0, None, False, -1, -1, 0.0,
                                    False, False, "reference@1")


def test_backward_workspace_takes_one_backend_name():
    q, k, v = (t.to("meta") for t in tensors())
    assert list(fa.backward_workspace(q, k, v, backends="reference")) == ["reference"]
