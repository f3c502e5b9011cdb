"""The backward pipeline: validate -> workspace plan (chunks under the cap) -> per chunk: pad ->
backend kernel -> reduce (GQA group sum, fp32 sums of split-group partials) -> unpad.

Shaped like flash-attention's `mha_bwd`: returns `(dq, dk, dv, softmax_d)` (dv, like v, out and dout, with
v's head dim d_v; dq and dk with q's d), accepts preallocated dq/dk/dv, and a call or chunk without query or
key rows runs no kernel (`_without_kernel`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..backends.base import Backend
from ..core import checks
from ..core.inputs import sequence_tensors
from ..core.options import AttentionOptions
from ..core.plan import WorkspacePlan
from ..core.problem import AttentionParams, AttentionProblem, accum_dtype_for, result_shape, row_stats_shape
from .chunking import (
    backward_plan,
    chunk_problem,
    chunk_rows,
    chunk_views,
    kv_view,
    plan_chunks,
    workspace_cap,
)
from .device import on_the_tensors_device
from .prepare import PreparedCall, prepare, prepared_backend
from .select import forward_backend


@on_the_tensors_device
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor | None,
                       dk: torch.Tensor | None, dv: torch.Tensor | None, options: AttentionOptions,
                       rng_state: torch.Tensor | None, prepared: PreparedCall | None = None):
    """`prepared`: the forward's preparation of this very call (attention_forward returns it), from a
    caller that guarantees the operands are the forward's own (the autograd Function: saved tensors,
    and a dout that autograd has matched to out). Validation is then skipped; everyone else leaves
    it None."""
    # ---- validate: everything before any allocation, so a failing call mutates nothing ----------
    if prepared is None:
        prepared = prepare(q, k, v, options)
        check_backward_operands(q, k, v, dout, out, softmax_lse, dq, dk, dv, rng_state, options)
    problem = prepared.problem
    chosen = prepared_backend(prepared, options.backend, forward_backend(softmax_lse, options.backend))
    cap = workspace_cap(options.max_workspace_bytes)

    # ---- outputs: the caller's, else new ------------------------------------------------------
    dq, dk, dv = gradient_outputs(q, k, v, dq, dk, dv, problem.results_dtype)
    params = AttentionParams(q, k, v, *sequence_tensors(options), rng_state)
    softmax_d = run_backward(chosen, problem, params, out, softmax_lse, dout, dq, dk, dv, cap)
    if problem.varlen:      # rows in no sequence (after cu_seqlens[-1]): zero gradients and D, on every backend
        cu_q, cu_k = params.offsets()      # (the kernels' offsets end where the call's do)
        chosen.fill_outside_sequences((cu_q, dq, 0, 0.0), (cu_q, softmax_d, 1, 0.0), (cu_k, dk, 0, 0.0),
                                      (cu_k, dv, 0, 0.0))
    return dq, dk, dv, softmax_d


def gradient_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dq: torch.Tensor | None,
                     dk: torch.Tensor | None, dv: torch.Tensor | None,
                     dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The caller's dq/dk/dv where given (check_backward_operands checks them), new tensors like q, k, v elsewhere
    (in `dtype`: the call's result dtype; None: the inputs'). q, k, v are tensors: every caller has checked them."""
    return (torch.empty_like(q, dtype=dtype) if dq is None else dq,
            torch.empty_like(k, dtype=dtype) if dk is None else dk,
            torch.empty_like(v, dtype=dtype) if dv is None else dv)


def check_backward_operands(q, k, v, dout, out, softmax_lse, dq, dk, dv, rng_state, options: AttentionOptions) -> None:
    """The backward's operands besides q, k, v (which have passed `check_shapes` with the options): shapes, dtypes,
    devices, strides and aliasing, no values, so the ops' fakes run it too."""
    out_shape = result_shape(q, v)
    for name, t in (("out", out), ("dout", dout)):
        checks.check_tensor(name, t)
        checks.check_value_head_dim(name, t, out_shape[-1])
        checks.check_like(name, t, q.dtype, q.device, out_shape)
    checks.check_tensor("softmax_lse", softmax_lse)
    checks.check_dtype("softmax_lse", softmax_lse, accum_dtype_for(q.dtype))
    checks.check_device("softmax_lse", softmax_lse, q.device)
    checks.check_shape("softmax_lse", softmax_lse, row_stats_shape(tuple(q.shape[:-2]), q.shape[-2]))
    checks.check_last_dim_contiguous("softmax_lse", softmax_lse)   # the kernels index rows with unit stride
    results_dtype = checks.check_out_dtype_for(options.out_dtype, q.dtype)
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is not None:
            checks.check_result(name, t, q, results_dtype, like.shape)
    # Preallocated outputs: no stride 0, no memory shared with an input or another output (the kernels
    # read inputs while they write outputs, so an alias would corrupt the result).
    checks.check_outputs_disjoint(
        (("dq", dq), ("dk", dk), ("dv", dv)),
        (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("softmax_lse", softmax_lse), *options.tensors(),
         ("rng_state", rng_state)))
    if options.dropout_p > 0 and rng_state is None:
        raise checks.ArgumentError("rng_state: required when dropout_p > 0 (pass the rng_state the forward returned)")
    if rng_state is not None:       # checked as the forward checks it, dropout or not
        checks.check_rng_state(rng_state, q.device)


