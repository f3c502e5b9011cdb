"""Context parallelism on torch.distributed collectives (NCCL, RCCL or gloo): attention over a sequence whose
shards live on the ranks of a process group.

Every rank of `group` (world W) holds one shard of the sequence of q, k and v: `shard` cuts a full tensor
into 2W chunks of `c = s / 2W` rows and gives rank r two of them, `unshard` gathers them back.

- layout "zigzag" (head-tail load balancing, the default): chunks r and 2W - 1 - r, so every rank has the
  same causal work. This is torch's `_HeadTailLoadBalancer` order (`torch.distributed.tensor.experimental`'s
  default for causal CP): a tensor sharded by torch's load balancer is a valid "zigzag" shard and the
  reverse. "contiguous": chunks 2r and 2r + 1 (torch's CP without load balancing).
- kv_exchange "ring": K/V (packed in one buffer) travel around the ring with isend/irecv, the next step's
  transfer in flight while the current step computes. Per step, one kernel call (`_Call.step_calls`): with both
  layouts, causal or not, a step's mask is one call's — the own block is causal on the local order, a zigzag
  block from a lower rank is seen by both local chunks in its first chunk, one from a higher rank by the second
  local chunk in full; the partial outputs, fp32 where the backend writes it (`_step_dtype`: not CK), are merged by
  their lse in fp32 (fp64 for fp64 inputs), and rounded to the input dtype once:
  `lse = logaddexp(lse, lse_i)`, `out = out * exp(lse_old - lse) + out_i * exp(lse_i - lse)`.
  Backward: the same steps with `flash_attn_bwd` given the merged out/lse (so D = rowsum(dO * O) is the
  global one), writing into preallocated per-step buffers (fp32 as the forward's); dQ accumulates locally in fp32
  and dK/dV accumulate in fp32 buffers that travel around the ring and arrive back at their owner after W hops.
  Both transfers overlap compute. Causal or not; sliding windows are refused here (a window's block masks
  need a negative side).
- kv_exchange "allgather": K/V are all-gathered (every rank then holds the full K/V) in two asynchronous
  collectives, one per local chunk slot (`_KVGather`; with zigzag the first and the second half of the sequence),
  so a causal query chunk of the first half computes while the second half is in flight; each local query
  chunk at global rows [q0, q0 + c) runs one call on the keys [start, end) it can see, where choosing
  `end` (q0 + c, or further for a right window) makes flash-attn's bottom-right alignment coincide with
  the global positions, so causal and any window (left, right) are exact. Backward: K/V gathered again the same
  way, dK/dV partials over the full sequence, reduce-scattered back to the owners.
- kv_exchange "a2a" (all-to-all over heads, DeepSpeed Ulysses): one all-to-all turns every rank's sequence shard
  of all heads into the whole sequence of h / W heads (h and h_k multiples of W); one kernel call on it (causal,
  windows, dropout: anything flash_attn_func does), and one all-to-all back. The backward repeats the forward's
  exchanges (q, out, dout in one; k, v in another) instead of keeping the head-scattered copies.

- kv_exchange "a2a+ring" (TE's a2a+p2p, Megatron's hierarchical CP) over a 2-D DeviceMesh (ring dim R, a2a dim
  A; W = R A): `shard(x, mesh)` gives rank (r, a) piece a of each chunk of ring rank r's zigzag (or contiguous)
  shard, so one all-to-all inside the a2a group assembles ring rank r's shard for h / A heads; the ring runs
  across the R groups on it; one all-to-all back. h and h_k must be multiples of A; no windows, no varlen.

GQA (h_k < h) works in all of them. Varlen (`cu_seqlens`, ring only): every rank holds its two chunks of every
sequence (zigzag or contiguous per sequence); each step's calls are varlen over one chunk per sequence (`_Chunks`,
built once per cu_seqlens tensor, not per call).

Dropout: every kernel call of a rank (a ring step's query chunk, or an all-gather chunk) draws its own keep
pattern from one `[seed, offset]` drawn per forward, with the seed advanced by the call's global index
(rank, step, chunk); the backward re-derives the same states, so forward and backward drop the same elements
and no two calls of the group share a pattern.

Everything is validated before the first communication (options with `flash_attn_func`'s own rules, the
operands of the first kernel call, the backend's ability to run it): an argument error raises on every rank
that gets it without leaving sends or receives posted. Refused, with an error that says why: varlen with the
all-gather, ALiBi and softcap (not built), windows with the ring.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.weak import WeakIdKeyDictionary

from ..api import flash_attn_bwd, flash_attn_fwd
from ..core.dropout import new_rng_state
from ..core.errors import ArgumentError
from ..core.inputs import describe_call
from ..core.options import AttentionOptions
from ..ops import not_twice_differentiable
from ..pipeline.select import select_backend
from .sdpa import positive_scale

LAYOUTS = ("zigzag", "contiguous")
KV_EXCHANGES = ("ring", "allgather", "a2a", "a2a+ring")


# rank, world -> the two chunk ids; "interleaved" is internal: the a2a group inside the hybrid, whose members each
# hold a piece of both of the ring shard's chunks.
_CHUNK_IDS = {"zigzag": lambda rank, world: (rank, 2 * world - 1 - rank),
              "contiguous": lambda rank, world: (2 * rank, 2 * rank + 1),
              "interleaved": lambda rank, world: (rank, world + rank)}


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, int]:
    """The two global chunk indices (of 2 * world) that `rank` holds, in local order (increasing)."""
    if layout not in _CHUNK_IDS:
        raise ArgumentError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return _CHUNK_IDS[layout](rank, world)


def _is_mesh(mesh_or_group) -> bool:
    """A DeviceMesh, not a ProcessGroup: by type, since under torch.compile a ProcessGroup is an opaque object whose
    unregistered attributes (even `hasattr`) raise."""
    return isinstance(mesh_or_group, DeviceMesh)


def _mesh_2d(mesh) -> bool:
    return _is_mesh(mesh) and mesh.ndim == 2


def _shard_ids(group, layout: str) -> tuple[int, tuple[int, int]]:
    """(W, this rank's two chunk ids of 2W). A 2-D mesh (ring dim, a2a dim) of R x A ranks (the hybrid): rank
    (r, a) holds piece a of each of its ring shard's chunks (i0, i1): chunks i0 * A + a and i1 * A + a."""
    if _mesh_2d(group):
        (ring, r), (inner, a) = (_group_size_rank(group.get_group(dim)) for dim in (0, 1))
        return ring * inner, tuple(i * inner + a for i in chunk_ids(r, ring, layout))
    world, rank = _group_size_rank(process_group(group))
    return world, chunk_ids(rank, world, layout)


def process_group(mesh_or_group=None):
    """A ProcessGroup from a 1-D DeviceMesh, a ProcessGroup, or None (the default group)."""
    if mesh_or_group is None:
        return dist.group.WORLD
    if _is_mesh(mesh_or_group):
        if mesh_or_group.ndim != 1:
            raise ArgumentError(f"mesh: expected a 1-D DeviceMesh (the context-parallel dimension), got "
                                f"{mesh_or_group.ndim} dimensions; pass mesh['cp'] or its process group")
        return mesh_or_group.get_group()
    return mesh_or_group


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
    `group`: a ProcessGroup, a 1-D DeviceMesh, or the hybrid's 2-D mesh. For (b, h, s, d) tensors pass seq_dim=2;
    "zigzag" equals torch's head-tail load balancer followed by an even split.
    Varlen (`cu_seqlens`, x packed (total, ...) with seq_dim=0): every sequence is cut into 2W chunks and the
    shard packs this rank's two chunks of each sequence, in sequence order (offsets cu_seqlens / W)."""
    world, ids = _shard_ids(group, layout)
    bounds = _bounds(x.shape[seq_dim], cu_seqlens)
    for a, b in itertools.pairwise(bounds):
        if (b - a) % (2 * world):
            raise ArgumentError(f"sequence length {b - a} must be a multiple of 2 * world size = {2 * world}")
    return torch.cat([chunks[i] for chunks in _split(x, seq_dim, bounds, 2 * world) for i in ids], dim=seq_dim)


def unshard(x: torch.Tensor, group=None, *, seq_dim: int = 1, layout: str = "zigzag",
            cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor from every rank's shard (all-gather, then the chunks back in sequence order)."""
    group = process_group(group)
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
    cu_seen: tuple[torch.Tensor, torch.Tensor] | None = None   # keys of one chunk, of both chunks
    max_c: int = 0
    sequences: int = 1

    @staticmethod
    def varlen(cu_seqlens: torch.Tensor, world: int, device: torch.device) -> _Chunks:
        bounds = _bounds(0, cu_seqlens, world)
        lengths = [(b - a) // 2 for a, b in itertools.pairwise(bounds)]
        rows = tuple(torch.cat([torch.arange(a + i * n, a + (i + 1) * n) for a, n in zip(bounds, lengths)]
                               + [torch.zeros(0, dtype=torch.int64)]).to(device) for i in (0, 1))
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        return _Chunks(rows=rows, cu=cu, cu_seen=(cu, cu * 2), max_c=max(lengths, default=0),
                       sequences=len(lengths))

    @property
    def empty(self) -> bool:
        return (self.c if self.rows is None else self.rows[0].numel()) == 0

    def q(self, i: int) -> tuple:
        """Local chunk i of q, out, dout (seq dim 1 dense, 0 varlen)."""
        return (slice(None), slice(i * self.c, (i + 1) * self.c)) if self.rows is None else (self.rows[i],)

    def rows_of(self, q_chunks: tuple[int, ...]) -> tuple:
        """The local rows of q, out, dout of one or both local chunks (both: the whole shard)."""
        return self.q(q_chunks[0]) if len(q_chunks) == 1 else (slice(None),)

    def row_workspace(self, buffer: torch.Tensor, count: int) -> torch.Tensor:
        """A view of `buffer` (shaped like q) with the shape of `count` local chunks, for flash_attn_bwd's dq."""
        return buffer[:, :count * self.c] if self.rows is None else buffer[:count * self.rows[0].numel()]

    def keys(self, seen: int) -> tuple:
        """The first `seen` chunks of a held K/V block (per sequence)."""
        if self.rows is None:
            return (slice(None), slice(0, seen * self.c))
        return (slice(None),) if seen == 2 else (self.rows[0],)

    def workspace(self, buffer: torch.Tensor, seen: int) -> torch.Tensor:
        """A view of `buffer` (shaped like k) with the shape of `seen` chunks, for flash_attn_bwd to write."""
        return buffer[self.keys(seen)] if self.rows is None else buffer[:seen * self.rows[0].numel()]

    def options(self, seen: int, q_count: int = 1) -> dict:
        """The varlen arguments of a call on `q_count` local query chunks and `seen` key chunks of a block."""
        if self.rows is None:
            return {}
        return dict(cu_seqlens_q=self.cu_seen[q_count - 1], cu_seqlens_k=self.cu_seen[seen - 1],
                    max_seqlen_q=q_count * self.max_c, max_seqlen_k=seen * self.max_c)


# Varlen chunk indices per cu_seqlens tensor: reading cu_seqlens (a host sync on a GPU) and building the
# index tensors happens once per tensor and layout, not in every layer's forward and backward.
_VARLEN_CHUNKS = WeakIdKeyDictionary()


def _varlen_chunks(cu_seqlens: torch.Tensor, world: int, device: torch.device) -> tuple[_Chunks, int]:
    """The chunks of a rank's varlen shard and the rows it holds (total / W)."""
    # An inference tensor has no version counter (and may change inside inference_mode): never kept.
    version = None if cu_seqlens.is_inference() else cu_seqlens._version
    key = (version, world, device)
    cached = None if version is None else _VARLEN_CHUNKS.get(cu_seqlens)
    if cached is None or cached[0] != key:
        bounds = _bounds(0, cu_seqlens)
        if bounds[0] != 0 or any(b < a for a, b in itertools.pairwise(bounds)):
            raise ArgumentError(f"cu_seqlens: expected non-decreasing offsets from 0, got {bounds}")
        if any((b - a) % (2 * world) for a, b in itertools.pairwise(bounds)):
            raise ArgumentError(f"cu_seqlens: every sequence length must be a multiple of 2 * world size = "
                                f"{2 * world}, got offsets {bounds}")
        cached = (key, _Chunks.varlen(cu_seqlens, world, device), bounds[-1] // world)
        if version is not None:
            _VARLEN_CHUNKS[cu_seqlens] = cached
    return cached[1:]


@dataclass(frozen=True)
class _StepCall:
    """One kernel call of a ring step: the local query chunks it covers, the leading chunks of the held K/V block
    it reads, and whether the mask on them is (bottom-right) causal."""

    q_chunks: tuple[int, ...]
    seen: int
    causal: bool


@dataclass(frozen=True)
class _Call:
    group: object
    world: int
    rank: int
    layout: str
    kv_exchange: str
    options: AttentionOptions      # causal, window, scale, dropout, deterministic, backend: validated
    chunks: _Chunks
    rng_base: torch.Tensor | None = None     # dropout: the [seed, offset] drawn once per forward
    rng: torch.Tensor | None = None          # and per kernel call of this rank: (calls, 2), derived from it
    inner: _Call | None = None               # the hybrid's a2a group (this call is then its ring across groups)
    rng_rank: int | None = None              # this rank's index for the rng derivation (default: rank)
    step_dtype: torch.dtype | None = None    # out_dtype of the calls whose results are merged (`_step_dtype`)

    @property
    def calls(self) -> int:
        """Kernel calls of one rank per direction (rng states to draw): up to two per ring step, two for
        all-gather, one for a2a."""
        return {"ring": 2 * self.world, "allgather": 2, "a2a": 1, "a2a+ring": 2 * self.world}[self.kv_exchange]

    def with_rng(self, base: torch.Tensor | None) -> _Call:
        """The call with its per-kernel-call rng states derived from one `[seed, offset]` (None without dropout):
        the seed advanced by the call's index over the whole group, so no two calls share a keep pattern."""
        if base is None or not self.options.dropout_p:
            return self
        rank = self.rank if self.rng_rank is None else self.rng_rank
        index = torch.arange(rank * self.calls, (rank + 1) * self.calls, device=base.device)
        return replace(self, rng_base=base, rng=base + torch.stack([index, torch.zeros_like(index)], dim=1))

    def kernel(self, index: int) -> dict:
        """The options of kernel call `index` of this rank."""
        o = self.options
        return dict(softmax_scale=o.softmax_scale, dropout_p=o.dropout_p, backend=o.backend,
                    rng_state=None if self.rng is None else self.rng[index])

    def step_calls(self, kv_chunks: tuple[int, int]) -> list[_StepCall]:
        """The kernel calls of a ring step holding the K/V block of `kv_chunks`: one where the step's mask is
        one call's (both layouts, causal or not: every step); else one per local query chunk that sees keys."""
        (seen_0, causal_0), (seen_1, causal_1) = (self.attend(q_chunk, kv_chunks)
                                                  for q_chunk in chunk_ids(self.rank, self.world, self.layout))
        if seen_0 and seen_0 == seen_1 and not causal_0 and not causal_1:
            return [_StepCall((0, 1), seen_0, False)]      # every local row sees the same keys
        if (seen_0, causal_0, seen_1, causal_1) == (1, True, 2, True):
            return [_StepCall((0, 1), 2, True)]            # the own block: causal on the local order
        return [_StepCall((i,), seen, causal) for i, (seen, causal) in enumerate(((seen_0, causal_0),
                                                                                 (seen_1, causal_1))) if seen]

    def attend(self, q_chunk: int, kv_chunks: tuple[int, int]) -> tuple[int, bool]:
        """Ring step: how many leading chunks of the held K/V block query chunk `q_chunk` sees, and whether
        the last of them is its own (bottom-right causal). Local chunks are in increasing order, so the
        chunks a causal query sees are a prefix of the block."""
        if not self.options.causal:
            return len(kv_chunks), False
        seen = sum(index <= q_chunk for index in kv_chunks)
        return seen, seen > 0 and kv_chunks[seen - 1] == q_chunk

    def window_call(self, q_start: int, c: int, total: int) -> tuple[int, int, tuple[int, int]]:
        """All-gather: the keys [start, end) query rows [q_start, q_start + c) can see, and the flash-attn
        window on them that equals the global interval [i - left, i + right] (docs/integrations.md)."""
        left, right = self.options.window_size
        if self.options.causal:
            right = 0
        end = total if right < 0 else min(total, q_start + c + right)
        shift = end - c - q_start           # flash-attn's bottom-right offset beyond the global diagonal
        start = 0 if left < 0 else max(0, q_start - left)
        # A left side that reaches the first key is unbounded (as flash-attn treats left >= s_k - 1): written as
        # -1, since left + shift of a valid left near 2**31 would leave the window's int32 range on some ranks.
        local_left = -1 if left < 0 or left + shift >= end - start - 1 else left + shift
        return start, end, (local_left, -1 if right < 0 else right - shift)


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


class _PostedTransfers:
    """Sends/receives in flight. On an error after they were posted, `drain` completes them, so the group's
    next collective is not matched against a half-finished exchange."""

    def __init__(self):
        self.works = []

    def post(self, buffers: list[torch.Tensor], call: _Call) -> list[torch.Tensor]:
        """Send `buffers` to the next rank and receive the previous rank's into new buffers (asynchronously)."""
        if call.world == 1:     # a ring of one: the buffers come back as they are (gloo refuses a send to oneself)
            return list(buffers)
        received = [torch.empty_like(b) for b in buffers]
        after = dist.get_global_rank(call.group, (call.rank + 1) % call.world)
        before = dist.get_global_rank(call.group, (call.rank - 1) % call.world)
        ops = [dist.P2POp(dist.isend, b, after, call.group) for b in buffers]
        ops += [dist.P2POp(dist.irecv, b, before, call.group) for b in received]
        self.works += dist.batch_isend_irecv(ops)
        return received

    def gather(self, buffer: torch.Tensor, call: _Call) -> tuple[Any, list[torch.Tensor]]:
        """All-gather `buffer` over the group (asynchronously): (its work, every rank's buffer in rank order)."""
        received = [torch.empty_like(buffer) for _ in range(call.world)]
        work = dist.all_gather(received, buffer, group=call.group, async_op=True)
        self.works.append(work)
        return work, received

    def wait(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()

    drain = wait


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buffer: torch.Tensor, *likes: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for like in likes:
        out.append(buffer[offset:offset + like.numel()].view(like.shape))
        offset += like.numel()
    return out


# ---- ring ------------------------------------------------------------------------------------------

def _ring_blocks(k, v, call: _Call, transfers: _PostedTransfers):
    """Per ring step: (step, the K/V block held now, its chunk ids). The next block's transfer is posted
    before the current one is handed out, so it travels while the caller computes."""
    kv, received = _pack(k, v), None
    for step in range(call.world):
        if step:
            transfers.wait()
            (kv,) = received
        if step < call.world - 1:
            received = transfers.post([kv], call)
        k_blk, v_blk = _unpack(kv, k, v)
        yield step, k_blk, v_blk, chunk_ids((call.rank - step) % call.world, call.world, call.layout)


def _ring_forward(q, k, v, call: _Call, out: torch.Tensor, transfers: _PostedTransfers):
    sel = call.chunks
    out_acc = lse_acc = None
    for step, k_blk, v_blk, kv_chunks in _ring_blocks(k, v, call, transfers):
        for index, part in enumerate(call.step_calls(kv_chunks)):
            rows, keys = sel.rows_of(part.q_chunks), sel.keys(part.seen)
            out_i, lse_i, _ = flash_attn_fwd(q[rows], k_blk[keys], v_blk[keys], causal=part.causal,
                                             out_dtype=call.step_dtype, **sel.options(part.seen, len(part.q_chunks)),
                                             **call.kernel(2 * step + index))
            if out_acc is None:        # the first step (the rank's own block) covers every local row
                out_acc, lse_acc = _merge(None, None, out_i, lse_i)
            else:
                out_acc[rows], lse_acc[(Ellipsis, rows[-1])] = _merge(out_acc[rows], lse_acc[(Ellipsis, rows[-1])],
                                                                      out_i, lse_i)
    out.copy_(out_acc)
    return lse_acc


def _ring_backward(dout, q, k, v, out, lse, call: _Call, transfers: _PostedTransfers):
    """Per step: post the next K/V block's transfer, compute this block's gradients into per-call buffers,
    then wait for the block's travelling dK/dV sums (sent by the previous rank after its own step, in flight
    during this step's compute), add this step's parts in the order the calls ran, and send them on."""
    sel = call.chunks
    accum = _accum(q)
    dq = torch.zeros(q.shape, dtype=accum, device=q.device)
    dq_buffer = torch.empty_like(q, dtype=call.step_dtype)
    block_grads = [(torch.empty_like(k, dtype=call.step_dtype), torch.empty_like(v, dtype=call.step_dtype))
                   for _ in range(2)]   # per call of a step
    dkv_transfers = _PostedTransfers()
    dkv_next = None
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
            dk_blk, dv_blk = _unpack(dkv, k, v)
            for keys, dk_i, dv_i in parts:
                dk_blk[keys] += dk_i
                dv_blk[keys] += dv_i
            # dK/dV move on every step, arriving home after W hops; their transfer overlaps the next step.
            dkv_next = dkv_transfers.post([dkv], call)
        dkv_transfers.wait()
    except BaseException:
        dkv_transfers.drain()
        raise
    dk, dv = _unpack(dkv_next[0], k, v)
    return dq, dk, dv


# ---- all-gather ------------------------------------------------------------------------------------

class _KVGather:
    """K/V of the whole sequence, gathered in two asynchronous all-gathers, one per local chunk slot j (every rank's
    j-th local chunk): with zigzag (and interleaved) slot 0 is the first half of the sequence, so a causal query
    chunk of the first half computes while the second half is still in flight. `keys(start, end)` waits only for
    the slots that hold chunks of [start, end) and places them in sequence order. The collectives are posted
    through `transfers`, which completes them if an error interrupts the call."""

    def __init__(self, k, v, call: _Call, transfers: _PostedTransfers):
        self.c, self.world = k.shape[1] // 2, call.world
        self.k = torch.empty((k.shape[0], 2 * self.c * self.world, *k.shape[2:]), dtype=k.dtype, device=k.device)
        self.v = torch.empty((v.shape[0], *self.k.shape[1:-1], v.shape[-1]), dtype=v.dtype, device=v.device)
        self.likes = [(k[:, j * self.c:(j + 1) * self.c], v[:, j * self.c:(j + 1) * self.c]) for j in (0, 1)]
        self.slot_of = {chunk: j for r in range(self.world)
                        for j, chunk in enumerate(chunk_ids(r, self.world, call.layout))}
        self.posted = [transfers.gather(_pack(*like), call) for like in self.likes]
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
                    self.k[:, rows], self.v[:, rows] = _unpack(buffer, *self.likes[j])
                self.placed[j] = True
        return self.k, self.v


def _local_calls(q, call: _Call):
    """(rows of the local q, keys [start, end), window) per local query chunk."""
    c = q.shape[1] // 2
    total = 2 * c * call.world
    for i, q_chunk in enumerate(chunk_ids(call.rank, call.world, call.layout)):
        start, end, window = call.window_call(q_chunk * c, c, total)
        yield slice(i * c, (i + 1) * c), slice(start, end), window


def _allgather_forward(q, k, v, call: _Call, out: torch.Tensor, transfers: _PostedTransfers):
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


def _allgather_backward(dout, q, k, v, out, lse, call: _Call, transfers: _PostedTransfers):
    """The forward's exchange again (regathering costs the all-gather; keeping the gathered K/V would cost W times
    the K/V shard per layer until the backward), overlapped the same way."""
    gathered = _KVGather(k, v, call, transfers)
    k_full, v_full = gathered.k, gathered.v
    accum = _accum(q)
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
    local = [_shards(t, call) for t in (dk_full, dv_full)]
    stacked = torch.cat([_pack(*[t[r] for t in local]) for r in range(call.world)])
    mine = torch.empty(stacked.numel() // call.world, dtype=accum, device=k.device)
    dist.reduce_scatter_tensor(mine, stacked, group=call.group)
    dk, dv = _unpack(mine, k, v)
    return dq, dk, dv


def _shards(full: torch.Tensor, call: _Call) -> list[torch.Tensor]:
    """Every rank's shard of a full (b, s, ...) tensor, in rank order."""
    chunks = full.chunk(2 * call.world, dim=1)
    return [torch.cat([chunks[i] for i in chunk_ids(r, call.world, call.layout)], dim=1) for r in range(call.world)]



# ---- all-to-all over heads (Ulysses) ------------------------------------------------------------------

def _sequence_to_heads(tensors: list[torch.Tensor], call: _Call) -> list[torch.Tensor]:
    """One all-to-all: each (b, s / W, H, ...) shard (H a multiple of W, one dtype) -> (b, s, H / W, ...), the whole
    sequence in order for this rank's H / W heads (head group = rank)."""
    w = call.world
    parts = [t.unflatten(2, (w, t.shape[2] // w)).movedim(2, 0).reshape(w, -1) for t in tensors]
    received = torch.empty_like(torch.cat(parts, dim=1))
    dist.all_to_all_single(received, torch.cat(parts, dim=1), group=call.group)
    results, offset = [], 0
    for t, part in zip(tensors, parts, strict=True):
        per_rank = received[:, offset:offset + part.shape[1]].reshape(w, *t.shape[:2], t.shape[2] // w, *t.shape[3:])
        results.append(_in_sequence_order(list(per_rank), w, call.layout, 1))
        offset += part.shape[1]
    return results


def _heads_to_sequence(tensors: list[torch.Tensor], call: _Call) -> list[torch.Tensor]:
    """The inverse of `_sequence_to_heads`: (b, s, H / W, ...) of this rank's head group -> its (b, s / W, H, ...)
    shard of every head."""
    w = call.world
    parts = [torch.stack(_shards(t, call)).reshape(w, -1) for t in tensors]
    received = torch.empty_like(torch.cat(parts, dim=1))
    dist.all_to_all_single(received, torch.cat(parts, dim=1), group=call.group)
    results, offset = [], 0
    for t, part in zip(tensors, parts, strict=True):
        per_rank = received[:, offset:offset + part.shape[1]].reshape(w, t.shape[0], t.shape[1] // w, *t.shape[2:])
        results.append(per_rank.movedim(0, 2).flatten(2, 3))
        offset += part.shape[1]
    return results


def _on_head_groups(q, k, v, heads_call: _Call, out: torch.Tensor, attend):
    """All-to-all to the head groups of `heads_call`'s group, `attend(q_h, k_h, v_h, out_h) -> lse_h` there, and
    out (written into `out`) and the lse back to the shards."""
    q_h, = _sequence_to_heads([q], heads_call)
    k_h, v_h = _sequence_to_heads([k, v], heads_call)
    out_h = torch.empty_like(q_h)
    lse_h = attend(q_h, k_h, v_h, out_h)
    out_s, = _heads_to_sequence([out_h], heads_call)
    lse_s, = _heads_to_sequence([lse_h.transpose(1, 2)], heads_call)
    out.copy_(out_s)
    return lse_s.transpose(1, 2).contiguous()


def _grads_on_head_groups(dout, q, k, v, out, lse, heads_call: _Call, attend_backward):
    """The forward's exchanges again (q, out, dout in one all-to-all; k, v in another; lse), `attend_backward(dout_h,
    q_h, k_h, v_h, out_h, lse_h) -> dq_h, dk_h, dv_h` there, and the gradients back to their shards."""
    q_h, out_h, dout_h = _sequence_to_heads([q, out, dout], heads_call)
    k_h, v_h = _sequence_to_heads([k, v], heads_call)
    lse_h, = _sequence_to_heads([lse.transpose(1, 2)], heads_call)
    dq_h, dk_h, dv_h = attend_backward(dout_h, q_h, k_h, v_h, out_h, lse_h.transpose(1, 2).contiguous())
    dq, = _heads_to_sequence([dq_h], heads_call)
    dk, dv = _heads_to_sequence([dk_h, dv_h], heads_call)
    return dq, dk, dv


def _a2a_forward(q, k, v, call: _Call, out: torch.Tensor, transfers: _PostedTransfers):
    def attend(q_h, k_h, v_h, out_h):      # the whole sequence: one call
        result, lse_h, _ = flash_attn_fwd(q_h, k_h, v_h, causal=call.options.causal,
                                          window_size=call.options.window_size, **call.kernel(0))
        out_h.copy_(result)
        return lse_h
    return _on_head_groups(q, k, v, call, out, attend)


def _a2a_backward(dout, q, k, v, out, lse, call: _Call, transfers: _PostedTransfers):
    def attend_backward(dout_h, q_h, k_h, v_h, out_h, lse_h):
        return flash_attn_bwd(dout_h, q_h, k_h, v_h, out_h, lse_h, causal=call.options.causal,
                              window_size=call.options.window_size, deterministic=call.options.deterministic,
                              **call.kernel(0))[:3]
    return _grads_on_head_groups(dout, q, k, v, out, lse, call, attend_backward)


def _hybrid_forward(q, k, v, call: _Call, out: torch.Tensor, transfers: _PostedTransfers):
    """a2a inside the inner group (its members' pieces form the ring shard of h / A heads), the ring across."""
    return _on_head_groups(q, k, v, call.inner, out,
                           lambda q_h, k_h, v_h, out_h: _ring_forward(q_h, k_h, v_h, call, out_h, transfers))


def _hybrid_backward(dout, q, k, v, out, lse, call: _Call, transfers: _PostedTransfers):
    return _grads_on_head_groups(dout, q, k, v, out, lse, call.inner,
                                 lambda *tensors: _ring_backward(*tensors, call, transfers))


# ---- the two directions, shared by every front end ----------------------------------------------

_FORWARD = {"ring": _ring_forward, "allgather": _allgather_forward, "a2a": _a2a_forward,
            "a2a+ring": _hybrid_forward}
_BACKWARD = {"ring": _ring_backward, "allgather": _allgather_backward, "a2a": _a2a_backward,
             "a2a+ring": _hybrid_backward}


def forward(q, k, v, call: _Call, out: torch.Tensor | None = None,
            rng_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, _Call]:
    """`(out, lse, call)`: this shard's output (written into `out` where given: any tensor shaped like q whose
    last dim has stride 1), its lse (fp32; fp64 for fp64 inputs) and the call with its rng states (dropout:
    derived from `rng_state`, else from one fresh draw; `call.rng_base` is what the backward needs)."""
    if out is None:
        out = torch.empty_like(q)
    if call.chunks.empty:           # every shard is empty (shards have equal sizes): nothing to exchange
        lse_shape = (q.shape[-2], 0) if call.chunks.rows is not None else (q.shape[0], q.shape[-2], 0)
        return out, q.new_empty(lse_shape, dtype=_accum(q)), call
    if call.options.dropout_p:
        call = call.with_rng(new_rng_state(q.device) if rng_state is None else rng_state)
    transfers = _PostedTransfers()
    try:
        lse = _FORWARD[call.kv_exchange](q, k.contiguous(), v.contiguous(), call, out, transfers)
    except BaseException:
        transfers.drain()
        raise
    return out, lse, call


def backward(dout, q, k, v, out, lse, call: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the accumulation dtype (fp32; fp64 for fp64 inputs), like q, k, v. `call`: forward's (or
    `plan_call`'s `.with_rng(the forward's rng_base)`)."""
    accum = _accum(q)
    if call.chunks.empty:
        return tuple(torch.zeros(t.shape, dtype=accum, device=t.device) for t in (q, k, v))
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    transfers = _PostedTransfers()
    try:
        return _BACKWARD[call.kv_exchange](dout, q, k.contiguous(), v.contiguous(), out, lse, call, transfers)
    except BaseException:
        transfers.drain()
        raise


def plan_call(q, k, v, group, *, options: AttentionOptions, layout: str, kv_exchange: str,
              cu_seqlens: torch.Tensor | None = None) -> _Call:
    """Validate everything a context-parallel call needs, before any communication: the options (flash-attn's
    rules, `options`), the CP arguments, and the first kernel call's operands and backend; the `_Call`.
    q, k, v: this rank's (b, s / W, h, d) views (varlen (total / W, h, d))."""
    if kv_exchange not in KV_EXCHANGES:
        raise ArgumentError(f"kv_exchange: expected one of {KV_EXCHANGES}, got {kv_exchange!r}")
    if kv_exchange in ("ring", "a2a+ring") and options.window_size != (-1, -1):
        raise ArgumentError("window_size: sliding windows need kv_exchange='allgather' (the ring's per-block "
                            "masks would need negative window sides)")
    if cu_seqlens is not None and kv_exchange != "ring":
        raise ArgumentError(f"cu_seqlens: varlen needs kv_exchange='ring' (not built for {kv_exchange!r})")
    expected = "(total / W, h, d)" if cu_seqlens is not None else "(b, s / W, h, d)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != len(expected.split(",")):
            raise ArgumentError(f"{name}: expected a {expected} tensor, got {type(t).__name__} "
                                f"{tuple(getattr(t, 'shape', ()))}")
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if (kv_exchange == "a2a+ring") != _mesh_2d(group):
        raise ArgumentError("kv_exchange='a2a+ring' takes a 2-D DeviceMesh (ring dim, a2a dim), and only it does; "
                            f"got kv_exchange={kv_exchange!r} with {group!r}")
    if kv_exchange == "a2a+ring":
        return _plan_hybrid(q, k, v, group, options, layout)
    group = process_group(group)
    world, rank = _group_size_rank(group)
    if cu_seqlens is None:
        if q.shape[1] % 2 or q.shape[1] != k.shape[1]:
            raise ArgumentError(f"q and k shards must have the same even length (two chunks per rank), got "
                                f"{q.shape[1]} and {k.shape[1]}")
        chunks = _Chunks(c=q.shape[1] // 2)
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            raise ArgumentError(f"cu_seqlens: expected an int32 (b + 1,) tensor, got {cu_seqlens!r}")
        chunks, rows = _varlen_chunks(cu_seqlens, world, q.device)
        if not q.shape[0] == k.shape[0] == rows:
            raise ArgumentError(f"q and k shards must hold total / W = {rows} rows, got {q.shape[0]} and "
                                f"{k.shape[0]}")
    if kv_exchange == "a2a" and (q.shape[-2] % world or k.shape[-2] % world):
        raise ArgumentError(f"kv_exchange='a2a' scatters heads over the group: q's {q.shape[-2]} and k's "
                            f"{k.shape[-2]} heads must be multiples of the world size {world} (use 'ring')")
    call = _Call(group, world, rank, layout, kv_exchange, options, chunks)
    if not chunks.empty:
        # The first kernel call of this rank (both local chunks' keys seen): operands and backend checked here,
        # so a bad dtype, head count or backend raises before any K/V is posted.
        probe = options.replace_checked(causal=False, window_size=(-1, -1), **chunks.options(2))
        call = replace(call, step_dtype=_step_dtype(q[chunks.q(0)], k, v, probe))
    return call


def _plan_hybrid(q, k, v, mesh, options: AttentionOptions, layout: str) -> _Call:
    """The hybrid over a 2-D mesh of R x A ranks: a2a over the inner dim (A), the ring over the outer dim (R) on
    the inner group's gathered shards (2 chunks of A pieces) of h / A heads."""
    (outer, inner) = (mesh.get_group(dim) for dim in (0, 1))
    (ring, r), (heads_world, a) = _group_size_rank(outer), _group_size_rank(inner)
    if q.shape[1] % 2 or q.shape[1] != k.shape[1]:
        raise ArgumentError(f"q and k shards must have the same even length (two chunks per rank), got "
                            f"{q.shape[1]} and {k.shape[1]}")
    if q.shape[-2] % heads_world or k.shape[-2] % heads_world:
        raise ArgumentError(f"kv_exchange='a2a+ring' scatters heads over the mesh's a2a dim: q's {q.shape[-2]} and "
                            f"k's {k.shape[-2]} heads must be multiples of its size {heads_world}")
    c = q.shape[1] // 2
    heads_call = _Call(inner, heads_world, a, "interleaved", "a2a", options, _Chunks(c=c))
    call = _Call(outer, ring, r, layout, "a2a+ring", options, _Chunks(c=c * heads_world), inner=heads_call,
                 rng_rank=a * ring + r)
    if c:
        call = replace(call, step_dtype=_step_dtype(q[:, :c], k, v, options.replace_checked(causal=False)))
    return call


def _step_dtype(q, k, v, probe: AttentionOptions) -> torch.dtype | None:
    """Check the first kernel call's operands and backend (`probe`: its options); the `out_dtype` of the calls whose
    results are merged or added: fp32 for fp16/bf16 inputs where the backend writes fp32 results with the kernels it
    runs anyway (so they are rounded once, after the merge), else None: the input dtype (CK, whose kernels write only
    that; the Triton backend where its warp-specialised kernels run the steps: long chunks, where the extra rounding
    is small beside the error of the step itself and those kernels are the faster ones)."""
    problem = describe_call(q, k, v, probe)
    chosen = select_backend(problem, probe.backend)
    accum = _accum(q)
    if accum == q.dtype or chosen.fp32_outputs_slower(problem) or chosen.not_supported_reasons(
            describe_call(q, k, v, probe.replace_checked(out_dtype=accum))):
        return None
    return accum


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
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


def context_parallel_attn(q, k, v, group=None, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                          dropout_p=0.0, deterministic=False, layout="zigzag", kv_exchange="ring", backend=None,
                          return_lse=False, cu_seqlens=None, **unsupported):
    """Attention over a sequence sharded across `group` (see the module docstring), differentiable.

    Args:
        q, k, v: this rank's shards (b, s / W, h, d) and (b, s / W, h_k, d), as `shard(x, group, layout=layout)`
            cuts them (every rank the same b, h, d; s a multiple of 2W). Varlen: (total / W, h, d) and
            (total / W, h_k, d), as `shard(x, group, seq_dim=0, layout=layout, cu_seqlens=cu_seqlens)` cuts them.
        group: a ProcessGroup, a 1-D DeviceMesh, or None (the default group); for kv_exchange="a2a+ring" a 2-D
            DeviceMesh (ring dim, a2a dim), whose shards `shard(x, mesh)` cuts.
        cu_seqlens: varlen (kv_exchange="ring" only): the full sequences' int32 offsets (b + 1,), the same on
            every rank and for q and k; every sequence's length a multiple of 2W. Its chunk indices are built
            once per tensor (reuse one cu_seqlens tensor across layers to avoid a host sync per call).
        causal, window_size, softmax_scale, dropout_p, deterministic, backend: as for `flash_attn_func` (validated
            by the same rules), over the full sequence (windows: kv_exchange="allgather" only).
        layout: "zigzag" (head-tail load balancing) or "contiguous". kv_exchange: "ring", "allgather", "a2a" or
            "a2a+ring" (see the module docstring).
        return_lse: also return this shard's softmax lse (b, h, s / W), varlen (h, total / W) (fp32; fp64 for
            fp64 inputs).

    Returns:
        this rank's shard of the output (b, s / W, h, d), varlen (total / W, h, d), as `shard` cuts the full output.

    Raises:
        ArgumentError (before any communication): ALiBi, softcap, cu_seqlens_q/k, a window or varlen with the
            all-gather exchange (windows: the ring), or a bad shape/option.
    """
    if unsupported:
        raise ArgumentError(f"{', '.join(sorted(unsupported))}: not supported by context_parallel_attn "
                            "(ALiBi and softcap are not built for context parallelism; varlen takes one "
                            "cu_seqlens for q and k)")
    if torch.compiler.is_compiling():
        out, lse = _compiled_call(q, k, v, group, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                  dropout_p=dropout_p, deterministic=deterministic, layout=layout,
                                  kv_exchange=kv_exchange, backend=backend, cu_seqlens=cu_seqlens)
        return (out, lse) if return_lse else out
    options = AttentionOptions(softmax_scale=softmax_scale, causal=causal, window_size=window_size, dropout_p=dropout_p,
                               deterministic=deterministic, backend=backend)
    k, v = (t.contiguous() if isinstance(t, torch.Tensor) else t for t in (k, v))
    call = plan_call(q, k, v, group, options=options, layout=layout, kv_exchange=kv_exchange, cu_seqlens=cu_seqlens)
    out, lse = _ContextParallelAttention.apply(q, k, v, call)
    return (out, lse) if return_lse else out


def context_parallel_sdpa(query, key, value, mesh_or_group=None, *, is_causal=False, scale=None, enable_gqa=False,
                          dropout_p=0.0, layout="zigzag", kv_exchange="ring", backend=None):
    """`F.scaled_dot_product_attention` over a sequence sharded across a DeviceMesh or process group.

    Args:
        query: this rank's (b, h, s / W, d) shard; key, value: (b, h_k, s / W, d). Shard full tensors with
            `shard(x, mesh, seq_dim=2, layout=layout)`, or with torch's `_context_parallel_shard(mesh, buffers,
            seq_dims, load_balancer=_HeadTailLoadBalancer(s, W, device))`, which is `layout="zigzag"` (without a
            load balancer torch's shards are `layout="contiguous"`).
        mesh_or_group: a 1-D DeviceMesh, a ProcessGroup, or None (the default group); for kv_exchange="a2a+ring"
            a 2-D DeviceMesh (ring dim, a2a dim).
        is_causal, scale, enable_gqa, dropout_p: as for SDPA over the full sequence (h_k < h needs enable_gqa; any
            finite scale: a negative or zero one runs as the SDPA provider runs it, `sdpa.positive_scale`).
        layout, kv_exchange, backend: as for `context_parallel_attn`.

    Returns:
        this rank's (b, h, s / W, d) shard of the output.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ArgumentError(f"{name}: expected a (b, h, s / W, d) tensor, got {getattr(t, 'shape', t)!r}")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ArgumentError(f"key: {key.shape[1]} heads differ from the query's {query.shape[1]}; pass "
                            f"enable_gqa=True (as F.scaled_dot_product_attention requires)")
    query, scale, _ = positive_scale(query, scale)      # autograd carries the sign into dq
    out = context_parallel_attn(*(t.transpose(1, 2) for t in (query, key, value)), mesh_or_group,
                                softmax_scale=scale, causal=is_causal, dropout_p=dropout_p, layout=layout,
                                kv_exchange=kv_exchange, backend=backend)
    return out.transpose(1, 2)


# ---- torch.compile: the two directions as custom ops (process group by name, as torch's flex CP does) ------

def _op_call(q, k, v, group_name, layout, kv_exchange, causal, window_left, window_right, softmax_scale, dropout_p,
             deterministic, backend, cu_seqlens) -> _Call:
    """The ops' arguments, validated (before any communication), as a `_Call`."""
    options = AttentionOptions(softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                               dropout_p=dropout_p, deterministic=deterministic, backend=backend)
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return plan_call(q, k, v, group, options=options, layout=layout, kv_exchange=kv_exchange, cu_seqlens=cu_seqlens)


@torch.library.custom_op("flash_attn_ck_cp::forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, layout: str, kv_exchange: str,
                causal: bool, window_left: int, window_right: int, softmax_scale: float | None, dropout_p: float,
                deterministic: bool, backend: str | None, cu_seqlens: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, lse and the dropout rng base (empty without dropout)."""
    call = _op_call(q, k, v, group_name, layout, kv_exchange, causal, window_left, window_right, softmax_scale,
                    dropout_p, deterministic, backend, cu_seqlens)
    out, lse, call = forward(q, k, v, call)
    rng_base = call.rng_base if call.rng_base is not None else torch.empty(0, dtype=torch.int64, device=q.device)
    return out, lse, rng_base


@_forward_op.register_fake
def _(q, k, v, group_name, layout, kv_exchange, causal, window_left, window_right, softmax_scale, dropout_p,
      deterministic, backend, cu_seqlens):
    lse_shape = (q.shape[-2], q.shape[0]) if cu_seqlens is not None else (q.shape[0], q.shape[2], q.shape[1])
    return (torch.empty_like(q), q.new_empty(lse_shape, dtype=_accum(q)),
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
    return tuple(g.to(t.dtype, copy=True) for g, t in zip(backward(dout, q, k, v, out, lse, call), (q, k, v),
                                                          strict=True))


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, rng_base, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse, rng_base = output
    ctx.save_for_backward(q, k, v, out, lse, rng_base, options[-1])
    ctx.options = options[:-1]
    ctx.mark_non_differentiable(lse, rng_base)


def _op_backward(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, rng_base, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _backward_op(dout.contiguous(), q, k, v, out, lse, rng_base, *ctx.options, cu_seqlens)
    return (dq, dk, dv) + (None,) * (len(ctx.options) + 1)


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _compiled_call(q, k, v, group, *, softmax_scale, causal, window_size, dropout_p, deterministic, layout,
                   kv_exchange, backend, cu_seqlens):
    """Under torch.compile: the custom op (one opaque node per direction, so fullgraph captures the call)."""
    if kv_exchange == "a2a+ring":
        raise ArgumentError("kv_exchange: 'a2a+ring' is not captured by torch.compile (its op takes one process "
                            "group, the hybrid a 2-D mesh); run it eagerly (fullgraph=False breaks the graph there)")
    group_name = process_group(group).group_name
    return _forward_op(q, k, v, group_name, layout, kv_exchange, causal, window_size[0], window_size[1],
                       softmax_scale, dropout_p, deterministic, backend, cu_seqlens)[:2]


# ---- training: parameter gradients over the group ------------------------------------------------------------
# Each rank's loss is its share of the global mean (a partial sum: `hf.shard_for_causal_lm`), so the true gradient
# is the SUM of the ranks' gradients over the context-parallel group; DDP's default hook averages them instead
# (at world W, 1 / W of the true gradient). torchtitan and FSDP get the same result by the other convention (a
# per-rank mean loss, gradients averaged).

def sum_gradients(parameters, mesh_or_group=None) -> None:
    """All-reduce (sum) the `.grad` of `parameters` (an iterable, e.g. `model.parameters()`) over the
    context-parallel group: the gradients of the global loss, for training without DDP. One collective per dtype
    and device."""
    group = process_group(mesh_or_group)
    grads = [p.grad for p in parameters if p.grad is not None]
    for kind in {(g.dtype, g.device) for g in grads}:
        same = [g for g in grads if (g.dtype, g.device) == kind]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(same, _unpack(flat, *same), strict=True):
            grad.copy_(summed)


@dataclass(frozen=True)
class _CPHookState:
    group: Any          # DDP's process group
    replicas: int       # data-parallel replicas in it: DDP's world / the CP world


def _sum_over_cp_hook(state: _CPHookState, bucket):     # no return annotation: DDP refuses a string one
    """DDP's allreduce, divided by the data-parallel replicas instead of DDP's world: summed over the CP ranks."""
    buffer = bucket.buffer().div_(state.replicas)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_cp_comm_hook(ddp_model, mesh_or_group=None) -> None:
    """Make a DistributedDataParallel model sum its gradients over the context-parallel group (`mesh_or_group`)
    and average them over data-parallel replicas: DDP's group is the CP group (pure CP) or holds whole CP groups
    (data x context parallel), and each rank's loss is its share of its replica's mean."""
    ddp_world = dist.get_world_size(ddp_model.process_group)
    cp_world = dist.get_world_size(process_group(mesh_or_group))
    if ddp_world % cp_world:
        raise ArgumentError(f"DDP's group of {ddp_world} ranks does not hold whole context-parallel groups of "
                            f"{cp_world}")
    ddp_model.register_comm_hook(_CPHookState(ddp_model.process_group, ddp_world // cp_world), _sum_over_cp_hook)
