"""The ops' fakes (FakeTensorMode, and so torch.compile's tracing) refuse bad shapes, dtypes and aliases with the
eager op's own ArgumentError, and give good calls the eager op's output shapes: one error on every path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from flash_attn_ck.core.errors import ArgumentError
from flash_attn_ck.core.problem import row_stats_shape
from tests.opchecks import BWD_OPTIONS, fwd_args

ops = torch.ops.flash_attn_ck
OPS = ("fwd", "fwd_out", "bwd", "bwd_out")
BACKEND = "reference"


@st.composite
def good_calls(draw) -> dict:
    """A valid call of every op (random sizes, dense or varlen, GQA, d_v != d), as named tensors and options."""
    varlen = draw(st.booleans())
    batch = draw(st.integers(1, 3))
    heads_k = draw(st.integers(1, 2))
    heads = heads_k * draw(st.integers(1, 2))
    d, d_v = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    seqlens_q = draw(st.lists(st.integers(1, 4), min_size=batch, max_size=batch))
    seqlens_k = draw(st.lists(st.integers(1, 4), min_size=batch, max_size=batch))
    if varlen:
        rows_q, rows_k = (sum(seqlens_q),), (sum(seqlens_k),)
    else:
        rows_q, rows_k = (batch, seqlens_q[0]), (batch, seqlens_k[0])
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    def offsets(lengths):
        return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)

    q, k, v = randn(*rows_q, heads, d), randn(*rows_k, heads_k, d), randn(*rows_k, heads_k, d_v)
    return dict(
        q=q, k=k, v=v, out=randn(*rows_q, heads, d_v), dout=randn(*rows_q, heads, d_v),
        softmax_lse=torch.zeros(row_stats_shape(rows_q, heads)), dq=randn(*q.shape), dk=randn(*k.shape),
        dv=randn(*v.shape), learnable_sink=randn(heads) if draw(st.booleans()) else None,
        cu_seqlens_q=offsets(seqlens_q) if varlen else None, cu_seqlens_k=offsets(seqlens_k) if varlen else None,
        seqused_k=torch.tensor(seqlens_k, dtype=torch.int32) if varlen and draw(st.booleans()) else None,
        max_seqlen_q=max(seqlens_q) if varlen else 0, max_seqlen_k=max(seqlens_k) if varlen else 0,
        alibi_slopes=torch.rand(heads, generator=gen) if draw(st.booleans()) else None,
        dropout_p=0.0, softmax_scale=d ** -0.5, causal=draw(st.booleans()), window_left=-1, window_right=-1,
        softcap=0.0, deterministic=False, return_probs=False, backend=BACKEND, rng_state=None)


def run_op(name: str, call: dict):
    """The op `name` on the call's tensors (real or fake)."""
    q, k, v, *options = fwd_args(call)
    backward_options = (*(call[option] for option in BWD_OPTIONS), call["rng_state"], call["backend"])
    operands = tuple(call[t] for t in ("dout", "q", "k", "v", "out", "softmax_lse"))
    if name == "fwd":
        return ops.fwd(q, k, v, *options, learnable_sink=call["learnable_sink"])
    if name == "fwd_out":
        return ops.fwd_out(q, k, v, call["out"], *options, learnable_sink=call["learnable_sink"])
    if name == "bwd":
        return ops.bwd(*operands, *backward_options)
    return ops.bwd_out(*operands, call["dq"], call["dk"], call["dv"], *backward_options)


def run_fake(name: str, call: dict):
    """`run_op` under FakeTensorMode, every tensor converted by one mode (so views keep sharing a storage)."""
    with FakeTensorMode() as mode:
        fakes = {key: mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
                 for key, value in call.items()}
        return run_op(name, fakes)


