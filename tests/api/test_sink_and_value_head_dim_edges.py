"""The value head dim (d_v != d) and learnable sinks at the edges of the public functions and the ops: each
test holds a class of input that was mishandled, named for the rule it checks."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_edge_cases import SETTINGS

import flash_attn_ck as fa
from flash_attn_ck.core.errors import ArgumentError
from flash_attn_ck.core.options import AttentionOptions


@settings(max_examples=12, **SETTINGS)
@given(rank=st.sampled_from([0, 1, 2, 5]), varlen=st.booleans(), given_dq=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_flash_attn_bwd_with_a_sink_refuses_a_q_of_another_rank_naming_q(rank, varlen, given_dq, seed):
    """flash_attn_bwd given a learnable_sink and a q of the wrong rank (dense wants 4 dims, varlen 3): an ArgumentError
    naming q and the rank, before the sink is checked against q's heads, and nothing written."""
    if varlen and rank == 2:        # 2 dims is bad for both layouts; one draw of it is enough
        rank = 4
    gen = torch.Generator().manual_seed(seed)
    heads, d, d_v = 4, 16, 24
    rows = (7,) if varlen else (2, 7)
    k, v = torch.randn(*rows, 2, d, generator=gen), torch.randn(*rows, 2, d_v, generator=gen)
    out, dout = torch.randn(*rows, heads, d_v, generator=gen), torch.randn(*rows, heads, d_v, generator=gen)
    lse = torch.randn(heads, 7) if varlen else torch.randn(2, heads, 7)
    q = torch.randn((3,) * rank, generator=gen)
    dq = torch.full_like(q, 5.0) if given_dq else None
    varlen_args = dict(cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32),
                       cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32), max_seqlen_q=7, max_seqlen_k=7)
    with pytest.raises(ArgumentError, match=rf"^q: expected {3 if varlen else 4} dimensions"):
        fa.flash_attn_bwd(dout, q, k, v, out, lse, dq, **(varlen_args if varlen else {}),
                          learnable_sink=torch.randn(heads, generator=gen), backend="reference")
    if given_dq:
        assert (dq == 5.0).all()


@settings(max_examples=10, **SETTINGS)
@given(head_dim=st.integers(1, 256), head_dim_v=st.integers(1, 256), varlen=st.booleans())
def test_a_refused_call_is_described_with_both_head_dims(head_dim, head_dim_v, varlen):
    """A call no backend runs (here: the Triton backend, asked for on the CPU) is refused with a description of the
    call that gives v's head dim d_v where it differs from d (and only d where they are equal)."""
    rows = (5,) if varlen else (1, 5)
    q, k = torch.randn(*rows, 2, head_dim), torch.randn(*rows, 2, head_dim)
    v = torch.randn(*rows, 2, head_dim_v)
    varlen_args = dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                       cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32), max_seqlen_q=5, max_seqlen_k=5)
    with pytest.raises(fa.NoBackendError) as refused:
        fa.flash_attn_fwd(q, k, v, **(varlen_args if varlen else {}), backend="triton")
    described = str(refused.value).splitlines()[0]
    head_dims = f" d={head_dim} " if head_dim_v == head_dim else f" d={head_dim} d_v={head_dim_v} "
    assert head_dims in described, described


@settings(max_examples=8, **SETTINGS)
@given(head_dim=st.integers(1, 256), head_dim_v=st.integers(1, 256), lengths=st.lists(st.integers(1, 300), min_size=1,
                                                                                    max_size=4),
       seqused=st.booleans(), deterministic=st.booleans())
def test_backward_workspace_of_a_meta_varlen_call_that_needs_chunks_says_why_it_cannot_plan(
        head_dim, head_dim_v, lengths, seqused, deterministic):
    """backward_workspace from meta tensors (varlen, d_v drawn apart from d): under a cap the unchunked call fits, a
    plan; under one it does not, each CK-contract backend answers a WorkspaceError saying that the chunks need the
    cu_seqlens offsets, which meta tensors do not hold (not torch's NotImplementedError from reading them)."""
    meta = dict(device="meta")
    total = sum(lengths)
    q = torch.empty(total, 4, head_dim, dtype=torch.bfloat16, **meta)
    k = torch.empty(total, 2, head_dim, dtype=torch.bfloat16, **meta)
    v = torch.empty(total, 2, head_dim_v, dtype=torch.bfloat16, **meta)
    cu = torch.empty(len(lengths) + 1, dtype=torch.int32, **meta)
    call = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                seqused_k=torch.empty(len(lengths), dtype=torch.int32, **meta) if seqused else None,
                deterministic=deterministic, backends=("reference", "ck"))
    unchunked = fa.backward_workspace(q, k, v, **call, max_workspace_bytes=-1)
    for name, plan in unchunked.items():
        assert not isinstance(plan, str), plan
        assert len(fa.backward_workspace(q, k, v, **call, max_workspace_bytes=plan.peak_bytes)[name].chunks) == 1
        refused = fa.backward_workspace(q, k, v, **call, max_workspace_bytes=plan.peak_bytes - 1)[name]
        assert isinstance(refused, str) and refused.startswith(f"WorkspaceError: backend {name!r}"), refused
        assert "meta cu_seqlens" in refused, refused


