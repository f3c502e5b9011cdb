"""kv_exchange "a2a+ring" over a 2-D mesh: the all-to-all inside the a2a group, the ring across the groups."""

from __future__ import annotations

import torch

from .a2a import grads_on_head_groups, on_head_groups
from .plan import Call
from .ring import ring_backward, ring_forward
from .transfers import PostedTransfers


def hybrid_forward(q, k, v, call: Call, out: torch.Tensor, transfers: PostedTransfers):
    """a2a inside the inner group (its members' pieces form the ring shard of h / A heads), the ring across."""
    return on_head_groups(q, k, v, call.inner_call(), out,
                          lambda q_h, k_h, v_h, out_h: ring_forward(q_h, k_h, v_h, call, out_h, transfers))


def hybrid_backward(dout, q, k, v, out, lse, call: Call, transfers: PostedTransfers):
    return grads_on_head_groups(dout, q, k, v, out, lse, call.inner_call(),
                                lambda dout_h, q_h, k_h, v_h, out_h, lse_h: ring_backward(
                                    dout_h, q_h, k_h, v_h, out_h, lse_h, call, transfers))

