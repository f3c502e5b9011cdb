"""kv_exchange "a2a" (all-to-all over heads, DeepSpeed Ulysses): sequence shards of all heads <-> the whole sequence
of h / W heads, one kernel call there."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...api import flash_attn_bwd, flash_attn_fwd
from .merge import out_like
from .plan import Call
from .sharding import in_sequence_order, rank_shards
from .transfers import PostedTransfers


def _sequence_to_heads(tensors: list[torch.Tensor], call: Call) -> list[torch.Tensor]:
    """One all-to-all: each (b, s / W, H, ...) shard (H a multiple of W, one dtype) -> (b, s, H / W, ...), the whole
    sequence in order for this rank's H / W heads (head group = rank)."""
    w = call.world
    parts = [t.unflatten(2, (w, t.shape[2] // w)).movedim(2, 0).reshape(w, -1) for t in tensors]
    received = torch.empty_like(torch.cat(parts, dim=1))
    dist.all_to_all_single(received, torch.cat(parts, dim=1), group=call.group)
    results, offset = [], 0
    for t, part in zip(tensors, parts, strict=True):
        per_rank = received[:, offset:offset + part.shape[1]].reshape(w, *t.shape[:2], t.shape[2] // w, *t.shape[3:])
        results.append(in_sequence_order(list(per_rank), w, call.layout, 1))
        offset += part.shape[1]
    return results


def _heads_to_sequence(tensors: list[torch.Tensor], call: Call) -> list[torch.Tensor]:
    """The inverse of `_sequence_to_heads`: (b, s, H / W, ...) of this rank's head group -> its (b, s / W, H, ...)
    shard of every head."""
    w = call.world
    parts = [torch.stack(rank_shards(t, call.world, call.layout)).reshape(w, -1) for t in tensors]
    received = torch.empty_like(torch.cat(parts, dim=1))
    dist.all_to_all_single(received, torch.cat(parts, dim=1), group=call.group)
    results, offset = [], 0
    for t, part in zip(tensors, parts, strict=True):
        per_rank = received[:, offset:offset + part.shape[1]].reshape(w, t.shape[0], t.shape[1] // w, *t.shape[2:])
        results.append(per_rank.movedim(0, 2).flatten(2, 3))
        offset += part.shape[1]
    return results


def on_head_groups(q, k, v, heads_call: Call, out: torch.Tensor, attend):
    """All-to-all to the head groups of `heads_call`'s group, `attend(q_h, k_h, v_h, out_h) -> lse_h` there, and
    out (written into `out`) and the lse back to the shards."""
    q_h, = _sequence_to_heads([q], heads_call)
    k_h, v_h = _sequence_to_heads([k, v], heads_call)
    out_h = out_like(q_h, v_h)
    lse_h = attend(q_h, k_h, v_h, out_h)
    out_s, = _heads_to_sequence([out_h], heads_call)
    lse_s, = _heads_to_sequence([lse_h.transpose(1, 2)], heads_call)
    out.copy_(out_s)
    return lse_s.transpose(1, 2).contiguous()


def grads_on_head_groups(dout, q, k, v, out, lse, heads_call: Call, attend_backward):
    """The forward's exchanges again (q, out, dout in one all-to-all; k, v in another; lse), `attend_backward(dout_h,
    q_h, k_h, v_h, out_h, lse_h) -> dq_h, dk_h, dv_h` there, and the gradients back to their shards."""
    q_h, out_h, dout_h = _sequence_to_heads([q, out, dout], heads_call)
    k_h, v_h = _sequence_to_heads([k, v], heads_call)
    lse_h, = _sequence_to_heads([lse.transpose(1, 2)], heads_call)
    dq_h, dk_h, dv_h = attend_backward(dout_h, q_h, k_h, v_h, out_h, lse_h.transpose(1, 2).contiguous())
    dq, = _heads_to_sequence([dq_h], heads_call)
    dk, dv = _heads_to_sequence([dk_h, dv_h], heads_call)
    return dq, dk, dv


def a2a_forward(q, k, v, call: Call, out: torch.Tensor, transfers: PostedTransfers):
    def attend(q_h, k_h, v_h, out_h):      # the whole sequence: one call
        result, lse_h, _ = flash_attn_fwd(q_h, k_h, v_h, causal=call.options.causal,
                                          window_size=call.options.window_size, **call.kernel(0))
        out_h.copy_(result)
        return lse_h
    return on_head_groups(q, k, v, call, out, attend)


def a2a_backward(dout, q, k, v, out, lse, call: Call, transfers: PostedTransfers):
    def attend_backward(dout_h, q_h, k_h, v_h, out_h, lse_h):
        return flash_attn_bwd(dout_h, q_h, k_h, v_h, out_h, lse_h, causal=call.options.causal,
                              window_size=call.options.window_size, deterministic=call.options.deterministic,
                              **call.kernel(0))[:3]
    return grads_on_head_groups(dout, q, k, v, out, lse, call, attend_backward)

