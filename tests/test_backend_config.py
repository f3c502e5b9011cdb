"""Configuring backends without private state: `backend=` instances and `use_backend`."""

from __future__ import annotations

import pytest
import torch

import flash_attn_ck as fa
from flash_attn_ck.backends.reference import ReferenceBackend


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