def _grown(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with one more entry in `dim`."""
    return torch.cat((t, t.narrow(dim, 0, 1)), dim)


def _aliased_out(call: dict) -> dict:
    """out sharing memory with q: both views of one buffer, overlapping in their first head-dim columns."""
    q = call["q"]
    buffer = torch.randn(*q.shape[:-1], max(q.shape[-1], call["v"].shape[-1]))
    return {"q": buffer[..., :q.shape[-1]], "out": buffer[..., :call["v"].shape[-1]]}


# Each class of bad input: (the ops it applies to, whether it needs a dense / varlen call (None: either), the
# changed entries of a good call).
BAD_INPUTS = {
    "k and v with another batch": (OPS, "dense", lambda c: {"k": _grown(c["k"], 0), "v": _grown(c["v"], 0)}),
    "v with other rows than k": (OPS, None, lambda c: {"v": _grown(c["v"], -3)}),
    "v with other heads than k": (OPS, None, lambda c: {"v": _grown(c["v"], -2)}),
    "cu_seqlens_k of another batch": (OPS, "varlen", lambda c: {"cu_seqlens_k": _grown(c["cu_seqlens_k"], 0)}),
    "seqused_k of another batch": (OPS, "varlen", lambda c: {"seqused_k": torch.zeros(
        c["cu_seqlens_q"].shape[0], dtype=torch.int32)}),
    "seqused_k on a dense call": (OPS, "dense", lambda c: {"seqused_k": torch.zeros(c["q"].shape[0],
                                                                                    dtype=torch.int32)}),
    "alibi slopes of other heads": (OPS, None, lambda c: {"alibi_slopes": torch.rand(c["q"].shape[-2] + 1)}),
    "a sink of other heads": (("fwd", "fwd_out"), None,
                              lambda c: {"learnable_sink": torch.randn(c["q"].shape[-2] + 1)}),
    "out with another head dim than v": (("fwd_out", "bwd", "bwd_out"), None,
                                         lambda c: {"out": _grown(c["out"], -1)}),
    "dout with another head dim than v": (("bwd", "bwd_out"), None, lambda c: {"dout": _grown(c["dout"], -1)}),
    "dv with another head dim than v": (("bwd_out",), None, lambda c: {"dv": _grown(c["dv"], -1)}),
    "out with other rows": (("fwd_out", "bwd", "bwd_out"), None, lambda c: {"out": _grown(c["out"], 0)}),
    "out of another dtype": (("fwd_out", "bwd", "bwd_out"), None, lambda c: {"out": c["out"].double()}),
    "out sharing memory with q": (("fwd_out",), None, _aliased_out),
    "dq being q": (("bwd_out",), None, lambda c: {"dq": c["q"]}),
    "softmax_lse of other rows": (("bwd", "bwd_out"), None, lambda c: {"softmax_lse": _grown(c["softmax_lse"], -1)}),
    "dropout without rng_state": (("bwd", "bwd_out"), None, lambda c: {"dropout_p": 0.5}),
}


def _applies(layout: str | None, call: dict) -> bool:
    return layout is None or (layout == "varlen") == (call["cu_seqlens_q"] is not None)


@settings(deadline=None, max_examples=120)
@given(call=good_calls(), bad=st.sampled_from(sorted(BAD_INPUTS)), data=st.data())
def test_the_fakes_refuse_bad_input_with_the_eager_error(call, bad, data):
    op_names, layout, change = BAD_INPUTS[bad]
    if not _applies(layout, call):
        call = data.draw(good_calls().filter(lambda c: _applies(layout, c)))
    name = data.draw(st.sampled_from(op_names))
    call = {**call, **change(call)}
    with pytest.raises(ArgumentError) as eager:
        run_op(name, call)
    with pytest.raises(ArgumentError) as fake:
        run_fake(name, call)
    assert str(fake.value) == str(eager.value)


@settings(deadline=None, max_examples=40)
@given(call=good_calls(), name=st.sampled_from(OPS))
def test_the_fakes_give_good_calls_the_eager_shapes(call, name):
    real, fake = run_op(name, call), run_fake(name, call)
    real, fake = (results if isinstance(results, tuple) else (results,) for results in (real, fake))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
