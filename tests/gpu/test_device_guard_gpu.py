"""On one CUDA GPU: the device guard of pipeline/device.py around real kernels. The pipeline's view of the current
device is a stand-in that names another GPU, so every call enters torch's own `torch.cuda.device` guard with its
tensors' device and runs its kernels inside it; they must give what the same call gives without the guard, bit for
bit. The CPU tests of the guard's rule: tests/api/test_device_guard.py; two real GPUs are separate work."""

from __future__ import annotations

import types

import pytest
import torch

import flash_attn_ck
from flash_attn_ck.pipeline import device as guard_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (name, call): the dense and the varlen paths, the one-launch and the warp-specialised Triton kernels.
SHAPES = {"d128_causal_ws": dict(seqlen=2048, heads=(8, 2), head_dim=128, causal=True),
          "d80_one_launch": dict(seqlen=300, heads=(4, 4), head_dim=80, causal=False)}


def _run(shape: dict, varlen: bool) -> list[torch.Tensor]:
    """out and dq, dk, dv of one seeded call on the current GPU."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads_q, heads_k = shape["heads"]
    seqlen, d = shape["seqlen"], shape["head_dim"]
    q, k, v = (torch.randn(2 * seqlen, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for heads in (heads_q, heads_k, heads_k))
    if varlen:
        cu = torch.tensor([0, seqlen // 3, 2 * seqlen], device="cuda", dtype=torch.int32)
        out = flash_attn_ck.flash_attn_varlen_func(q, k, v, cu, cu, 2 * seqlen - seqlen // 3,
                                                   2 * seqlen - seqlen // 3, causal=shape["causal"])
    else:
        out = flash_attn_ck.flash_attn_func(*(t.view(2, seqlen, *t.shape[1:]) for t in (q, k, v)),
                                            causal=shape["causal"])
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    return [out.detach(), *grads]


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_kernels_run_inside_the_guard_of_their_tensors_gpu(monkeypatch, name, varlen):
    expected = _run(SHAPES[name], varlen)
    entered, real_guard = [], torch.cuda.device

    def guard(device):
        entered.append(torch.device(device))
        return real_guard(device)

    another_gpu = types.SimpleNamespace(current_device=lambda: torch.cuda.current_device() + 1, device=guard)
    monkeypatch.setattr(guard_module, "torch", types.SimpleNamespace(cuda=another_gpu))
    guarded = _run(SHAPES[name], varlen)
    assert entered and set(entered) == {torch.device("cuda", torch.cuda.current_device())}, entered
    assert len(entered) >= 2, "the forward and the backward each enter the guard"
    assert all(torch.equal(a, b) for a, b in zip(expected, guarded))
