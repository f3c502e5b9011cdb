"""A small transformer block (attention + MLP, GQA) and the check that its `torch.compile(fullgraph=True)` form
agrees with eager on the output and every gradient: on the CPU (tests/api/test_compile.py) and on a GPU
(tests/gpu/test_compile_gpu.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from flash_attn_ck import flash_attn_func, flash_attn_varlen_func


class Block(nn.Module):
    """Pre-norm attention (GQA, causal, q and packed kv projections) + GELU MLP, with residuals."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=12, dropout_p=0.0, backend=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.dropout_p, self.backend = dropout_p, backend
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, heads * head_dim)
        self.wkv = nn.Linear(dim, 2 * kv_heads * head_dim)
        self.wo = nn.Linear(heads * head_dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, cu_seqlens=None, max_seqlen=None):
        h = self.norm1(x)
        q = self.wq(h).unflatten(-1, (self.heads, self.head_dim))
        # k and v are strided views of one projection, as in packed-kv models.
        k, v = self.wkv(h).unflatten(-1, (2, self.kv_heads, self.head_dim)).unbind(-3)
        if cu_seqlens is None:
            attn = flash_attn_func(q, k, v, self.dropout_p, causal=True, backend=self.backend)
        else:
            attn = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, self.dropout_p,
                                          causal=True, backend=self.backend)
        x = x + self.wo(attn.flatten(-2))
        return x + self.mlp(self.norm2(x))


def run(block, x, seed, **kwargs):
    """Output and the gradients of x and every parameter, for one random output gradient."""
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)         # the dropout pattern is drawn inside the op from this generator
    out = block(x, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator(x.device).manual_seed(1), device=x.device,
                             dtype=out.dtype))
    return out.detach(), [x.grad] + [p.grad for p in block.parameters()]


def check_compiled_matches_eager(device, dtype, backend, varlen, dropout_p, atol, rtol, compiler="inductor"):
    torch._dynamo.reset()           # a fresh compile per test: fullgraph must hold for this call
    torch.manual_seed(0)
    block = Block(dropout_p=dropout_p, backend=backend).to(device, dtype)
    compiled = torch.compile(copy.deepcopy(block), fullgraph=True, backend=compiler)
    if varlen:
        lengths = [3, 7, 1, 5]
        kwargs = dict(cu_seqlens=torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32),
                      max_seqlen=max(lengths))
        x = torch.randn(sum(lengths), 32, device=device, dtype=dtype)
    else:
        kwargs = {}
        x = torch.randn(2, 9, 32, device=device, dtype=dtype)

    out, grads = run(block, x, seed=123, **kwargs)
    out_c, grads_c = run(compiled, x, seed=123, **kwargs)
    torch.testing.assert_close(out_c, out, atol=atol, rtol=rtol)
    names = ["x"] + [name for name, _ in block.named_parameters()]
    for name, grad, grad_c in zip(names, grads, grads_c):
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad_c, grad, atol=atol, rtol=rtol, msg=lambda m: f"grad of {name}: {m}")
