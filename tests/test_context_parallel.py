"""Context parallelism (flash_attn_ck/integrations/context_parallel.py) on CPU: gloo, 2 and 4 processes on
localhost (torch.multiprocessing.spawn), reference backend, float64. Every rank checks its shard of the
output and of dq/dk/dv against single-process `flash_attn_func` on the full sequence, for each case, and the
varlen cases (ring, one cu_seqlens, an empty sequence among them) against `flash_attn_varlen_func`.
One spawn per world size runs all cases (a spawn costs seconds of imports)."""

from __future__ import annotations

import itertools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_attn_ck import ArgumentError, flash_attn_func, flash_attn_varlen_func
from flash_attn_ck.integrations.context_parallel import context_parallel_attn, shard, unshard

# (kv_exchange, layout, causal, window, h, h_k)
CASES = [
    *[(exchange, layout, causal, (-1, -1), h, h_k)
      for exchange, layout, causal, (h, h_k) in itertools.product(("ring", "allgather"), ("zigzag", "contiguous"),
                                                                  (False, True), ((4, 4), (4, 2)))],
    ("allgather", "zigzag", False, (5, 3), 4, 2),
    ("allgather", "zigzag", True, (6, -1), 4, 1),
    ("allgather", "contiguous", False, (-1, 4), 2, 2),
    ("allgather", "zigzag", False, (0, 0), 2, 1),
]
# varlen (ring): (layout, causal, h, h_k); sequence lengths in units of 2W, one of them empty
VARLEN_CASES = list(itertools.product(("zigzag", "contiguous"), (False, True), ((4, 4), (4, 2))))
VARLEN_UNITS = (3, 1, 0, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_inputs(seq, h, h_k, d=16, b=2):
    g = torch.Generator().manual_seed(seq * 31 + h * 7 + h_k)
    q = torch.randn(b, seq, h, d, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, seq, h_k, d, dtype=torch.float64, generator=g) for _ in range(2))
    return q, k, v, torch.randn(b, seq, h, d, dtype=torch.float64, generator=g)


def _check_case(case, world):
    exchange, layout, causal, window, h, h_k = case
    seq = 8 * world
    q, k, v, dout = _full_inputs(seq, h, h_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attn_func(*leaves, causal=causal, window_size=window, softmax_scale=0.4, backend="reference")
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    local = [shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attn(*local, causal=causal, window_size=window, softmax_scale=0.4, layout=layout,
                                kv_exchange=exchange, backend="reference")
    grads = torch.autograd.grad(out, local, shard(dout, layout=layout))
    torch.testing.assert_close(out, shard(ref, layout=layout), atol=1e-12, rtol=1e-10, msg=lambda m: f"{case} out: {m}")
    for name, grad, expected in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, shard(expected, layout=layout), atol=1e-12, rtol=1e-10,
                                   msg=lambda m, name=name: f"{case} {name}: {m}")
    torch.testing.assert_close(unshard(out.detach(), layout=layout), ref.detach(), atol=1e-12, rtol=1e-10)


def _check_varlen_case(case, world):
    layout, causal, (h, h_k) = case
    cu = torch.tensor([0, *itertools.accumulate(2 * world * n for n in VARLEN_UNITS)], dtype=torch.int32)
    total, max_len = int(cu[-1]), 2 * world * max(VARLEN_UNITS)
    g = torch.Generator().manual_seed(world * 13 + h_k + 2 * causal)
    q, dout = (torch.randn(total, h, 16, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(total, h_k, 16, dtype=torch.float64, generator=g) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attn_varlen_func(*leaves, cu, cu, max_len, max_len, causal=causal, softmax_scale=0.4,
                                 backend="reference")
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    cut = dict(seq_dim=0, layout=layout, cu_seqlens=cu)
    local = [shard(t, **cut).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attn(*local, cu_seqlens=cu, causal=causal, softmax_scale=0.4, layout=layout,
                                backend="reference")
    grads = torch.autograd.grad(out, local, shard(dout, **cut))
    for name, ours, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(ours, shard(expected.detach(), **cut), atol=1e-12, rtol=1e-10,
                                   msg=lambda m, name=name: f"varlen {case} {name}: {m}")
    torch.testing.assert_close(unshard(out.detach(), **cut), ref.detach(), atol=1e-12, rtol=1e-10)


def _worker(rank, world, port):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for case in CASES:
            _check_case(case, world)
        for case in VARLEN_CASES:
            _check_varlen_case(case, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_single_process(world):
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)


def test_refusals_without_a_process_group():
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    with pytest.raises(ArgumentError, match="dropout_p"):
        context_parallel_attn(q, q, q, dropout_p=0.1)
    with pytest.raises(ArgumentError, match="cu_seqlens_q"):
        context_parallel_attn(q, q, q, cu_seqlens_q=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ArgumentError, match="allgather"):
        context_parallel_attn(q, q, q, window_size=(4, 0))
    with pytest.raises(ArgumentError, match="kv_exchange='ring'"):
        context_parallel_attn(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 8], dtype=torch.int32),
                              kv_exchange="allgather")


def _torch_template_worker(rank, world, port):
    """torch's own ring template (`_templated_ring_attention`, head-tail load balancing) on the SDPA op that the
    provider overrides: it runs our kernels per step and merges their lse. The full `context_parallel()` path
    cannot run on CPU (docs/integrations.md): CPU SDPA calls `_scaled_dot_product_flash_attention_for_cpu`,
    which has no DTensor sharding strategy in torch 2.13."""
    from functools import partial
    from unittest import mock

    import torch.nn.attention as attention
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    import flash_attn_ck.integrations.sdpa as provider
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    attention.register_flash_attention_impl("CP_CPU_TEST", register_fn=partial(provider.register, device_type="cpu"))
    attention.activate_flash_attention_impl("CP_CPU_TEST")
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 8 * world, 16, generator=g) for _ in range(3))
        local = [shard(t, seq_dim=2, layout="zigzag") for t in (q, k, v)]
        with mock.patch.object(provider, "flash_attn_fwd", wraps=provider.flash_attn_fwd) as spy:
            out = _templated_ring_attention(dist.group.WORLD, 2, torch.ops.aten._scaled_dot_product_flash_attention,
                                            *local, is_causal=True)[0]
        assert spy.call_count == world
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        torch.testing.assert_close(out.double(), shard(ref, seq_dim=2, layout="zigzag"), atol=2e-6, rtol=1e-5)
    finally:
        attention.restore_flash_attention_impl()
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_torch_ring_template_runs_the_provider():
    mp.spawn(_torch_template_worker, args=(2, _free_port()), nprocs=2, join=True)
