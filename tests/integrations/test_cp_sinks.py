"""Learnable sinks under context parallelism (gloo on CPU, reference backend, float64): the sink is folded once into
each shard's merged lse, so every exchange's shards of out, dq, dk, dv equal one process's attention with the sink,
and the ranks' dsink parts sum to its dsink; eager and torch.compile(fullgraph=True) alike."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from test_context_parallel import _full_inputs, every_exchange, spawn

from flash_attn_ck import ArgumentError, flash_attn_func, flash_attn_varlen_func
from flash_attn_ck.integrations.context_parallel import context_parallel_attn, shard

TOL = dict(atol=1e-12, rtol=1e-10)
# (kv_exchange, layout, causal, window, h, h_k): h and h_k are multiplied by the world size for the a2a exchanges
CASES = [("ring", "zigzag", True, (-1, -1), 4, 2), ("ring", "contiguous", False, (-1, -1), 2, 2),
         ("allgather", "zigzag", True, (3, -1), 4, 1), ("a2a", "zigzag", True, (-1, -1), 2, 1)]


def _sink(h: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 1.0


def _group_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _check(attend, reference, inputs, dout, cut):
    """attend(q, k, v, sink) on this rank's shards against reference(...) on the full tensors."""
    full = [t.clone().requires_grad_() for t in inputs]
    ref = reference(*full)
    expected = torch.autograd.grad(ref, full, dout)
    local = [cut(t).requires_grad_() for t in inputs[:3]] + [inputs[3].clone().requires_grad_()]
    out = attend(*local)
    grads = torch.autograd.grad(out, local, cut(dout))
    torch.testing.assert_close(out, cut(ref.detach()), **TOL)
    for name, grad, e in zip(("dq", "dk", "dv"), grads[:3], expected[:3], strict=True):
        torch.testing.assert_close(grad, cut(e), **TOL, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(_group_sum(grads[3]), expected[3], **TOL, msg=lambda m: f"dsink: {m}")


def _check_dense(case, world, compiled=False):
    exchange, layout, causal, window, h, h_k = case
    if exchange == "a2a":
        h, h_k = h * world, h_k * world
    q, k, v, dout = _full_inputs(8 * world, h, h_k)
    options = dict(causal=causal, window_size=window, softmax_scale=0.4, backend="reference")

    def attend(q, k, v, sink):
        return context_parallel_attn(q, k, v, layout=layout, kv_exchange=exchange, learnable_sink=sink, **options)

    attend = torch.compile(attend, fullgraph=True, backend="aot_eager") if compiled else attend
    _check(attend, lambda q, k, v, sink: flash_attn_func(q, k, v, learnable_sink=sink, **options),
           (q, k, v, _sink(h)), dout, lambda t: shard(t, layout=layout))


def _check_varlen(world):
    cu = torch.tensor([0, *itertools.accumulate(2 * world * n for n in (3, 1, 0, 2))], dtype=torch.int32)
    total, longest = int(cu[-1]), 2 * world * 3
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(total, 4, 16, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(total, 2, 16, dtype=torch.float64, generator=g) for _ in range(2))
    _check(lambda q, k, v, sink: context_parallel_attn(q, k, v, cu_seqlens=cu, causal=True, learnable_sink=sink,
                                                       backend="reference"),
           lambda q, k, v, sink: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True,
                                                        learnable_sink=sink, backend="reference"),
           (q, k, v, _sink(4)), dout, lambda t: shard(t, seq_dim=0, cu_seqlens=cu))


def _check_hybrid(world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ring", "a2a"))
    h, h_k = 2 * world // 2, world // 2
    q, k, v, dout = _full_inputs(4 * world, h, h_k)
    _check(lambda q, k, v, sink: context_parallel_attn(q, k, v, mesh, causal=True, kv_exchange="a2a+ring",
                                                       learnable_sink=sink, backend="reference"),
           lambda q, k, v, sink: flash_attn_func(q, k, v, causal=True, learnable_sink=sink, backend="reference"),
           (q, k, v, _sink(h)), dout, lambda t: shard(t, mesh))


def test_every_exchange_with_a_sink_matches_one_process():
    spawn(every_exchange, 2, CASES, _check_dense, _check_varlen, _check_hybrid)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-{case[1]}")
def test_a_group_of_one_with_a_sink(one_process_group, case, compiled):
    torch._dynamo.reset()
    _check_dense(case, 1, compiled)


def test_a_bad_sink_is_refused_before_any_communication(one_process_group):
    q, k, v, _ = _full_inputs(8, 4, 2)
    with pytest.raises(ArgumentError, match=r"^learnable_sink: expected shape \(4,\)"):
        context_parallel_attn(q, k, v, causal=True, learnable_sink=torch.zeros(2), backend="reference")
