"""A context-parallel call planned and validated before any communication (`plan_call` -> `Call`), and the kernel
calls of a ring step."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ...core.checks import check_learnable_sink
from ...core.errors import ArgumentError
from ...core.inputs import describe_call
from ...core.options import AttentionOptions
from ...pipeline.select import select_backend
from .chunks import Chunks, varlen_chunks
from .group import is_mesh_2d, process_group, size_rank
from .merge import accum_dtype
from .sharding import LAYOUTS, chunk_ids

KV_EXCHANGES = ("ring", "allgather", "a2a", "a2a+ring")


@dataclass(frozen=True)
class StepCall:
    """One kernel call of a ring step: the local query chunks it covers, the leading chunks of the held K/V block
    it reads, and whether the mask on them is (bottom-right) causal."""

    q_chunks: tuple[int, ...]
    seen: int
    causal: bool


@dataclass(frozen=True)
class Call:
    group: dist.ProcessGroup
    world: int
    rank: int
    layout: str
    kv_exchange: str
    options: AttentionOptions      # causal, window, scale, dropout, deterministic, backend: validated
    chunks: Chunks
    rng_base: torch.Tensor | None = None     # dropout: the [seed, offset] drawn once per forward
    rng: torch.Tensor | None = None          # and per kernel call of this rank: (calls, 2), derived from it
    inner: Call | None = None               # the hybrid's a2a group (this call is then its ring across groups)
    rng_rank: int | None = None              # this rank's index for the rng derivation (default: rank)
    step_dtype: torch.dtype | None = None    # out_dtype of the calls whose results are merged (`choose_step_dtype`)

    def inner_call(self) -> Call:
        """The hybrid's a2a call (only a hybrid call has one)."""
        if self.inner is None:
            raise TypeError(f"a {self.kv_exchange!r} call has no inner a2a call")
        return self.inner

    @property
    def calls(self) -> int:
        """Kernel calls of one rank per direction (rng states to draw): up to two per ring step, two for
        all-gather, one for a2a."""
        return {"ring": 2 * self.world, "allgather": 2, "a2a": 1, "a2a+ring": 2 * self.world}[self.kv_exchange]

    def with_rng(self, base: torch.Tensor | None) -> Call:
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

    def step_calls(self, kv_chunks: tuple[int, int]) -> list[StepCall]:
        """The kernel calls of a ring step holding the K/V block of `kv_chunks`: one where the step's mask is
        one call's (both layouts, causal or not: every step); else one per local query chunk that sees keys."""
        (seen_0, causal_0), (seen_1, causal_1) = (self.attend(q_chunk, kv_chunks)
                                                  for q_chunk in chunk_ids(self.rank, self.world, self.layout))
        if seen_0 and seen_0 == seen_1 and not causal_0 and not causal_1:
            return [StepCall((0, 1), seen_0, False)]      # every local row sees the same keys
        if (seen_0, causal_0, seen_1, causal_1) == (1, True, 2, True):
            return [StepCall((0, 1), 2, True)]            # the own block: causal on the local order
        return [StepCall((i,), seen, causal) for i, (seen, causal) in enumerate(((seen_0, causal_0),
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


def plan_call(q, k, v, group, *, options: AttentionOptions, layout: str, kv_exchange: str,
              cu_seqlens: torch.Tensor | None = None) -> Call:
    """Validate everything a context-parallel call needs, before any communication: the options (flash-attn's
    rules, `options`), the CP arguments, and the first kernel call's operands and backend; the `Call`.
    q, k, v: this rank's (b, s / W, h, d) views (varlen (total / W, h, d)); v's head dim d_v may differ from d."""
    _check_arguments(q, k, v, group, options, layout, kv_exchange, cu_seqlens)
    if kv_exchange == "a2a+ring":
        return _plan_hybrid(q, k, v, group, options, layout)
    group = process_group(group)
    world, rank = size_rank(group)
    chunks = _local_chunks(q, k, world, cu_seqlens)
    if kv_exchange == "a2a" and (q.shape[-2] % world or k.shape[-2] % world):
        raise ArgumentError(f"kv_exchange='a2a' scatters heads over the group: q's {q.shape[-2]} and k's "
                            f"{k.shape[-2]} heads must be multiples of the world size {world} (use 'ring')")
    call = Call(group, world, rank, layout, kv_exchange, options, chunks)
    if not chunks.empty:
        # The first kernel call of this rank (both local chunks' keys seen): operands and backend checked here,
        # so a bad dtype, head count or backend raises before any K/V is posted.
        probe = options.replace_checked(causal=False, window_size=(-1, -1), **chunks.options(2))
        call = replace(call, step_dtype=choose_step_dtype(q[chunks.q(0)], k, v, probe))
    return call


def _check_arguments(q, k, v, group, options: AttentionOptions, layout: str, kv_exchange: str,
                     cu_seqlens: torch.Tensor | None) -> None:
    """The context-parallel arguments against each other, before the group is asked anything."""
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
    if options.learnable_sink is not None:      # every rank, empty shards too: the sink is folded once per shard
        check_learnable_sink(options.learnable_sink, q.shape[-2], q.device)
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if (kv_exchange == "a2a+ring") != is_mesh_2d(group):
        raise ArgumentError("kv_exchange='a2a+ring' takes a 2-D DeviceMesh (ring dim, a2a dim), and only it does; "
                            f"got kv_exchange={kv_exchange!r} with {group!r}")


def _local_chunks(q, k, world: int, cu_seqlens: torch.Tensor | None) -> Chunks:
    """Where this rank's two chunks lie in its q and k shards (dense: two equal halves; varlen: per sequence)."""
    if cu_seqlens is None:
        if q.shape[1] % 2 or q.shape[1] != k.shape[1]:
            raise ArgumentError(f"q and k shards must have the same even length (two chunks per rank), got "
                                f"{q.shape[1]} and {k.shape[1]}")
        return Chunks(c=q.shape[1] // 2)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ArgumentError(f"cu_seqlens: expected an int32 (b + 1,) tensor, got {cu_seqlens!r}")
    chunks, rows = varlen_chunks(cu_seqlens, world, q.device)
    if not q.shape[0] == k.shape[0] == rows:
        raise ArgumentError(f"cu_seqlens: its total over W = {world} ranks is {rows} rows a shard, but the q and k "
                            f"shards hold {q.shape[0]} and {k.shape[0]}")
    return chunks


def _plan_hybrid(q, k, v, mesh, options: AttentionOptions, layout: str) -> Call:
    """The hybrid over a 2-D mesh of R x A ranks: a2a over the inner dim (A), the ring over the outer dim (R) on
    the inner group's gathered shards (2 chunks of A pieces) of h / A heads."""
    (outer, inner) = (mesh.get_group(dim) for dim in (0, 1))
    (ring, r), (heads_world, a) = size_rank(outer), size_rank(inner)
    if q.shape[1] % 2 or q.shape[1] != k.shape[1]:
        raise ArgumentError(f"q and k shards must have the same even length (two chunks per rank), got "
                            f"{q.shape[1]} and {k.shape[1]}")
    if q.shape[-2] % heads_world or k.shape[-2] % heads_world:
        raise ArgumentError(f"kv_exchange='a2a+ring' scatters heads over the mesh's a2a dim: q's {q.shape[-2]} and "
                            f"k's {k.shape[-2]} heads must be multiples of its size {heads_world}")
    c = q.shape[1] // 2
    heads_call = Call(inner, heads_world, a, "interleaved", "a2a", options, Chunks(c=c))
    call = Call(outer, ring, r, layout, "a2a+ring", options, Chunks(c=c * heads_world), inner=heads_call,
                rng_rank=a * ring + r)
    if c:
        call = replace(call, step_dtype=choose_step_dtype(q[:, :c], k, v, options.replace_checked(causal=False)))
    return call


def choose_step_dtype(q, k, v, probe: AttentionOptions) -> torch.dtype | None:
    """Check the first kernel call's operands and backend (`probe`: its options); the `out_dtype` of the calls whose
    results are merged or added: fp32 for fp16/bf16 inputs where the backend writes fp32 results with the kernels it
    runs anyway (so they are rounded once, after the merge), else None: the input dtype (CK, whose kernels write only
    that; the Triton backend where its warp-specialised kernels run the steps: long chunks, where the extra rounding
    is small beside the error of the step itself and those kernels are the faster ones)."""
    problem = describe_call(q, k, v, probe)
    chosen = select_backend(problem, probe.backend)
    accum = accum_dtype(q)
    if accum == q.dtype or chosen.fp32_outputs_slower(problem) or chosen.not_supported_reasons(
            describe_call(q, k, v, probe.replace_checked(out_dtype=accum))):
        return None
    return accum

