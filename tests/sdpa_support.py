"""Shared by the SDPA provider tests (CPU and GPU): activating a registered provider for a block, a spy on
the provider's forward, and a small attention layer that calls SDPA (flash backend, causal, GQA)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch.nn.attention as attention
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ck.integrations.sdpa as provider


@contextlib.contextmanager
def activated(name: str):
    """SDPA's flash backend is the registered provider `name` within the block."""
    attention.activate_flash_attention_impl(name)
    try:
        yield
    finally:
        attention.restore_flash_attention_impl()


@contextlib.contextmanager
def forward_spy():
    """A mock wrapping the provider's calls into our forward (it still runs): `.call_count` says it ran."""
    with mock.patch.object(provider, "flash_attn_fwd", wraps=provider.flash_attn_fwd) as fwd:
        yield fwd


class TinyAttention(nn.Module):
    """Projections + SDPA (causal, GQA 4/2) + output projection."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = nn.Linear(dim, heads * head_dim)
        self.wkv = nn.Linear(dim, 2 * kv_heads * head_dim)
        self.wo = nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        q = self.wq(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in self.wkv(x).unflatten(-1, (2, self.kv_heads, self.head_dim)).unbind(2))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(attn.transpose(1, 2).flatten(-2))
