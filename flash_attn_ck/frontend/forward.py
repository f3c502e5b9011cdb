"""The mha_fwd pipeline: validate -> canonical mask -> backend kernel -> unpad.

Returns `(out, softmax_lse, rng_state, probs, problem)`; lse is fp32 `(b, h, s_q)` (varlen `(h, total_q)`);
`problem` is the validated description of the call, which the backward of the same call may reuse.
With `s_k == 0` no kernel runs: out is zero and lse is +inf (FA's convention for empty rows).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends.base import select_backend
from ..backends.reference import attention_probs
from .checks import ArgumentError
from .dropout import new_rng_state
from .inputs import describe_call, kernel_params, lse_shape


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                      max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                      alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                      softmax_scale: Optional[float] = None, causal: bool = False, window_size=(-1, -1),
                      softcap: float = 0.0, deterministic: bool = False, return_probs: bool = False,
                      backend: Optional[str] = None):
    # ---- validate and choose the backend before allocating anything ------------------------------
    problem = describe_call(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                            softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                            deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    chosen = select_backend(problem, backend)
    if return_probs and problem.dropout_p > 0 and not chosen.draws_reference_keep_pattern:
        raise ArgumentError(f"return_attn_probs: backend {chosen.name!r} draws its own dropout pattern, which "
                            f"flash_attn_ck cannot materialise (use backend='reference' or 'triton', or dropout_p=0)")

    # ---- outputs -------------------------------------------------------------------------------
    rng_state = new_rng_state(q.device) if problem.dropout_p > 0 else None
    params = kernel_params(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state)
    out = torch.empty(params.q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape(problem), dtype=problem.accum_dtype, device=q.device)

    # ---- kernel --------------------------------------------------------------------------------
    if not problem.varlen and problem.seqlen_k == 0:
        out.zero_()
        lse.fill_(float("inf"))
    else:
        chosen.forward(problem, params, out, lse)

    out = out[..., :problem.head_dim] if problem.head_dim_padded != problem.head_dim else out
    probs = attention_probs(problem, params, lse) if return_probs else None
    return out, lse, rng_state, probs, problem

