"""The front ends: `context_parallel_attn` (flash_attn_func's (b, s, h, d) API) and `context_parallel_sdpa`
(`F.scaled_dot_product_attention`'s (b, h, s, d))."""

from __future__ import annotations

import torch

from ...core.errors import ArgumentError
from ...core.options import AttentionOptions
from ..sdpa import positive_scale
from .function import ContextParallelAttention
from .ops import compiled_call
from .plan import plan_call


def context_parallel_attn(q, k, v, group=None, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                          dropout_p=0.0, deterministic=False, layout="zigzag", kv_exchange="ring", backend=None,
                          return_lse=False, cu_seqlens=None, learnable_sink=None, **unsupported):
    """Attention over a sequence sharded across `group` (see the module docstring), differentiable.

    Args:
        q, k, v: this rank's shards (b, s / W, h, d), (b, s / W, h_k, d) and (b, s / W, h_k, d_v) (v's head dim
            d_v may differ from d), as `shard(x, group, layout=layout)` cuts them (every rank the same b, h, d,
            d_v; s a multiple of 2W). Varlen: (total / W, ...) rows, as `shard(x, group, seq_dim=0, layout=layout,
            cu_seqlens=cu_seqlens)` cuts them.
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
        learnable_sink: as for `flash_attn_func`: a (h,) tensor of logits, folded once into the merged lse (the
            steps run without it); its gradient on each rank is that rank's rows' part (sum it over the group, as
            the parameters' gradients: `sum_gradients`, `register_cp_comm_hook`).

    Returns:
        this rank's shard of the output (b, s / W, h, d_v), varlen (total / W, h, d_v), as `shard` cuts the full
        output.

    Raises:
        ArgumentError (before any communication): ALiBi, softcap, cu_seqlens_q/k, a window or varlen with the
            all-gather exchange (windows: the ring), or a bad shape/option.
    """
    if unsupported:
        raise ArgumentError(f"{', '.join(sorted(unsupported))}: not supported by context_parallel_attn "
                            "(ALiBi and softcap are not built for context parallelism; varlen takes one "
                            "cu_seqlens for q and k)")
    if type(return_lse) is not bool:
        raise ArgumentError(f"return_lse: expected a bool, got {return_lse!r}")
    if torch.compiler.is_compiling():
        out, lse = compiled_call(q, k, v, group, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                 dropout_p=dropout_p, deterministic=deterministic, layout=layout,
                                 kv_exchange=kv_exchange, backend=backend, cu_seqlens=cu_seqlens,
                                 learnable_sink=learnable_sink)
        return (out, lse) if return_lse else out
    options = AttentionOptions(softmax_scale=softmax_scale, causal=causal, window_size=window_size, dropout_p=dropout_p,
                               deterministic=deterministic, backend=backend, learnable_sink=learnable_sink)
    k, v = (t.contiguous() if isinstance(t, torch.Tensor) else t for t in (k, v))
    call = plan_call(q, k, v, group, options=options, layout=layout, kv_exchange=kv_exchange, cu_seqlens=cu_seqlens)
    out, lse = ContextParallelAttention.apply(q, k, v, learnable_sink, call)
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