def run_backward(backend: Backend, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                 cap: int | None) -> torch.Tensor:
    """Run one validated backward into dq/dk/dv, in chunks when the workspace would exceed `cap`;
    returns softmax_d."""
    p = problem
    # ---- workspace plan: the whole call, or chunks under the cap --------------------------------
    chunking = plan_chunks(p, backend, cap, params)
    backend = chunking.runner       # the leaner setup when the asked-for one does not fit the cap
    shared = {b.name: b.allocate(p.device) for b in chunking.shared}
    softmax_d = shared["softmax_d"]
    # Every backend reads lse and D with one set of strides (CK's lsed strides, the Triton kernels' lse group): a
    # caller's lse strided otherwise (a slice of a longer one) is copied into softmax_d's layout, never misread.
    if lse.stride() != softmax_d.stride():
        lse = torch.empty_like(softmax_d).copy_(lse)

    # ---- one chunk (the call fits under the cap): the call's own tensors, no views ---------------
    chunks = chunking.chunks
    if len(chunks) == 1:     # chunks partition the call, so one chunk is the whole call (cheaper than comparing)
        run_chunk(backend, p, params, out, lse, dout, dq, dk, dv, softmax_d, chunking.per_chunk)
        return softmax_d

    # ---- chunks, in a fixed order; a split group's dK/dV partials are summed in fp32 ----------------
    for index, chunk in enumerate(chunks):
        rows_q, rows_k = chunk_rows(p, chunk, chunking.offsets)
        sub = chunk_problem(p, chunk, rows_q, rows_k)
        views = chunk_views(p, chunk, chunking, params, out, lse, dout, dq, softmax_d)
        kv_grads = kv_view(p, chunk, chunking, dk), kv_view(p, chunk, chunking, dv)
        if not chunk.partial(p):
            run_chunk(backend, sub, views.params, views.out, views.lse, views.dout, views.dq, *kv_grads,
                      views.softmax_d)
            continue
        dk_grad, dv_grad = kv_grads
        partials = _leading(shared["dk_partial"], dk_grad), _leading(shared["dv_partial"], dv_grad)
        sums = _leading(shared["dk_sum"], dk_grad), _leading(shared["dv_sum"], dv_grad)
        run_chunk(backend, sub, views.params, views.out, views.lse, views.dout, views.dq, *partials,
                  views.softmax_d)
        for total, part in zip(sums, partials):
            total += part
        last_of_group = index + 1 == len(chunks) or \
            (chunks[index + 1].batch, chunks[index + 1].kv_heads) != (chunk.batch, chunk.kv_heads)
        if last_of_group:
            for grad, total in zip(kv_grads, sums):
                grad.copy_(total)
                total.zero_()
    return softmax_d


def _leading(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The leading part of a shared buffer with `like`'s shape (varlen chunks differ in rows)."""
    return buffer.narrow(0, 0, like.shape[0]) if buffer.shape != like.shape else buffer


def run_chunk(backend: Backend, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
              lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
              softmax_d: torch.Tensor, plan: WorkspacePlan | None = None) -> None:
    """One backward over views: plan -> pad -> kernel -> GQA group sum -> unpad. `plan`: this
    problem's backward_plan when the caller has it already."""
    p = problem
    if not (p.has_queries and p.has_keys):
        _without_kernel(p, out, dout, dq, dk, dv, softmax_d)
        return
    # ---- workspace: exactly the plan's named buffers (softmax_d is the caller's view) -----------
    plan = backward_plan(backend, p) if plan is None else plan
    workspace = plan.allocate(p.device, skip=("softmax_d",))
    workspace["softmax_d"] = softmax_d

    # ---- padding: kernels see head dims that are multiples of 8 (q/k's and v's each) ------------
    user_grads = dq, dk, dv
    if p.padded:
        def padded(name: str, t: torch.Tensor) -> torch.Tensor:
            buf = workspace.get(f"{name}_padded")
            if buf is None:         # this operand's head dim is a multiple of 8 already
                return t
            buf[..., :t.shape[-1]].copy_(t)
            return buf
        params = replace(params, q=padded("q", params.q), k=padded("k", params.k), v=padded("v", params.v))
        out, dout = padded("out", out), padded("dout", dout)
        dq, dk, dv = (workspace.get(f"{name}_padded", grad) for name, grad in zip(("dq", "dk", "dv"), user_grads))

    # ---- kernel --------------------------------------------------------------------------------
    backend.backward(p, params, out, lse, dout, dq, dk, dv, workspace)

    # ---- reduce: sum each group of h/h_k query heads of the expanded dK/dV (CK contract) --------
    if plan.reduce_expanded_kv:
        for grad, expanded in ((dk, workspace["dk_expanded"]), (dv, workspace["dv_expanded"])):
            torch.sum(expanded.unflatten(-2, (p.heads_k, p.group_size)), dim=-2, out=grad)

    # ---- unpad ---------------------------------------------------------------------------------
    if p.padded:
        for user, computed in zip(user_grads, (dq, dk, dv)):
            if computed is not user:
                user.copy_(computed[..., :user.shape[-1]])


def _without_kernel(problem: AttentionProblem, out: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor, softmax_d: torch.Tensor) -> None:
    """The backward of a call or chunk with an empty side, which launches nothing: CK sizes its grids from the
    (max) lengths, and ceil(0 / tile) blocks is an invalid launch; a chunk of query-empty sequences would hand
    it NULL q/dout pointers. No query rows: dK, dV, D (and dQ of rows in no sequence) are zero
    (docs/semantics.md §The CK fmha_bwd workspace contract). No key rows: every row sees no key, so dQ, dK and
    dV are zero and D = rowsum(dO * O), as the reference's dot_do_o computes it."""
    p = problem
    for grad in (dq, dk, dv):
        grad.zero_()
    if not p.has_queries:
        softmax_d.zero_()
        return
    d_rows = (dout.to(p.accum_dtype) * out.to(p.accum_dtype)).sum(-1)      # (b, s_q, h) / (total_q, h)
    softmax_d.copy_(d_rows.movedim(-1, -2) if not p.varlen else d_rows.transpose(0, 1))
