"""Context parallelism for the (b, s, h, d) API on torch.distributed collectives (NCCL, RCCL or gloo).

Every rank of `group` (world W) holds one shard of the sequence of q, k and v: `shard` cuts a full tensor
into 2W chunks of `c = s / 2W` rows and gives rank r two of them, `unshard` gathers them back.

- layout "zigzag" (head-tail load balancing, the default): chunks r and 2W - 1 - r, so every rank has the
  same causal work; "contiguous": chunks 2r and 2r + 1 (for non-causal calls either is balanced).
- kv_exchange "ring": K/V (packed in one buffer) travel around the ring with isend/irecv, the next step's
  transfer in flight while the current step computes. Per step and local query chunk, one forward call
  over the key chunks the chunk sees (a prefix of the held block, bottom-right causal when it ends with
  the chunk itself); the partial outputs are merged by their lse in fp32 (fp64 for fp64 inputs):
  `lse = logaddexp(lse, lse_i)`, `out = out * exp(lse_old - lse) + out_i * exp(lse_i - lse)`.
  Backward: the same steps with `flash_attn_bwd` given the merged out/lse (so D = rowsum(dO * O) is the
  global one), writing into preallocated per-step buffers; dQ accumulates locally in fp32 and dK/dV
  accumulate in fp32 buffers that travel around the ring and arrive back at their owner after W hops.
  Both transfers overlap compute: the next K/V block is posted before the step computes, and a block's
  dK/dV sums (sent on after the previous rank's step) arrive while this rank computes its parts.
  Causal or not; sliding windows are refused here (a window's block masks need a negative side).
- kv_exchange "allgather": K/V are all-gathered once (every rank then holds the full K/V); each local query
  chunk at global rows [q0, q0 + c) runs one call on the keys [start, end) it can see, where choosing
  `end` (q0 + c, or further for a right window) makes flash-attn's bottom-right alignment coincide with
  the global positions, so causal and any window (left, right) are exact. Backward: dK/dV partials over
  the full sequence, reduce-scattered back to the owners.

GQA (h_k < h) works in both. Varlen (`cu_seqlens`, ring only): every rank holds its two chunks of every
sequence (zigzag or contiguous per sequence); each step's calls are varlen over one chunk per sequence (`_Chunks`).
Refused, with an error that says why: dropout (each rank's keep pattern is drawn for its own blocks and cannot
follow the ring), varlen with the all-gather, ALiBi and softcap (not built).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..api import flash_attn_bwd, flash_attn_fwd
from ..core.errors import ArgumentError

LAYOUTS = ("zigzag", "contiguous")
KV_EXCHANGES = ("ring", "allgather")


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, int]:
    """The two global chunk indices (of 2 * world) that `rank` holds, in local order (increasing)."""
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


def _group_size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _bounds(length: int, cu_seqlens: torch.Tensor | None, world: int = 1) -> list[int]:
    """Sequence boundaries along the sequence dim: [0, length] dense, else cu_seqlens / world (a rank's shard)."""
    return [0, length] if cu_seqlens is None else [int(o) // world for o in cu_seqlens.tolist()]


def _split(x: torch.Tensor, seq_dim: int, bounds: list[int], parts: int) -> list[tuple[torch.Tensor, ...]]:
    """Per sequence, its `parts` equal pieces along seq_dim."""
    return [x.narrow(seq_dim, a, b - a).tensor_split(parts, dim=seq_dim) for a, b in itertools.pairwise(bounds)]


def shard(x: torch.Tensor, group=None, *, seq_dim: int = 1, layout: str = "zigzag",
          cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's shard of the full tensor `x` (every rank passes the same x): its two chunks, concatenated.
    Varlen (`cu_seqlens`, x packed (total, ...) with seq_dim=0): every sequence is cut into 2W chunks and the
    shard packs this rank's two chunks of each sequence, in sequence order (offsets cu_seqlens / W)."""
    world, rank = _group_size_rank(group)
    bounds = _bounds(x.shape[seq_dim], cu_seqlens)
    for a, b in itertools.pairwise(bounds):
        if (b - a) % (2 * world):
            raise ArgumentError(f"sequence length {b - a} must be a multiple of 2 * world size = {2 * world}")
    ids = chunk_ids(rank, world, layout)
    return torch.cat([chunks[i] for chunks in _split(x, seq_dim, bounds, 2 * world) for i in ids], dim=seq_dim)


def unshard(x: torch.Tensor, group=None, *, seq_dim: int = 1, layout: str = "zigzag",
            cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor from every rank's shard (all-gather, then the chunks back in sequence order)."""
    world, _ = _group_size_rank(group)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    return _in_sequence_order(gathered, world, layout, seq_dim, cu_seqlens)


def _in_sequence_order(shards: list[torch.Tensor], world: int, layout: str, seq_dim: int,
                       cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    per_rank = [_split(local, seq_dim, _bounds(local.shape[seq_dim], cu_seqlens, world), 2) for local in shards]
    ordered = []
    for sequence in range(len(per_rank[0])):
        chunks = [None] * (2 * world)
        for rank, local in enumerate(per_rank):
            for index, chunk in zip(chunk_ids(rank, world, layout), local[sequence], strict=True):
                chunks[index] = chunk
        ordered += chunks
    return torch.cat(ordered, dim=seq_dim)


@dataclass(frozen=True)
class _Chunks:
    """Where a rank's two local chunks lie in its shard, as indices `x[sel]`, and the flash-attn arguments of a
    call on them. Dense: (b, 2c, ...) shards, chunk i = rows [ic, (i + 1)c). Varlen: (total, ...) shards packing
    each sequence's two chunks; chunk i of every sequence = the packed rows `rows[i]` (int64 indices), and a
    call on them is varlen with `cu` (int32, one chunk per sequence) for queries and `seen * cu` for keys."""

    c: int = 0
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    cu: torch.Tensor | None = None
    max_c: int = 0

    @staticmethod
    def varlen(cu_seqlens: torch.Tensor, world: int, device: torch.device) -> _Chunks:
        bounds = _bounds(0, cu_seqlens, world)
        lengths = [(b - a) // 2 for a, b in itertools.pairwise(bounds)]
        rows = tuple(torch.cat([torch.arange(a + i * n, a + (i + 1) * n) for a, n in zip(bounds, lengths)]
                               + [torch.zeros(0, dtype=torch.int64)]).to(device) for i in (0, 1))
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        return _Chunks(rows=rows, cu=cu, max_c=max(lengths, default=0))

    def q(self, i: int) -> tuple:
        """Local chunk i of q, out, dout (seq dim 1 dense, 0 varlen)."""
        return (slice(None), slice(i * self.c, (i + 1) * self.c)) if self.rows is None else (self.rows[i],)

    def lse(self, i: int) -> tuple:
        """Local chunk i of the lse (b, h, s) or (h, total): the last dim."""
        return (Ellipsis, self.q(i)[-1])

    def keys(self, seen: int) -> tuple:
        """The first `seen` chunks of a held K/V block (per sequence)."""
        if self.rows is None:
            return (slice(None), slice(0, seen * self.c))
        return (slice(None),) if seen == 2 else (self.rows[0],)

    def workspace(self, buffer: torch.Tensor, seen: int) -> torch.Tensor:
        """A view of `buffer` (shaped like k) with the shape of `seen` chunks, for flash_attn_bwd to write."""
        return buffer[self.keys(seen)] if self.rows is None else buffer[:seen * self.rows[0].numel()]

    def options(self, seen: int) -> dict:
        if self.rows is None:
            return {}
        return dict(cu_seqlens_q=self.cu, cu_seqlens_k=self.cu * seen, max_seqlen_q=self.max_c,
                    max_seqlen_k=seen * self.max_c)


@dataclass(frozen=True)
class _Call:
    group: object
    world: int
    rank: int
    layout: str
    kv_exchange: str
    causal: bool
    window: tuple[int, int]
    softmax_scale: float | None
    deterministic: bool
    backend: object
    chunks: _Chunks

    def attend(self, q_chunk: int, kv_chunks: tuple[int, int]) -> tuple[int, bool]:
        """Ring step: how many leading chunks of the held K/V block query chunk `q_chunk` sees, and whether
        the last of them is its own (bottom-right causal). Local chunks are in increasing order, so the
        chunks a causal query sees are a prefix of the block."""
        if not self.causal:
            return len(kv_chunks), False
        seen = sum(index <= q_chunk for index in kv_chunks)
        return seen, seen > 0 and kv_chunks[seen - 1] == q_chunk

    def window_call(self, q_start: int, c: int, total: int) -> tuple[int, int, tuple[int, int]]:
        """All-gather: the keys [start, end) query rows [q_start, q_start + c) can see, and the flash-attn
        window on them that equals the global interval [i - left, i + right] (docs/integrations.md)."""
        left, right = self.window
        if self.causal:
            right = 0
        end = total if right < 0 else min(total, q_start + c + right)
        shift = end - c - q_start           # flash-attn's bottom-right offset beyond the global diagonal
        start = 0 if left < 0 else max(0, q_start - left)
        return start, end, (-1 if left < 0 else left + shift, -1 if right < 0 else right - shift)


def _kernel_options(call: _Call) -> dict:
    return dict(softmax_scale=call.softmax_scale, backend=call.backend)


def _merge(out, lse, block_out, block_lse):
    """Merge one block's (out, lse) into the running (out, lse) in the accumulation dtype (fp32; fp64 for
    fp64 inputs); `out` (b, c, h, d), lse (b, h, c), or varlen (t, h, d), (h, t). The first block (out None)
    starts them."""
    accum = _accum(block_out)
    block_out, block_lse = block_out.to(accum), block_lse.to(accum)
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)

    def weight(x):      # (b, h, c) -> (b, c, h, 1), varlen (h, t) -> (t, h, 1)
        return torch.exp(x - new_lse).transpose(-1, -2).unsqueeze(-1)

    return out * weight(lse) + block_out * weight(block_lse), new_lse


def _accum(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _ring_send_recv(buffers: list[torch.Tensor], call: _Call) -> tuple[list[torch.Tensor], list]:
    """Send `buffers` to the next rank and receive the previous rank's into new buffers (asynchronously)."""
    received = [torch.empty_like(b) for b in buffers]
    after = dist.get_global_rank(call.group, (call.rank + 1) % call.world)
    before = dist.get_global_rank(call.group, (call.rank - 1) % call.world)
    ops = [dist.P2POp(dist.isend, b, after, call.group) for b in buffers]
    ops += [dist.P2POp(dist.irecv, b, before, call.group) for b in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buffer: torch.Tensor, *likes: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for like in likes:
        out.append(buffer[offset:offset + like.numel()].view(like.shape))
        offset += like.numel()
    return out


# ---- ring ------------------------------------------------------------------------------------------

def _ring_blocks(k, v, call: _Call):
    """Per ring step: (step, the K/V block held now, its chunk ids). The next block's transfer is posted
    before the current one is handed out, so it travels while the caller computes."""
    kv, received, works = _pack(k, v), [], []
    for step in range(call.world):
        if step:
            _wait(works)
            (kv,) = received
        if step < call.world - 1:
            received, works = _ring_send_recv([kv], call)
        k_blk, v_blk = _unpack(kv, k, v)
        yield step, k_blk, v_blk, chunk_ids((call.rank - step) % call.world, call.world, call.layout)


def _ring_forward(q, k, v, call: _Call):
    sel = call.chunks
    q_chunks = chunk_ids(call.rank, call.world, call.layout)
    merged = [(None, None), (None, None)]
    for _, k_blk, v_blk, kv_chunks in _ring_blocks(k, v, call):
        for i, q_chunk in enumerate(q_chunks):
            seen, causal = call.attend(q_chunk, kv_chunks)
            if seen:
                keys = sel.keys(seen)
                out_i, lse_i, _ = flash_attn_fwd(q[sel.q(i)], k_blk[keys], v_blk[keys], causal=causal,
                                                 **sel.options(seen), **_kernel_options(call))
                merged[i] = _merge(*merged[i], out_i, lse_i)
    out = torch.empty_like(q)
    lse = merged[0][1].new_empty((*merged[0][1].shape[:-1], q.shape[q.dim() - 3]))
    for i, (out_i, lse_i) in enumerate(merged):
        out[sel.q(i)] = out_i.to(q.dtype)
        lse[sel.lse(i)] = lse_i
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, call: _Call):
    """Per step: post the next K/V block's transfer, compute this block's gradients into per-chunk buffers,
    then wait for the block's travelling dK/dV sums (sent by the previous rank after its own step, in flight
    during this step's compute), add this step's parts in the order the query chunks ran, and send them on."""
    sel = call.chunks
    q_chunks = chunk_ids(call.rank, call.world, call.layout)
    accum = _accum(q)
    dq = torch.zeros(q.shape, dtype=accum, device=q.device)
    dq_i = torch.empty_like(q[sel.q(0)])
    block_grads = [(torch.empty_like(k), torch.empty_like(v)) for _ in q_chunks]   # per local query chunk
    dkv_next, dkv_works = None, []
    for step, k_blk, v_blk, kv_chunks in _ring_blocks(k, v, call):
        parts = []
        for i, q_chunk in enumerate(q_chunks):
            seen, causal = call.attend(q_chunk, kv_chunks)
            if not seen:
                continue
            rows, keys = sel.q(i), sel.keys(seen)
            dk_i, dv_i = (sel.workspace(buffer, seen) for buffer in block_grads[i])
            flash_attn_bwd(dout[rows], q[rows], k_blk[keys], v_blk[keys], out[rows], lse[sel.lse(i)], dq_i, dk_i,
                           dv_i, causal=causal, deterministic=call.deterministic, **sel.options(seen),
                           **_kernel_options(call))
            dq[rows] += dq_i
            parts.append((keys, dk_i, dv_i))
        if step:
            _wait(dkv_works)
            (dkv,) = dkv_next
        else:
            dkv = torch.zeros(k.numel() + v.numel(), dtype=accum, device=k.device)   # this rank's own block
        dk_blk, dv_blk = _unpack(dkv, k, v)
        for keys, dk_i, dv_i in parts:
            dk_blk[keys] += dk_i
            dv_blk[keys] += dv_i
        # dK/dV move on every step, arriving home after W hops; their transfer overlaps the next step.
        dkv_next, dkv_works = _ring_send_recv([dkv], call)
    _wait(dkv_works)
    dk, dv = _unpack(dkv_next[0], k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- all-gather ------------------------------------------------------------------------------------

def _gather_kv(k, v, call: _Call):
    shards = [torch.empty_like(_pack(k, v)) for _ in range(call.world)]
    dist.all_gather(shards, _pack(k, v), group=call.group)
    per_rank = [_unpack(s, k, v) for s in shards]
    return [_in_sequence_order([p[j] for p in per_rank], call.world, call.layout, 1) for j in (0, 1)]


def _local_calls(q, call: _Call):
    """(rows of the local q, keys [start, end), window) per local query chunk."""
    c = q.shape[1] // 2
    total = 2 * c * call.world
    for i, q_chunk in enumerate(chunk_ids(call.rank, call.world, call.layout)):
        start, end, window = call.window_call(q_chunk * c, c, total)
        yield slice(i * c, (i + 1) * c), slice(start, end), window


def _allgather_forward(q, k, v, call: _Call):
    k_full, v_full = _gather_kv(k, v, call)
    outs, lses = [], []
    for rows, keys, window in _local_calls(q, call):
        out_i, lse_i, _ = flash_attn_fwd(q[:, rows], k_full[:, keys], v_full[:, keys], window_size=window,
                                         **_kernel_options(call))
        outs.append(out_i)
        lses.append(lse_i)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=-1)


def _allgather_backward(dout, q, k, v, out, lse, call: _Call):
    k_full, v_full = _gather_kv(k, v, call)
    accum = _accum(q)
    dq = torch.empty_like(q)
    dk_full = torch.zeros(k_full.shape, dtype=accum, device=k.device)
    dv_full = torch.zeros(v_full.shape, dtype=accum, device=v.device)
    dk_i, dv_i = torch.empty_like(k_full), torch.empty_like(v_full)
    for rows, keys, window in _local_calls(q, call):
        flash_attn_bwd(dout[:, rows], q[:, rows], k_full[:, keys], v_full[:, keys], out[:, rows], lse[..., rows],
                       dq[:, rows], dk_i[:, keys], dv_i[:, keys], window_size=window,
                       deterministic=call.deterministic, **_kernel_options(call))
        dk_full[:, keys] += dk_i[:, keys]
        dv_full[:, keys] += dv_i[:, keys]
    # Each rank's chunks, in rank order, then one reduce-scatter hands every rank the sum of its own.
    local = [_shards(t, call) for t in (dk_full, dv_full)]
    stacked = torch.cat([_pack(*[t[r] for t in local]) for r in range(call.world)])
    mine = torch.empty(stacked.numel() // call.world, dtype=accum, device=k.device)
    dist.reduce_scatter_tensor(mine, stacked, group=call.group)
    dk, dv = _unpack(mine, k, v)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _shards(full: torch.Tensor, call: _Call) -> list[torch.Tensor]:
    """Every rank's shard of a full (b, s, ...) tensor, in rank order."""
    chunks = full.chunk(2 * call.world, dim=1)
    return [torch.cat([chunks[i] for i in chunk_ids(r, call.world, call.layout)], dim=1) for r in range(call.world)]


# ---- autograd and the public function ------------------------------------------------------------

_FORWARD = {"ring": _ring_forward, "allgather": _allgather_forward}
_BACKWARD = {"ring": _ring_backward, "allgather": _allgather_backward}


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        out, lse = _FORWARD[call.kv_exchange](q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _BACKWARD[ctx.call.kv_exchange](dout.contiguous(), q, k, v, out, lse, ctx.call)
        return dq, dk, dv, None


def context_parallel_attn(q, k, v, group=None, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                          dropout_p=0.0, deterministic=False, layout="zigzag", kv_exchange="ring", backend=None,
                          return_lse=False, cu_seqlens=None, **unsupported):
    """Attention over a sequence sharded across `group` (see the module docstring), differentiable.

    Args:
        q, k, v: this rank's shards (b, s / W, h, d) and (b, s / W, h_k, d), as `shard(x, group, layout=layout)`
            cuts them (every rank the same b, h, d; s a multiple of 2W). Varlen: (total / W, h, d) and
            (total / W, h_k, d), as `shard(x, group, seq_dim=0, layout=layout, cu_seqlens=cu_seqlens)` cuts them.
        cu_seqlens: varlen (kv_exchange="ring" only): the full sequences' int32 offsets (b + 1,), the same on
            every rank and for q and k; every sequence's length a multiple of 2W.
        causal, window_size, softmax_scale, deterministic, backend: as for `flash_attn_func`, over the full
            sequence (windows: kv_exchange="allgather" only).
        layout: "zigzag" (head-tail load balancing) or "contiguous". kv_exchange: "ring" or "allgather".
        return_lse: also return this shard's softmax lse (b, h, s / W), varlen (h, total / W) (fp32; fp64 for
            fp64 inputs).

    Returns:
        this rank's shard of the output (b, s / W, h, d), varlen (total / W, h, d), as `shard` cuts the full output.

    Raises:
        ArgumentError: dropout, ALiBi, softcap, cu_seqlens_q/k, a window or varlen with the all-gather exchange
            (windows: the ring), or a bad shape/option.
    """
    if dropout_p:
        raise ArgumentError("dropout_p: not supported under context parallelism (each rank draws its keep "
                            "pattern for its own blocks; the pattern cannot follow K/V around the ring)")
    if unsupported:
        raise ArgumentError(f"{', '.join(sorted(unsupported))}: not supported by context_parallel_attn "
                            "(ALiBi and softcap are not built for context parallelism; varlen takes one "
                            "cu_seqlens for q and k)")
    if kv_exchange not in KV_EXCHANGES:
        raise ArgumentError(f"kv_exchange: expected one of {KV_EXCHANGES}, got {kv_exchange!r}")
    window = (int(window_size[0]), int(window_size[1]))
    if kv_exchange == "ring" and window != (-1, -1):
        raise ArgumentError("window_size: sliding windows need kv_exchange='allgather' (the ring's per-block "
                            "masks would need negative window sides)")
    if cu_seqlens is not None and kv_exchange != "ring":
        raise ArgumentError("cu_seqlens: varlen needs kv_exchange='ring' (not built for the all-gather)")
    world, rank = _group_size_rank(group)
    chunk_ids(rank, world, layout)
    if cu_seqlens is None:
        if q.shape[1] % 2 or q.shape[1] != k.shape[1]:
            raise ArgumentError(f"q and k shards must have the same even length (two chunks per rank), got "
                                f"{q.shape[1]} and {k.shape[1]}")
        chunks = _Chunks(c=q.shape[1] // 2)
    else:
        bounds = _bounds(0, cu_seqlens)
        if any((b - a) % (2 * world) for a, b in itertools.pairwise(bounds)):
            raise ArgumentError(f"cu_seqlens: every sequence length must be a multiple of 2 * world size = "
                                f"{2 * world}, got offsets {bounds}")
        if not q.shape[0] == k.shape[0] == bounds[-1] // world:
            raise ArgumentError(f"q and k shards must hold total / W = {bounds[-1] // world} rows, got "
                                f"{q.shape[0]} and {k.shape[0]}")
        chunks = _Chunks.varlen(cu_seqlens, world, q.device)
    group = dist.group.WORLD if group is None else group
    call = _Call(group, world, rank, layout, kv_exchange, bool(causal), window, softmax_scale, deterministic, backend,
                 chunks)
    out, lse = _ContextParallelAttention.apply(q, k.contiguous(), v.contiguous(), call)
    return (out, lse) if return_lse else out
