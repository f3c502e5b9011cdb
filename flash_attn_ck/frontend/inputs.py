"""Stage 1 of every call: validate q/k/v and the options, and describe the call as a problem.

`describe_call` runs every check that does not depend on the direction (forward or backward),
canonicalises causal/window into a `MaskInfo`, and returns an `AttentionProblem`. `kernel_params`
pads the head dim to a multiple of 8 for the kernels (zeros, so scores and outputs are unchanged).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import checks
from .mask import MaskInfo
from .problem import AttentionParams, AttentionProblem


def describe_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: Optional[float],
                  causal: bool, window_size, softcap: float, alibi_slopes: Optional[torch.Tensor],
                  dropout_p: float, deterministic: bool, cu_seqlens_q: Optional[torch.Tensor] = None,
                  cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                  max_seqlen_k: Optional[int] = None) -> AttentionProblem:
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    ndim = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, ndim)
    checks.check_dtype("q", q, checks.SUPPORTED_DTYPES)
    checks.check_same_dtype("k", k, "q", q)
    checks.check_same_dtype("v", v, "q", q)
    for name, t in (("k", k), ("v", v)):
        checks.check_device(name, t, q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_last_dim_contiguous(name, t)

    head_dim, heads_q = q.shape[-1], q.shape[-2]
    heads_k = k.shape[-2]
    checks.check_head_dim(head_dim)
    checks.check_head_counts(heads_q, heads_k)
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
            raise checks.ArgumentError("cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k: "
                                       "varlen calls need all four")
        batch = cu_seqlens_q.numel() - 1
        total_q, total_k = q.shape[0], k.shape[0]
        checks.check_positive_batch(batch)
        checks.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, batch, total_q, max_seqlen_q, q.device)
        checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch, total_k, max_seqlen_k, q.device)
        seqlen_q, seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        checks.check_shape("k", k, (total_k, heads_k, head_dim))
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = k.shape[1]
        total_q = total_k = 0
        checks.check_positive_batch(batch)
        checks.check_shape("k", k, (batch, seqlen_k, heads_k, head_dim))
    checks.check_shape("v", v, k.shape)

    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    checks.check_softmax_scale(softmax_scale)
    checks.check_window(window_size)
    checks.check_softcap(softcap)
    checks.check_dropout_p(dropout_p)
    if alibi_slopes is not None:
        checks.check_alibi_slopes(alibi_slopes, batch, heads_q, q.device)

    mask = MaskInfo.from_flash_args(causal, tuple(window_size), seqlen_q, seqlen_k)
    return AttentionProblem(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_k=heads_k,
        head_dim=head_dim, dtype=q.dtype, device=q.device, mask=mask, softmax_scale=float(softmax_scale),
        varlen=varlen, total_q=total_q, total_k=total_k, has_alibi=alibi_slopes is not None,
        dropout_p=float(dropout_p), softcap=float(softcap), deterministic=bool(deterministic))


def pad_to(t: torch.Tensor, head_dim_padded: int) -> torch.Tensor:
    """Zero-pad the last dim (a no-op view when it already has the kernel's size)."""
    extra = head_dim_padded - t.shape[-1]
    return t if extra == 0 else F.pad(t, (0, extra))


def kernel_params(problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                  alibi_slopes: Optional[torch.Tensor], rng_state: Optional[torch.Tensor]) -> AttentionParams:
    d = problem.head_dim_padded
    return AttentionParams(q=pad_to(q, d), k=pad_to(k, d), v=pad_to(v, d), cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes, rng_state=rng_state)


def lse_shape(problem: AttentionProblem) -> tuple[int, ...]:
    p = problem
    return (p.heads_q, p.total_q) if p.varlen else (p.batch, p.heads_q, p.seqlen_q)
