"""The flash-attn 2.x public API, plus the low-level forward/backward for context-parallel users.

Every function takes one extra keyword, `backend` ("triton", "ck", "reference"; default: the
`FLASH_ATTN_CK_BACKEND` environment variable, else the best backend that fits the call).
Packed variants pass views of the packed tensor, so gradients flow into it without copies.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import ops
from .backends.base import backend_class
from .frontend.checks import ArgumentError, check_tensor
from .frontend.chunking import ChunkPlan, WorkspaceError, plan_chunks, workspace_cap
from .frontend.inputs import describe_call
from .frontend.problem import AttentionParams

# ---- low-level ops: (out, lse, rng_state) forward and the CK-shaped mha_bwd ---------------------


def _scale(q: torch.Tensor, softmax_scale: Optional[float]) -> float:
    check_tensor("q", q)
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _window(window_size) -> tuple[int, int]:
    if len(window_size) != 2:
        raise ArgumentError(f"window_size: expected (left, right), got {tuple(window_size)}")
    return int(window_size[0]), int(window_size[1])


def flash_attn_fwd(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                   dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, deterministic=False, return_attn_probs=False, backend=None):
    """Forward only: `(out, softmax_lse, rng_state)` (+ `probs` if `return_attn_probs`).

    `rng_state` is None without dropout. Batch layout unless `cu_seqlens_q/k` are given."""
    left, right = _window(window_size)
    out, lse, rng_state, probs = ops.attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q or 0, max_seqlen_k or 0, alibi_slopes, float(dropout_p),
        _scale(q, softmax_scale), bool(causal), left, right, float(softcap), bool(deterministic),
        bool(return_attn_probs), backend or "")
    rng_state = rng_state if rng_state.numel() else None
    return (out, lse, rng_state, probs) if return_attn_probs else (out, lse, rng_state)


def flash_attn_bwd(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, *, cu_seqlens_q=None,
                   cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, alibi_slopes=None, dropout_p=0.0,
                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False,
                   rng_state=None, backend=None, max_workspace_bytes=None):
    """Backward only, shaped like flash-attention's CK `mha_bwd`: `(dq, dk, dv, softmax_d)`.

    Preallocated dq/dk/dv are written in place (checked for dtype, device, last-dim stride, shape).
    `max_workspace_bytes` caps the backward's workspace (default: `$FLASH_ATTN_CK_MAX_WORKSPACE_BYTES`,
    else 4 GiB; -1: no cap): larger calls run in chunks (frontend/chunking.py)."""
    left, right = _window(window_size)
    common = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q or 0, max_seqlen_k or 0, alibi_slopes, float(dropout_p),
              _scale(q, softmax_scale), bool(causal), left, right, float(softcap), bool(deterministic), rng_state,
              backend or "", max_workspace_bytes)
    if dq is None and dk is None and dv is None:
        return torch.ops.flash_attn_ck.bwd(dout, q, k, v, out, softmax_lse, *common)
    # Validate the given outputs before allocating the missing ones (nothing is touched on error).
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is not None:
            check_tensor(name, t, like.dim())
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    softmax_d = torch.ops.flash_attn_ck.bwd_out(dout, q, k, v, out, softmax_lse, dq, dk, dv, *common)
    return dq, dk, dv, softmax_d


def backward_workspace(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, deterministic=False, max_workspace_bytes=None,
                       backends=("reference", "ck", "triton")) -> dict[str, ChunkPlan | str]:
    """The backward workspace each backend would allocate for this call: a `ChunkPlan` (buffers and
    bytes per chunk, number of chunks, peak; `.describe()` prints it), or why there is none.

    Plans depend only on shapes, so q/k/v may be `device="meta"` tensors of any size."""
    problem = describe_call(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                            softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                            deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    params = AttentionParams(q, k, v, cu_seqlens_q, cu_seqlens_k)
    cap = workspace_cap(max_workspace_bytes)
    report = {}
    for name in backends:
        try:
            report[name] = plan_chunks(problem, backend_class(name)(), cap, params)
        except (WorkspaceError, RuntimeError, ImportError) as error:
            report[name] = f"{type(error).__name__}: {error}"
    return report


# ---- flash-attn 2.x functions -------------------------------------------------------------------

def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, backend, varlen=None):
    varlen = varlen or {}
    result = flash_attn_fwd(q, k, v, **varlen, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            deterministic=deterministic, return_attn_probs=return_attn_probs, backend=backend)
    if return_attn_probs:
        out, lse, _, probs = result
        return out, lse, probs
    return result[0]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, backend=None):
    """q (b, s_q, h, d), k/v (b, s_k, h_k, d) -> out (b, s_q, h, d).

    With `return_attn_probs` (testing only): `(out, softmax_lse, probs)`, `probs` being the softmax
    probabilities (b, h, s_q, s_k) with dropped entries negated."""
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, backend)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              backend=None):
    """qkv (b, s, 3, h, d)."""
    check_tensor("qkv", qkv, 5)
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs, backend)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             backend=None):
    """q (b, s_q, h, d), kv (b, s_k, 2, h_k, d)."""
    check_tensor("kv", kv, 5)
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, backend)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, backend=None):
    """q (total_q, h, d), k/v (total_k, h_k, d), cu_seqlens int32 (b + 1,); lse (h, total_q)."""
    if block_table is not None:
        raise ArgumentError("block_table: paged KV caches are not supported by flash_attn_ck (pass None)")
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, backend, varlen)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, backend=None):
    """qkv (total, 3, h, d)."""
    check_tensor("qkv", qkv, 4)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, backend=backend)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    backend=None):
    """q (total_q, h, d), kv (total_k, 2, h_k, d)."""
    check_tensor("kv", kv, 4)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, backend=backend)
