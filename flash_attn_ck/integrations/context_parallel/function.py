"""The eager front ends' autograd Function: a planned call's forward and backward."""

from __future__ import annotations

import torch

from ...ops import not_twice_differentiable
from .directions import backward, forward
from .plan import Call


class ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: Call):
        out, lse, ctx.call = forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(dout, q, k, v, out, lse, ctx.call)
        grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # create_graph=True: as one GPU's backward, gradients that raise when differentiated, not a silent zero
            grads = not_twice_differentiable(grads, (q, k, v, dout))
        return *grads, None