@st.composite
def views_of_one_buffer(draw):
    """Two views of one buffer with equal strides and sizes of their own (column slices of a (rows, cols) layout
    at random offsets, as dk and dv of one dkv buffer are)."""
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    width = draw(st.integers(2, 24))
    strides = []
    step = width
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    buffer = torch.zeros(step + width)

    def view():
        cols = draw(st.integers(1, width))
        start = draw(st.integers(0, step + width - cols - sum((n - 1) * s for n, s in zip(shape, strides))))
        return buffer.as_strided((*shape, cols), (*strides, 1), start)
    return view(), view()


def _addresses(t: torch.Tensor) -> set[int]:
    offsets = torch.zeros((), dtype=torch.int64) + t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return set(offsets.flatten().tolist())


@settings(max_examples=200, **SETTINGS)
@given(pair=views_of_one_buffer())
def test_equally_strided_views_of_other_sizes_overlap_exactly_when_they_share_an_element(pair):
    """tensors_overlap on two equally strided views of one buffer whose sizes differ (dk, dv = dkv[..., :d],
    dkv[..., d:] with d_v != d): True exactly when an element address is common."""
    from flash_attn_ck.core.checks import tensors_overlap
    a, b = pair
    assert tensors_overlap(a, b) == bool(_addresses(a) & _addresses(b))


@settings(max_examples=10, **SETTINGS)
@given(head_dim=st.integers(1, 40), head_dim_v=st.integers(1, 40), shift=st.sampled_from([0, -1]),
       varlen=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_dk_and_dv_as_column_slices_of_one_buffer_are_accepted_with_d_v_other_than_d(head_dim, head_dim_v, shift,
                                                                                     varlen, seed):
    """flash_attn_bwd writing dk and dv into column slices of one (.., d + d_v) buffer (a fused kv projection's
    gradient): disjoint slices run and equal separate buffers whatever d and d_v; slices that share a column
    (shift -1) are refused naming dk, with nothing written."""
    gen = torch.Generator().manual_seed(seed)
    rows = (9,) if varlen else (2, 7)
    q = torch.randn(*rows, 4, head_dim, generator=gen)
    k, v = torch.randn(*rows, 2, head_dim, generator=gen), torch.randn(*rows, 2, head_dim_v, generator=gen)
    varlen_args = dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                       cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32), max_seqlen_q=5,
                       max_seqlen_k=5) if varlen else {}
    call = dict(**varlen_args, causal=True, backend="reference")
    out, lse, _ = fa.flash_attn_fwd(q, k, v, **call)
    dout = torch.randn(out.shape, generator=gen)
    separate = fa.flash_attn_bwd(dout, q, k, v, out, lse, **call)
    dkv = torch.full((*rows, 2, head_dim + head_dim_v), 7.0)
    dk, dv = dkv[..., :head_dim], dkv[..., head_dim + shift:head_dim + shift + head_dim_v]
    if shift == 0:
        fa.flash_attn_bwd(dout, q, k, v, out, lse, None, dk, dv, **call)
        assert torch.equal(dk, separate[1]) and torch.equal(dv, separate[2])
    else:
        with pytest.raises(ArgumentError, match=r"^dk: shares memory with dv"):
            fa.flash_attn_bwd(dout, q, k, v, out, lse, None, dk, dv, **call)
        assert (dkv == 7.0).all()


def test_backward_workspace_takes_every_option_flash_attn_bwd_takes():
    """backward_workspace plans "as for flash_attn_bwd": each of flash_attn_bwd's call options is a parameter of it
    (`backend` excepted: it plans for the `backends` it is given). out_dtype and learnable_sink raised TypeError."""
    options = {field.name for field in dataclasses.fields(AttentionOptions)} - {"backend"}
    taken_by_bwd = options & set(inspect.signature(fa.flash_attn_bwd).parameters)
    assert taken_by_bwd - set(inspect.signature(fa.backward_workspace).parameters) == set()


@settings(max_examples=20, **SETTINGS)
@given(batch=st.integers(1, 3), seqlen_k=st.integers(1, 300), heads_k=st.integers(1, 3), group=st.integers(2, 4),
       head_dim=st.sampled_from([32, 64, 128]), head_dim_v=st.sampled_from([32, 64, 128]), sink=st.booleans())
def test_backward_workspace_plans_fp32_gradients_of_a_gqa_call_in_fp32(batch, seqlen_k, heads_k, group, head_dim,
                                                                        head_dim_v, sink):
    """With GQA the reference (CK's contract) holds dK and dV per query head before the group sum: with
    out_dtype=fp32 those are fp32, 2 bytes more per element than bf16's, (d + d_v) elements a key row and head."""
    heads = heads_k * group
    q = torch.empty(batch, 5, heads, head_dim, device="meta", dtype=torch.bfloat16)
    k = torch.empty(batch, seqlen_k, heads_k, head_dim, device="meta", dtype=torch.bfloat16)
    v = torch.empty(batch, seqlen_k, heads_k, head_dim_v, device="meta", dtype=torch.bfloat16)
    learnable_sink = torch.zeros(heads, device="meta") if sink else None
    plans = {out_dtype: fa.backward_workspace(q, k, v, out_dtype=out_dtype, learnable_sink=learnable_sink,
                                              backends=("reference",))["reference"]
             for out_dtype in (None, torch.float32)}
    grown = plans[torch.float32].peak_bytes - plans[None].peak_bytes
    assert grown == 2 * batch * seqlen_k * heads * (head_dim + head_dim_v)
