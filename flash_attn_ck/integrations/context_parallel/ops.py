"""torch.compile: the two directions as custom ops (process group by name, as torch's flex CP passes it), so
fullgraph captures a call as one opaque node per direction."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core.errors import ArgumentError
from ...core.options import AttentionOptions
from .directions import backward, forward, shard_sink_gradient
from .group import process_group
from .merge import accum_dtype
from .plan import Call, plan_call


def _op_call(q, k, v, group_name, layout, kv_exchange, causal, window_left, window_right, softmax_scale, dropout_p,
             deterministic, backend, cu_seqlens, learnable_sink=None) -> Call:
    """The ops' arguments, validated (before any communication), as a `Call`."""
    options = AttentionOptions(softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                               dropout_p=dropout_p, deterministic=deterministic, backend=backend,
                               learnable_sink=learnable_sink)
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return plan_call(q, k, v, group, options=options, layout=layout, kv_exchange=kv_exchange, cu_seqlens=cu_seqlens)


@torch.library.custom_op("flash_attn_ck_cp::forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, layout: str, kv_exchange: str,
                causal: bool, window_left: int, window_right: int, softmax_scale: float | None, dropout_p: float,
                deterministic: bool, backend: str | None, cu_seqlens: torch.Tensor | None,
                learnable_sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, lse and the dropout rng base (empty without dropout); with a sink, out and lse folded."""
    call = _op_call(q, k, v, group_name, layout, kv_exchange, causal, window_left, window_right, softmax_scale,
                    dropout_p, deterministic, backend, cu_seqlens, learnable_sink)
    out, lse, call = forward(q, k, v, call)
    rng_base = call.rng_base if call.rng_base is not None else torch.empty(0, dtype=torch.int64, device=q.device)
    return out, lse, rng_base


@_forward_op.register_fake
def _(q, k, v, group_name, layout, kv_exchange, causal, window_left, window_right, softmax_scale, dropout_p,
      deterministic, backend, cu_seqlens, learnable_sink=None):
    lse_shape = (q.shape[-2], q.shape[0]) if cu_seqlens is not None else (q.shape[0], q.shape[2], q.shape[1])
    return (torch.empty_like(q), q.new_empty(lse_shape, dtype=accum_dtype(q)),
            q.new_empty((2 if dropout_p else 0,), dtype=torch.int64))


@torch.library.custom_op("flash_attn_ck_cp::backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, rng_base: torch.Tensor, group_name: str, layout: str, kv_exchange: str,
                 causal: bool, window_left: int, window_right: int, softmax_scale: float | None, dropout_p: float,
                 deterministic: bool, backend: str | None, cu_seqlens: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _op_call(q, k, v, group_name, layout, kv_exchange, causal, window_left, window_right, softmax_scale,
                    dropout_p, deterministic, backend, cu_seqlens).with_rng(rng_base if rng_base.numel() else None)
    # copy=True: the ring's dk and dv are views of one buffer, and a custom op's outputs must not alias.
    dq, dk, dv = backward(dout, q, k, v, out, lse, call)
    return dq.to(q.dtype, copy=True), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, rng_base, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *options, cu_seqlens, sink = inputs
    out, lse, rng_base = output
    ctx.save_for_backward(q, k, v, out, lse, rng_base, cu_seqlens, sink)
    ctx.options = options
    ctx.mark_non_differentiable(lse, rng_base)


def _op_backward(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, rng_base, cu_seqlens, sink = ctx.saved_tensors
    dq, dk, dv = _backward_op(dout.contiguous(), q, k, v, out, lse, rng_base, *ctx.options, cu_seqlens)
    dsink = None if sink is None else shard_sink_gradient(dout, out, lse, sink)
    return (dq, dk, dv) + (None,) * (len(ctx.options) + 1) + (dsink,)


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def compiled_call(q, k, v, group, *, softmax_scale, causal, window_size, dropout_p, deterministic, layout,
                  kv_exchange, backend, cu_seqlens, learnable_sink=None):
    """Under torch.compile: the custom op (one opaque node per direction, so fullgraph captures the call)."""
    if kv_exchange == "a2a+ring":
        raise ArgumentError("kv_exchange: 'a2a+ring' is not captured by torch.compile (its op takes one process "
                            "group, the hybrid a 2-D mesh); run it eagerly (fullgraph=False breaks the graph there)")
    group_name = process_group(group).group_name
    return _forward_op(q, k, v, group_name, layout, kv_exchange, causal, window_size[0], window_size[1],
                       softmax_scale, dropout_p, deterministic, backend, cu_seqlens, learnable_sink)[:2]

