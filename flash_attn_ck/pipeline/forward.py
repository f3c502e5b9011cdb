"""The forward pipeline: validate -> select backend -> kernel -> unpad.

Returns `(out, softmax_lse, rng_state, probs, prepared)`; out has q's rows and heads and v's head dim d_v;
lse is fp32 `(b, h, s_q)` (varlen `(h, total_q)`);
`prepared` holds the validated description of the call (pipeline/prepare.py), which the backward of the
same call may reuse. A caller's `out` (any strides with a unit last one) is written and returned.
Empty calls run no kernel: without query rows (none in any sequence) or without key rows, out is zero and
lse is +inf (flash-attn's convention for empty rows). Varlen rows in no sequence (after
`cu_seqlens_q[-1]`) get the same: out 0, lse +inf. With a learnable sink, the kernels' out and lse are folded
into the sink's (core/sink.py): a row without keys then has out 0 and lse = sink[h].
"""

from __future__ import annotations

import torch

from ..backends.base import Backend
from ..core import checks
from ..core.dropout import new_rng_state
from ..core.errors import ArgumentError
from ..core.inputs import kernel_params
from ..core.options import AttentionOptions
from ..core.problem import AttentionParams, AttentionProblem
from ..core.scores import attention_probs
from ..core.sink import fold_sink
from .device import on_the_tensors_device
from .prepare import PreparedCall, prepare, prepared_backend
from .select import note_forward_backend


@on_the_tensors_device
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions,
                      rng_state: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      prepared: PreparedCall | None = None):
    """`rng_state`: with dropout, the keep pattern of this `[seed, offset]` (checked by the caller); None draws one.
    `out`: the caller's output (like q), written in place; None allocates one. `prepared`: this call's
    `prepare(q, k, v, options)` where the caller made it already (the eager entry does)."""
    # ---- validate and choose the backend before allocating anything ------------------------------
    call = prepare(q, k, v, options) if prepared is None else prepared
    problem = call.problem
    chosen = prepared_backend(call, options.backend)
    if options.return_attn_probs and problem.dropout_p > 0 and not chosen.draws_reference_keep_pattern:
        raise ArgumentError(f"return_attn_probs: backend {chosen.name!r} draws its own dropout pattern, which "
                            f"flash_attn_ck cannot materialise (use backend='reference' or 'triton', or dropout_p=0)")
    if out is not None:
        check_forward_out(q, k, v, out, options, rng_state, problem.results_dtype, problem.out_shape)

    # ---- outputs -------------------------------------------------------------------------------
    device = problem.device     # q's (the signature decides it), without making a torch.device per access
    kernels_rng_state, rng_state = _rng_states(problem, rng_state, device)
    params = kernel_params(problem, q, k, v, options, kernels_rng_state)
    padded = problem.head_dim_v_padded != problem.head_dim_v
    # Every backend writes any strides with a unit last one, so a caller's out is the kernel's, unless v's head
    # dim is padded: the kernels then write a padded buffer, copied into out below.
    target = out if out is not None and not padded else torch.empty(
        (*params.q.shape[:-1], problem.head_dim_v_padded), dtype=problem.results_dtype, device=device)
    lse = torch.empty(problem.lse_shape, dtype=problem.accum_dtype, device=device)

    # ---- kernel --------------------------------------------------------------------------------
    _compute(chosen, problem, params, options, target, lse)

    computed = target[..., :problem.head_dim_v] if padded else target
    if out is None:
        out = computed
    elif computed is not out:
        out.copy_(computed)
    note_forward_backend(lse, options.backend, chosen)
    probs = attention_probs(problem, params, lse) if options.return_attn_probs else None
    if probs is not None and options.seqused_k is not None:
        probs = probs[::2].contiguous()      # the kernels' sequences 2i are the call's (core/inputs.py)
    return out, lse, rng_state, probs, call


def _rng_states(problem: AttentionProblem, rng_state: torch.Tensor | None,
                device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`(what the kernels read, what the call returns)`: none without dropout; with it, the caller's `[seed, offset]`
    and a copy of it (the ops declare no alias), or one fresh draw for both."""
    if problem.dropout_p == 0:
        return None, None
    if rng_state is None:
        drawn = new_rng_state(device)
        return drawn, drawn
    return rng_state, rng_state.clone()


def _compute(chosen: Backend, problem: AttentionProblem, params: AttentionParams, options: AttentionOptions,
             target: torch.Tensor, lse: torch.Tensor) -> None:
    """The forward into `target` and `lse`: the kernel, then the sink where the kernel did not take it, then the rows
    in no sequence."""
    folded = False
    if problem.has_queries and problem.has_keys:
        chosen.forward(problem, params, target, lse)
        folded = problem.has_sink and chosen.forward_takes_sink(problem)
    else:       # an empty grid is an invalid launch: no kernel; every row sees no key
        target.zero_()
        lse.fill_(float("inf"))
    if options.learnable_sink is not None and not folded:   # before the rows in no sequence: they keep +inf
        fold_sink(options.learnable_sink, target, lse)
    if problem.varlen:      # rows after cu_seqlens_q[-1] belong to no sequence: out 0, lse +inf (every backend)
        cu_seqlens_q, _ = params.offsets()      # (the kernels' offsets end where the call's do)
        chosen.fill_outside_sequences((cu_seqlens_q, target, 0, 0.0), (cu_seqlens_q, lse, 1, float("inf")))


def check_forward_out(q, k, v, out, options: AttentionOptions, rng_state, dtype: torch.dtype,
                      shape: tuple[int, ...]) -> None:
    """A caller's out: the call's output dtype (q's, or `out_dtype`), q's device, `shape` (q's rows and heads, v's
    head dim), a unit last stride, no stride 0, writable here (not an inference tensor outside inference_mode), and
    no memory shared with an input (the kernels read q/k/v while they write out)."""
    checks.check_tensor("out", out)
    checks.check_value_head_dim("out", out, shape[-1])
    checks.check_result("out", out, q, dtype, shape)
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise ArgumentError("out: an inference tensor (made under torch.inference_mode) can be written only inside "
                            "inference_mode")
    checks.check_outputs_disjoint((("out", out),), (("q", q), ("k", k), ("v", v), *options.tensors(),
                                                    ("rng_state", rng_state)))
