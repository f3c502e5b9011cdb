"""A value head dim of its own under context parallelism (gloo on CPU, reference backend, float64): v's shards with
d_v != d travel through every exchange (ring, varlen ring, all-gather, all-to-all, a2a+ring) and the lse merge, so
every shard of out, dq, dk, dv equals one process's attention; eager and torch.compile(fullgraph=True) alike."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_context_parallel import every_exchange, spawn

from flash_attn_ck import ArgumentError, flash_attn_func, flash_attn_varlen_func
from flash_attn_ck.integrations.context_parallel import context_parallel_attn, shard

TOL = dict(atol=1e-12, rtol=1e-10)
HEAD_DIM, HEAD_DIM_V = 16, 11       # d_v neither d nor a multiple of 8
# (kv_exchange, layout, causal, window, h, h_k): h and h_k are multiplied by the world size for the a2a exchanges
CASES = [("ring", "zigzag", True, (-1, -1), 4, 2), ("ring", "contiguous", False, (-1, -1), 2, 2),
         ("allgather", "zigzag", True, (3, -1), 4, 1), ("a2a", "zigzag", True, (-1, -1), 2, 1)]


def _inputs(rows: tuple[int, ...], h: int, h_k: int, seed: int = 0):
    """q (rows, h, d), k (rows, h_k, d), v (rows, h_k, d_v), dout (rows, h, d_v), float64."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((h, HEAD_DIM), (h_k, HEAD_DIM), (h_k, HEAD_DIM_V), (h, HEAD_DIM_V))
    return tuple(torch.randn(*rows, heads, dim, generator=g, dtype=torch.float64) for heads, dim in shapes)


def _check(attend, reference, q, k, v, dout, cut):
    """attend(q, k, v) on this rank's shards against reference(q, k, v) on the full tensors."""
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*full)
    expected = torch.autograd.grad(ref, full, dout)
    local = [cut(t).requires_grad_() for t in (q, k, v)]
    out = attend(*local)
    assert out.shape[-1] == HEAD_DIM_V
    grads = torch.autograd.grad(out, local, cut(dout))
    torch.testing.assert_close(out, cut(ref.detach()), **TOL)
    for name, grad, e in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        torch.testing.assert_close(grad, cut(e), **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _check_dense(case, world, compiled=False):
    exchange, layout, causal, window, h, h_k = case
    if exchange == "a2a":
        h, h_k = h * world, h_k * world
    options = dict(causal=causal, window_size=window, softmax_scale=0.4, backend="reference")

    def attend(q, k, v):
        return context_parallel_attn(q, k, v, layout=layout, kv_exchange=exchange, **options)

    attend = torch.compile(attend, fullgraph=True, backend="aot_eager") if compiled else attend
    _check(attend, lambda q, k, v: flash_attn_func(q, k, v, **options), *_inputs((2, 8 * world), h, h_k),
           lambda t: shard(t, layout=layout))


def _check_varlen(world):
    cu = torch.tensor([0, *itertools.accumulate(2 * world * n for n in (3, 1, 0, 2))], dtype=torch.int32)
    total, longest = int(cu[-1]), 2 * world * 3
    _check(lambda q, k, v: context_parallel_attn(q, k, v, cu_seqlens=cu, causal=True, backend="reference"),
           lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, backend="reference"),
           *_inputs((total,), 4, 2), lambda t: shard(t, seq_dim=0, cu_seqlens=cu))


def _check_hybrid(world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ring", "a2a"))
    _check(lambda q, k, v: context_parallel_attn(q, k, v, mesh, causal=True, kv_exchange="a2a+ring",
                                                 backend="reference"),
           lambda q, k, v: flash_attn_func(q, k, v, causal=True, backend="reference"),
           *_inputs((2, 4 * world), 2 * world // 2, world // 2), lambda t: shard(t, mesh))


def test_every_exchange_with_d_v_matches_one_process():
    spawn(every_exchange, 2, CASES, _check_dense, _check_varlen, _check_hybrid)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-{case[1]}")
def test_a_group_of_one_with_d_v(one_process_group, case, compiled):
    torch._dynamo.reset()
    _check_dense(case, 1, compiled)


def test_a_v_of_other_rows_is_refused_before_any_communication(one_process_group):
    q, k, v, _ = _inputs((2, 8), 4, 2)
    with pytest.raises(ArgumentError, match=r"^v: expected shape \(2, 8, 2, 11\), got \(2, 4, 2, 11\)"):
        context_parallel_attn(q, k, v[:, :4], causal=True, backend="reference")
