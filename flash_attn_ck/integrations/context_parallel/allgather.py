"""kv_exchange "allgather": K/V gathered in two asynchronous collectives (one per local chunk slot), one call per
local query chunk on the keys it sees (causal and any window exact); dK/dV reduce-scattered back."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...api import flash_attn_bwd, flash_attn_fwd
from .merge import accum_dtype
from .plan import Call
from .sharding import chunk_ids, rank_shards
from .transfers import PostedTransfers, pack, unpack


class _KVGather:
    """K/V of the whole sequence, gathered in two asynchronous all-gathers, one per local chunk slot j (every rank's
    j-th local chunk): with zigzag (and interleaved) slot 0 is the first half of the sequence, so a causal query
    chunk of the first half computes while the second half is still in flight. `keys(start, end)` waits only for
    the slots that hold chunks of [start, end) and places them in sequence order. The collectives are posted
    through `transfers`, which completes them if an error interrupts the call."""

    def __init__(self, k, v, call: Call, transfers: PostedTransfers):
        self.c, self.world = k.shape[1] // 2, call.world
        self.k = torch.empty((k.shape[0], 2 * self.c * self.world, *k.shape[2:]), dtype=k.dtype, device=k.device)
        self.v = torch.empty((v.shape[0], *self.k.shape[1:-1], v.shape[-1]), dtype=v.dtype, device=v.device)
        self.likes = [(k[:, j * self.c:(j + 1) * self.c], v[:, j * self.c:(j + 1) * self.c]) for j in (0, 1)]
        self.slot_of = {chunk: j for r in range(self.world)
                        for j, chunk in enumerate(chunk_ids(r, self.world, call.layout))}
        self.posted = [transfers.gather(pack(*like), call) for like in self.likes]
        self.placed = [False, False]
        self.layout = call.layout

    def keys(self, start: int, end: int):
        """(K, V) over the whole sequence, with at least the keys [start, end) received."""
        for j in sorted({self.slot_of[chunk] for chunk in range(start // self.c, -(-end // self.c))}):
            if not self.placed[j]:
                work, buffers = self.posted[j]
                work.wait()
                for r, buffer in enumerate(buffers):
                    chunk = chunk_ids(r, self.world, self.layout)[j]
                    rows = slice(chunk * self.c, (chunk + 1) * self.c)
                    self.k[:, rows], self.v[:, rows] = unpack(buffer, *self.likes[j])
                self.placed[j] = True
        return self.k, self.v


def _local_calls(q, call: Call):
    """(rows of the local q, keys [start, end), window) per local query chunk."""
    c = q.shape[1] // 2
    total = 2 * c * call.world
    for i, q_chunk in enumerate(chunk_ids(call.rank, call.world, call.layout)):
        start, end, window = call.window_call(q_chunk * c, c, total)
        yield slice(i * c, (i + 1) * c), slice(start, end), window


def allgather_forward(q, k, v, call: Call, out: torch.Tensor, transfers: PostedTransfers):
    gathered = _KVGather(k, v, call, transfers)
    lses = []
    for i, (rows, keys, window) in enumerate(_local_calls(q, call)):
        k_full, v_full = gathered.keys(keys.start, keys.stop)
        out_i, lse_i, _ = flash_attn_fwd(q[:, rows], k_full[:, keys], v_full[:, keys], window_size=window,
                                         **call.kernel(i))
        out[:, rows] = out_i
        lses.append(lse_i)
    transfers.wait()        # a slot no local query chunk needed (a window) is complete too
    return torch.cat(lses, dim=-1)


def allgather_backward(dout, q, k, v, out, lse, call: Call, transfers: PostedTransfers):
    """The forward's exchange again (regathering costs the all-gather; keeping the gathered K/V would cost W times
    the K/V shard per layer until the backward), overlapped the same way."""
    gathered = _KVGather(k, v, call, transfers)
    k_full, v_full = gathered.k, gathered.v
    accum = accum_dtype(q)
    dq = torch.empty_like(q, dtype=call.step_dtype)
    dk_full = torch.zeros(k_full.shape, dtype=accum, device=k.device)
    dv_full = torch.zeros(v_full.shape, dtype=accum, device=v.device)
    dk_i, dv_i = torch.empty_like(k_full, dtype=call.step_dtype), torch.empty_like(v_full, dtype=call.step_dtype)
    for i, (rows, keys, window) in enumerate(_local_calls(q, call)):
        gathered.keys(keys.start, keys.stop)
        # dK/dV of the two calls are added: in step_dtype, as dq (whose rows come from one call each)
        flash_attn_bwd(dout[:, rows], q[:, rows], k_full[:, keys], v_full[:, keys], out[:, rows], lse[..., rows],
                       dq[:, rows], dk_i[:, keys], dv_i[:, keys], window_size=window,
                       deterministic=call.options.deterministic, out_dtype=call.step_dtype, **call.kernel(i))
        dk_full[:, keys] += dk_i[:, keys]
        dv_full[:, keys] += dv_i[:, keys]
    transfers.wait()
    # Each rank's chunks, in rank order, then one reduce-scatter hands every rank the sum of its own.
    local = [rank_shards(t, call.world, call.layout) for t in (dk_full, dv_full)]
    stacked = torch.cat([pack(*[t[r] for t in local]) for r in range(call.world)])
    mine = torch.empty(stacked.numel() // call.world, dtype=accum, device=k.device)
    dist.reduce_scatter_tensor(mine, stacked, group=call.group)
    dk, dv = unpack(mine, k, v)
    return dq, dk, dv

