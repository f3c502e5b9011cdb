"""The eager front ends' autograd Function: a planned call's forward and backward."""

from __future__ import annotations

import torch

from ...ops import not_twice_differentiable
from .directions import backward, forward, shard_sink_gradient
from .plan import Call


class ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, call: Call):
        # sink: call.options.learnable_sink, an input of its own so that it gets a gradient
        out, lse, ctx.call = forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = backward(dout, q, k, v, out, lse, ctx.call)
        grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        sources = (q, k, v, dout)
        if sink is not None:
            grads += (shard_sink_gradient(dout, out, lse, sink),)
            sources += (sink,)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # create_graph=True: as one GPU's backward, gradients that raise when differentiated, not a silent zero
            grads = not_twice_differentiable(grads, sources)
        return *grads[:3], grads[3] if sink is not None else None, None

