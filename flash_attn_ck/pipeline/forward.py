"""The forward pipeline: validate -> select backend -> kernel -> unpad.

Returns `(out, softmax_lse, rng_state, probs, prepared)`; lse is fp32 `(b, h, s_q)` (varlen `(h, total_q)`);
`prepared` holds the validated description of the call (pipeline/prepare.py), which the backward of the
same call may reuse.
Empty calls run no kernel: without query rows (none in any sequence) or without key rows, out is zero and
lse is +inf (flash-attn's convention for empty rows). Varlen rows in no sequence (after
`cu_seqlens_q[-1]`) get the same: out 0, lse +inf.
"""

from __future__ import annotations

import torch

from ..core.dropout import new_rng_state
from ..core.errors import ArgumentError
from ..core.inputs import kernel_params
from ..core.options import AttentionOptions
from ..core.scores import attention_probs
from .prepare import prepare, prepared_backend


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions,
                      rng_state: torch.Tensor | None = None):
    """`rng_state`: with dropout, the keep pattern of this `[seed, offset]` (checked by the caller); None draws one."""
    # ---- validate and choose the backend before allocating anything ------------------------------
    call = prepare(q, k, v, options)
    problem = call.problem
    chosen = prepared_backend(call, options.backend)
    if options.return_attn_probs and problem.dropout_p > 0 and not chosen.draws_reference_keep_pattern:
        raise ArgumentError(f"return_attn_probs: backend {chosen.name!r} draws its own dropout pattern, which "
                            f"flash_attn_ck cannot materialise (use backend='reference' or 'triton', or dropout_p=0)")

    # ---- outputs -------------------------------------------------------------------------------
    if problem.dropout_p == 0:
        rng_state = None
    elif rng_state is None:
        rng_state = new_rng_state(q.device)
    params = kernel_params(problem, q, k, v, options, rng_state)
    out = torch.empty(params.q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(problem.lse_shape, dtype=problem.accum_dtype, device=q.device)

    # ---- kernel --------------------------------------------------------------------------------
    if problem.has_queries and problem.has_keys:
        chosen.forward(problem, params, out, lse)
    else:       # an empty grid is an invalid launch: no kernel; every row sees no key
        out.zero_()
        lse.fill_(float("inf"))
    if problem.varlen:      # rows after cu_seqlens_q[-1] belong to no sequence: out 0, lse +inf (every backend)
        chosen.fill_outside_sequences((options.cu_seqlens_q, out, 0, 0.0), (options.cu_seqlens_q, lse, 1, float("inf")))

    out = out[..., :problem.head_dim] if problem.head_dim_padded != problem.head_dim else out
    probs = attention_probs(problem, params, lse) if options.return_attn_probs else None
    return out, lse, rng_state, probs, call
