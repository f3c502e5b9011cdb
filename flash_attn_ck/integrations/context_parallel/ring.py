"""kv_exchange "ring": K/V travel around the ring, one kernel call per step, partial results merged by lse; the
backward's dK/dV travel with them and arrive home after W hops."""

from __future__ import annotations

import torch

from ...api import flash_attn_bwd, flash_attn_fwd
from .merge import accum_dtype, merge
from .plan import Call
from .sharding import chunk_ids
from .transfers import PostedTransfers, pack, unpack


def _ring_blocks(k, v, call: Call, transfers: PostedTransfers):
    """Per ring step: (step, the K/V block held now, its chunk ids). The next block's transfer is posted
    before the current one is handed out, so it travels while the caller computes."""
    kv = pack(k, v)
    received: list[torch.Tensor] = []
    for step in range(call.world):
        if step:
            transfers.wait()
            (kv,) = received
        if step < call.world - 1:
            received = transfers.post([kv], call)
        k_blk, v_blk = unpack(kv, k, v)
        yield step, k_blk, v_blk, chunk_ids((call.rank - step) % call.world, call.world, call.layout)


def ring_forward(q, k, v, call: Call, out: torch.Tensor, transfers: PostedTransfers):
    sel = call.chunks
    merged: tuple[torch.Tensor, torch.Tensor] | None = None      # (out, lse) of the steps so far
    for step, k_blk, v_blk, kv_chunks in _ring_blocks(k, v, call, transfers):
        for index, part in enumerate(call.step_calls(kv_chunks)):
            rows, keys = sel.rows_of(part.q_chunks), sel.keys(part.seen)
            out_i, lse_i, _ = flash_attn_fwd(q[rows], k_blk[keys], v_blk[keys], causal=part.causal,
                                             out_dtype=call.step_dtype, **sel.options(part.seen, len(part.q_chunks)),
                                             **call.kernel(2 * step + index))
            if merged is None:        # the first step (the rank's own block) covers every local row
                merged = merge(None, None, out_i, lse_i)
            else:
                out_acc, lse_acc = merged
                out_acc[rows], lse_acc[(Ellipsis, rows[-1])] = merge(out_acc[rows], lse_acc[(Ellipsis, rows[-1])],
                                                                     out_i, lse_i)
    if merged is None:
        raise TypeError("a ring has at least one step")
    out.copy_(merged[0])
    return merged[1]


def ring_backward(dout, q, k, v, out, lse, call: Call, transfers: PostedTransfers):
    """Per step: post the next K/V block's transfer, compute this block's gradients into per-call buffers,
    then wait for the block's travelling dK/dV sums (sent by the previous rank after its own step, in flight
    during this step's compute), add this step's parts in the order the calls ran, and send them on."""
    sel = call.chunks
    accum = accum_dtype(q)
    dq = torch.zeros(q.shape, dtype=accum, device=q.device)
    dq_buffer = torch.empty_like(q, dtype=call.step_dtype)
    block_grads = [(torch.empty_like(k, dtype=call.step_dtype), torch.empty_like(v, dtype=call.step_dtype))
                   for _ in range(2)]   # per call of a step
    dkv_transfers = PostedTransfers()
    dkv_next: list[torch.Tensor] = []
    try:
        for step, k_blk, v_blk, kv_chunks in _ring_blocks(k, v, call, transfers):
            parts = []
            for index, part in enumerate(call.step_calls(kv_chunks)):
                rows, keys = sel.rows_of(part.q_chunks), sel.keys(part.seen)
                dq_i = sel.row_workspace(dq_buffer, len(part.q_chunks))
                dk_i, dv_i = (sel.workspace(buffer, part.seen) for buffer in block_grads[index])
                flash_attn_bwd(dout[rows], q[rows], k_blk[keys], v_blk[keys], out[rows], lse[(Ellipsis, rows[-1])],
                               dq_i, dk_i, dv_i, causal=part.causal, deterministic=call.options.deterministic,
                               out_dtype=call.step_dtype, **sel.options(part.seen, len(part.q_chunks)),
                               **call.kernel(2 * step + index))
                dq[rows] += dq_i
                parts.append((keys, dk_i, dv_i))
            if step:
                dkv_transfers.wait()
                (dkv,) = dkv_next
            else:
                dkv = torch.zeros(k.numel() + v.numel(), dtype=accum, device=k.device)   # this rank's own block
            dk_blk, dv_blk = unpack(dkv, k, v)
            for keys, dk_i, dv_i in parts:
                dk_blk[keys] += dk_i
                dv_blk[keys] += dv_i
            # dK/dV move on every step, arriving home after W hops; their transfer overlaps the next step.
            dkv_next = dkv_transfers.post([dkv], call)
        dkv_transfers.wait()
    except BaseException:
        dkv_transfers.drain()
        raise
    dk, dv = unpack(dkv_next[0], k, v)
    return dq, dk, dv

