"""The forward and the backward of a planned call on its exchange, shared by every front end (the autograd
Function, the custom ops, torch's CP handlers in `torch_cp`)."""

from __future__ import annotations

import torch

from ...core.dropout import new_rng_state
from ...core.sink import fold_sink, rows_dot, sink_gradient
from .a2a import a2a_backward, a2a_forward
from .allgather import allgather_backward, allgather_forward
from .hybrid import hybrid_backward, hybrid_forward
from .merge import accum_dtype, out_like
from .plan import Call
from .ring import ring_backward, ring_forward
from .transfers import PostedTransfers

_FORWARD = {"ring": ring_forward, "allgather": allgather_forward, "a2a": a2a_forward,
            "a2a+ring": hybrid_forward}
_BACKWARD = {"ring": ring_backward, "allgather": allgather_backward, "a2a": a2a_backward,
             "a2a+ring": hybrid_backward}


def forward(q, k, v, call: Call, out: torch.Tensor | None = None,
            rng_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, Call]:
    """`(out, lse, call)`: this shard's output (written into `out` where given: any tensor with q's rows and heads
    and v's head dim whose last dim has stride 1), its lse (fp32; fp64 for fp64 inputs) and the call with its rng
    states (dropout: derived from `rng_state`, else from one fresh draw; `call.rng_base` is what the backward
    needs)."""
    if out is None:
        out = out_like(q, v)
    if call.chunks.empty:           # every shard is empty (shards have equal sizes): nothing to exchange
        lse_shape = (q.shape[-2], 0) if call.chunks.rows is not None else (q.shape[0], q.shape[-2], 0)
        return out, q.new_empty(lse_shape, dtype=accum_dtype(q)), call
    if call.options.dropout_p:
        call = call.with_rng(new_rng_state(q.device) if rng_state is None else rng_state)
    transfers = PostedTransfers()
    try:
        lse = _FORWARD[call.kv_exchange](q, k.contiguous(), v.contiguous(), call, out, transfers)
    except BaseException:
        transfers.drain()
        raise
    if call.options.learnable_sink is not None:     # once, on the merged lse: the steps run without it
        fold_sink(call.options.learnable_sink, out, lse)
    return out, lse, call


def shard_sink_gradient(dout, out, lse, sink: torch.Tensor) -> torch.Tensor:
    """This shard's part of dsink (the sink is replicated: the ranks' parts sum to its gradient, as any parameter's)."""
    return sink_gradient(sink, lse, rows_dot(dout, out, lse.dtype))


def backward(dout, q, k, v, out, lse, call: Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the accumulation dtype (fp32; fp64 for fp64 inputs), like q, k, v. `call`: forward's (or
    `plan_call`'s `.with_rng(the forward's rng_base)`). With a learnable sink, out and lse are the folded ones, which
    is all the steps need; dsink is `sink_gradient` of this shard's rows (`shard_sink_gradient`)."""
    accum = accum_dtype(q)
    if call.chunks.empty:
        return (torch.zeros(q.shape, dtype=accum, device=q.device), torch.zeros(k.shape, dtype=accum, device=k.device),
                torch.zeros(v.shape, dtype=accum, device=v.device))
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    transfers = PostedTransfers()
    try:
        return _BACKWARD[call.kv_exchange](dout, q, k.contiguous(), v.contiguous(), out, lse, call, transfers)
    except BaseException:
        transfers.drain()
        raise

