"""Context parallelism on torch.distributed collectives (NCCL, RCCL or gloo): attention over a sequence whose
shards live on the ranks of a process group.

Every rank of `group` (world W) holds one shard of the sequence of q, k and v: `shard` cuts a full tensor
into 2W chunks of `c = s / 2W` rows and gives rank r two of them, `unshard` gathers them back.

- layout "zigzag" (head-tail load balancing, the default): chunks r and 2W - 1 - r, so every rank has the
  same causal work. This is torch's `_HeadTailLoadBalancer` order (`torch.distributed.tensor.experimental`'s
  default for causal CP): a tensor sharded by torch's load balancer is a valid "zigzag" shard and the
  reverse. "contiguous": chunks 2r and 2r + 1 (torch's CP without load balancing).
- kv_exchange "ring": K/V (packed in one buffer) travel around the ring with isend/irecv, the next step's
  transfer in flight while the current step computes. Per step, one kernel call (`plan.Call.step_calls`): with
  both layouts, causal or not, a step's mask is one call's — the own block is causal on the local order, a zigzag
  block from a lower rank is seen by both local chunks in its first chunk, one from a higher rank by the second
  local chunk in full; the partial outputs, fp32 where the backend writes it (`plan.choose_step_dtype`: not CK),
  are merged by their lse in fp32 (fp64 for fp64 inputs), and rounded to the input dtype once:
  `lse = logaddexp(lse, lse_i)`, `out = out * exp(lse_old - lse) + out_i * exp(lse_i - lse)`.
  Backward: the same steps with `flash_attn_bwd` given the merged out/lse (so D = rowsum(dO * O) is the
  global one), writing into preallocated per-step buffers (fp32 as the forward's); dQ accumulates locally in fp32
  and dK/dV accumulate in fp32 buffers that travel around the ring and arrive back at their owner after W hops.
  Both transfers overlap compute. Causal or not; sliding windows are refused here (a window's block masks
  need a negative side).
- kv_exchange "allgather": K/V are all-gathered (every rank then holds the full K/V) in two asynchronous
  collectives, one per local chunk slot (`allgather._KVGather`; with zigzag the first and the second half of the
  sequence), so a causal query chunk of the first half computes while the second half is in flight; each local query
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
sequence (zigzag or contiguous per sequence); each step's calls are varlen over one chunk per sequence (`chunks.Chunks`,
built once per cu_seqlens tensor, not per call).

Dropout: every kernel call of a rank (a ring step's query chunk, or an all-gather chunk) draws its own keep
pattern from one `[seed, offset]` drawn per forward, with the seed advanced by the call's global index
(rank, step, chunk); the backward re-derives the same states, so forward and backward drop the same elements
and no two calls of the group share a pattern.

Learnable sinks (`learnable_sink`): the steps run without the sink; `directions.forward` folds it once into each
shard's merged out and lse (`core/sink.py`), the backward's steps need only those, and each rank's dsink is its
rows' part (summed over the group like any parameter's gradient).

Everything is validated before the first communication (options with `flash_attn_func`'s own rules, the
operands of the first kernel call, the backend's ability to run it): an argument error raises on every rank
that gets it without leaving sends or receives posted. Refused, with an error that says why: varlen with the
all-gather, ALiBi and softcap (not built), windows with the ring.

Modules, one per concern (as torch's `torch.distributed.tensor.experimental._context_parallel`): `group` (mesh or
ProcessGroup), `sharding` (layouts, `shard`, `unshard`), `chunks` (a shard's local chunks, varlen indices),
`plan` (`plan_call`: validation and the ring's step calls), `merge` (lse merge), `transfers` (communication in
flight), one module per exchange (`ring`, `allgather`, `a2a`, `hybrid`), `directions` (`forward`, `backward`),
`function` (the autograd Function), `ops` (torch.compile's custom ops), `attention` (the front ends) and
`training` (gradients over the group: `sum_gradients`, `register_cp_comm_hook`).
"""

from __future__ import annotations

from .attention import context_parallel_attn, context_parallel_sdpa
from .directions import backward, forward
from .group import process_group
from .plan import KV_EXCHANGES, plan_call
from .sharding import LAYOUTS, chunk_ids, shard, unshard
from .training import register_cp_comm_hook, sum_gradients

__all__ = ["KV_EXCHANGES", "LAYOUTS", "backward", "chunk_ids", "context_parallel_attn", "context_parallel_sdpa",
           "forward", "plan_call", "process_group", "register_cp_comm_hook", "shard", "sum_gradients", "unshard"]
