"""torch's own context parallelism (torch.distributed.tensor.experimental) with flash_attn_ck (integrations/
torch_cp.py and the provider's guard in integrations/sdpa.py), on CPU: gloo, 2 and 3 processes, float64.

SDPA on CPU dispatches `_scaled_dot_product_flash_attention_for_cpu`, which torch's CP has no sharding rule
for, so these tests call the op torch's CP routes on CUDA, `aten._scaled_dot_product_flash_attention`, on
sequence-sharded DTensors with torch's CP dispatcher on: exactly what F.scaled_dot_product_attention reaches
under `context_parallel()` on a GPU. Shards come from torch's `_context_parallel_shard` (head-tail load
balancer for causal, none otherwise)."""

from __future__ import annotations

import itertools
import math
from functools import partial
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.attention as attention
import torch.nn.functional as F
from test_context_parallel import init, spawn, teardown
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp_module
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ck.integrations.sdpa as provider
from flash_attn_ck import ArgumentError
from flash_attn_ck.integrations.context_parallel import shard
from flash_attn_ck.integrations.torch_cp import install_torch_cp_handlers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
FLASH = torch.ops.aten._scaled_dot_product_flash_attention


def _inputs(world, h=4, h_k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = 4 * world
    q, dout = (torch.randn(2, h, seq, 16, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(2, h_k, seq, 16, dtype=torch.float64, generator=g) for _ in range(2))
    return q, k, v, dout


def _torch_shards(mesh, tensors, causal):
    """torch's own sharding: the head-tail balancer for causal (torch's default), none otherwise."""
    torch_cp_module._cp_options.enable_load_balance = causal
    balancer = _HeadTailLoadBalancer(tensors[0].shape[2], mesh.size(), torch.device("cpu")) if causal else None
    return torch_cp_module._context_parallel_shard(mesh, list(tensors), [2] * len(tensors), load_balancer=balancer)


def _cp_flash(mesh, local, dout, **kwargs):
    """The flash op on Shard(2) DTensors with torch's CP dispatcher on: this rank's out and dq, dk, dv."""
    leaves = [t.clone().requires_grad_() for t in local]
    out = FLASH(*(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in leaves), **kwargs)[0].to_local()
    return (out, *torch.autograd.grad(out, leaves, dout))


def _check_matches_sdpa(mesh, world):
    # Scales SDPA accepts and our kernels do not (0, negative) run rewritten (sdpa.positive_scale), dq times the sign.
    for causal, (h, h_k), scale in ((True, (4, 2), 0.3), (False, (4, 4), 0.3), (True, (3, 1), 0.3),
                                    (True, (4, 2), -0.3), (False, (4, 4), 0.0)):
        q, k, v, dout = _inputs(world, h, h_k, seed=world)
        local = _torch_shards(mesh, (q, k, v, dout), causal)
        with mock.patch("flash_attn_ck.integrations.context_parallel.ring.flash_attn_fwd",
                        wraps=provider.flash_attn_fwd) as spy:
            ours = _cp_flash(mesh, local[:3], local[3], is_causal=causal, scale=scale)
        assert spy.call_count > 0, "our ring ran"
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):    # torch's CPU flash kernel gives NaN for causal calls at a scale <= 0
            ref = F.scaled_dot_product_attention(*full, is_causal=causal, scale=scale, enable_gqa=h != h_k)
        expected = _torch_shards(mesh, (ref.detach(), *torch.autograd.grad(ref, full, dout)), causal)
        for name, o, r in zip(("out", "dq", "dk", "dv"), ours, expected, strict=True):
            torch.testing.assert_close(o, r, atol=1e-12, rtol=1e-10,
                                       msg=lambda m, name=name: f"{causal} scale {scale} {name}: {m}")


def _group_sum(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _check_dropout_gradients(mesh, world):
    """With dropout and the rng fixed, the group's loss's directional derivative equals what the gradients
    predict: each backward step used its own forward step's keep pattern (torch's ring fails this)."""
    q, k, v, dout = _inputs(world, seed=7)
    local = _torch_shards(mesh, (q, k, v, dout), True)
    directions = [torch.randn_like(t) for t in local[:3]]

    def loss(shift):
        torch.manual_seed(99)
        out = _cp_flash(mesh, [t + shift * d for t, d in zip(local[:3], directions)], local[3], dropout_p=0.25,
                        is_causal=True)[0]
        return _group_sum((out * local[3]).sum().item())

    torch.manual_seed(99)
    out, *grads = _cp_flash(mesh, local[:3], local[3], dropout_p=0.25, is_causal=True)
    predicted = _group_sum(sum((g * d).sum().item() for g, d in zip(grads, directions)))
    eps = 1e-6
    measured = (loss(eps) - loss(-eps)) / (2 * eps)
    assert math.isclose(measured, predicted, rel_tol=1e-6, abs_tol=1e-6), (measured, predicted)
    torch.manual_seed(99)
    without = _cp_flash(mesh, local[:3], local[3], is_causal=True)[0]
    assert not torch.allclose(out, without), "dropout dropped nothing"


def _installed_worker(rank, world, port):
    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    torch_cp_module._enable_context_parallel_dispatcher()
    try:
        with install_torch_cp_handlers():
            assert not provider.torch_ring_active()
            _check_matches_sdpa(mesh, world)
            _check_dropout_gradients(mesh, world)
            q, k, v, _ = _torch_shards(mesh, _inputs(world), True)
            with pytest.raises(provider.UnsupportedCall, match="FLASH_ATTENTION"):
                torch.ops.aten._scaled_dot_product_efficient_attention(
                    *(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (q, k, v)), None, True)
        assert provider.torch_ring_active(), "remove() restored torch's own entries"
        assert torch_cp_module.custom_ops[FLASH.default] is torch_cp_module._sdpa_handler
    finally:
        torch_cp_module._disable_context_parallel_dispatcher()
        teardown()


@pytest.mark.parametrize("world", [2, 3])
def test_torch_cp_runs_our_ring(world):
    """install_torch_cp_handlers: torch's CP (DTensor dispatch, torch's shards) equals single-process SDPA
    (causal with load balancing, non-causal without, GQA), dropout gradients belong to the forward's patterns,
    a fallback to another SDPA backend raises, and remove() restores torch's entries."""
    spawn(_installed_worker, world)


def _torch_ring_worker(rank, world, port):
    """Without the install: torch's ring template runs the provider per step (matches math SDPA), and dropout
    through it is refused while torch's CP dispatcher is on."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention
    init(rank, world, port)
    attention.register_flash_attention_impl("CP_CPU_TEST", register_fn=partial(provider.register, device_type="cpu"))
    attention.activate_flash_attention_impl("CP_CPU_TEST")
    torch_cp_module._cp_options.enable_load_balance = True
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 8 * world, 16, generator=g) for _ in range(3))
        local = [shard(t, seq_dim=2, layout="zigzag") for t in (q, k, v)]
        with mock.patch.object(provider, "flash_attn_fwd", wraps=provider.flash_attn_fwd) as spy:
            out = _templated_ring_attention(dist.group.WORLD, 2, FLASH, *local, is_causal=True)[0]
        assert spy.call_count == world
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        torch.testing.assert_close(out.double(), shard(ref, seq_dim=2, layout="zigzag"), atol=2e-6, rtol=1e-5)
        torch_cp_module._enable_context_parallel_dispatcher()
        assert provider.torch_ring_active()
        with pytest.raises(provider.UnsupportedCall, match="install_torch_cp_handlers"):
            _templated_ring_attention(dist.group.WORLD, 2, FLASH, *local, is_causal=True, dropout_p=0.2)
    finally:
        torch_cp_module._disable_context_parallel_dispatcher()
        attention.restore_flash_attention_impl()
        teardown()


def test_torch_ring_template_runs_the_provider_and_refuses_dropout():
    spawn(_torch_ring_worker, 2)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=str)
def test_installations_removed_in_any_order_restore_torchs_entries(order):
    """Three installations (strict ones replacing more entries than the non-strict one), removed in any order: each
    removal leaves the entries of the installations still in place, and at the end torch's own entries are back
    (before, removing an older one first left a newer one's saved copy of our handlers in place for good)."""
    ops = torch_cp_module.custom_ops
    before = dict(ops)
    handles, installed = [], {}       # installed: what each installation set
    for i, kwargs in enumerate([{}, dict(strict=False, kv_exchange="allgather"), dict(kv_exchange="a2a")]):
        handles.append(install_torch_cp_handlers(**kwargs))
        installed[i] = {op: ops[op] for op in handles[i].saved}
    assert ops[FLASH.default] is not before.get(FLASH.default)
    for step, i in enumerate(order):
        handles[i].remove()
        remaining = [j for j in range(3) if j not in order[:step + 1]]
        for op in ops:      # an op's entry is the newest remaining installation's that set it, else torch's
            setters = [j for j in remaining if op in installed[j]]
            expected = installed[max(setters)][op] if setters else before.get(op)
            assert ops.get(op) is expected, (order, step, op)
    assert ops == before


def test_the_hybrid_exchange_is_refused_for_torchs_one_dimensional_mesh():
    with pytest.raises(ArgumentError, match=r"^kv_exchange: expected one of .*got 'a2a\+ring'"):
        install_torch_cp_handlers(kv_exchange="a2a+ring")
