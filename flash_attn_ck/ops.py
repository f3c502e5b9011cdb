"""The flash_attn_ck operators (namespace `flash_attn_ck`) and the autograd function around them.

Ops are declared with `torch.library.define` + `impl` + `register_fake` rather than
`@torch.library.custom_op`, and autograd is a `torch.autograd.Function` outside them: on the H200
the custom_op wrapper and its registered autograd cost ~0.25 ms of host time per backward
(`scripts/launch_overhead.py --breakdown`), as much as the kernels of a small call (PyTorch
issues #139500, #176592). `torch.compile(fullgraph=True)` traces the Function and sees the ops
through their fakes, so compiled graphs keep one opaque op per direction; in plain eager mode the
Function calls the ops' implementations itself (`_direct`) and its backward reuses the forward's
validated problem. Ops cannot return None:
absent optional results are empty tensors (`rng_state` without dropout, `probs` unless requested).

- `fwd(q, k, v, ...) -> (out, softmax_lse, rng_state, probs)`; not differentiable by itself:
  `attention(...)` (the Function) makes `out` differentiable.
- `bwd(dout, q, k, v, out, softmax_lse, ...) -> (dq, dk, dv, softmax_d)`
- `bwd_out(...)`: the same, writing into caller-provided dq/dk/dv (declared as mutated).

With dropout, `fwd` draws `rng_state` on the device from torch's default generator (frontend/dropout.py),
so it is random per call like `torch.nn.functional.dropout`: reseeding reproduces it, and a captured CUDA
graph draws a fresh one on every replay. The fakes allocate exactly as the real ops do (the shared
frontend), so shapes, dtypes and strides match for every backend.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .frontend.backward import attention_backward
from .frontend.forward import attention_forward
from .frontend.problem import pad_head_dim

_OPTIONS = ("Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
            "Tensor? alibi_slopes, float dropout_p, float softmax_scale, bool causal, int window_left, "
            "int window_right, float softcap, bool deterministic")
torch.library.define("flash_attn_ck::fwd", f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}, bool return_probs, "
                     "str backend) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define("flash_attn_ck::bwd", f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                     f"Tensor softmax_lse, {_OPTIONS}, Tensor? rng_state, str backend, "
                     "int? max_workspace_bytes=None) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define("flash_attn_ck::bwd_out", f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                     "Tensor softmax_lse, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, "
                     f"{_OPTIONS}, Tensor? rng_state, str backend, int? max_workspace_bytes=None) -> Tensor")
# The ops themselves are not differentiable (the Function below is): autograd falls through to the
# kernels, so their outputs never carry a grad_fn and no autograd bookkeeping runs per call.
for _name in ("fwd", "bwd", "bwd_out"):
    torch.library.impl(f"flash_attn_ck::{_name}", "Autograd", torch.library.fallthrough_kernel)


def _varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> dict:
    if cu_seqlens_q is None:
        return {}
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k)


# ---- forward -------------------------------------------------------------------------------------

def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p,
             softmax_scale, causal, window_left, window_right, softcap, deterministic, return_probs, backend):
    """`fwd`'s results, then the call's AttentionProblem (for the Function's direct backward)."""
    out, lse, rng_state, probs, problem = attention_forward(
        q, k, v, **_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, deterministic=deterministic,
        return_probs=return_probs, backend=backend or None)
    rng_state = torch.empty(0, dtype=torch.int64, device=q.device) if rng_state is None else rng_state
    # An absent `probs` keeps the dtype a present one has (fp32/fp64, like lse), so the fake matches.
    return out, lse, rng_state, lse.new_empty(0) if probs is None else probs, problem


def _fwd(*args):
    return _forward(*args)[:4]


# The kernels run under no_grad: the Autograd fallthrough does not exclude autograd from the ops they call.
torch.library.impl("flash_attn_ck::fwd", "CompositeExplicitAutograd", torch.no_grad()(_fwd))


@torch.library.register_fake("flash_attn_ck::fwd")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p,
      softmax_scale, causal, window_left, window_right, softcap, deterministic, return_probs, backend):
    d = q.shape[-1]
    # out is a view of a buffer padded to a multiple of 8, exactly as the real op returns it.
    out = q.new_empty((*q.shape[:-1], pad_head_dim(d)))[..., :d]
    heads = q.shape[-2]
    accum = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cu_seqlens_q is None:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        lse = q.new_empty((batch, heads, seqlen_q), dtype=accum)
    else:
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        lse = q.new_empty((heads, q.shape[0]), dtype=accum)
    rng_state = q.new_empty((2 if dropout_p > 0 else 0,), dtype=torch.int64)
    probs = lse.new_empty((batch, heads, seqlen_q, seqlen_k) if return_probs else (0,))
    return out, lse, rng_state, probs


# ---- backward ------------------------------------------------------------------------------------

def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right,
              softcap, deterministic, rng_state, backend, max_workspace_bytes, problem=None):
    return attention_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv,
        **_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, deterministic=deterministic,
        rng_state=rng_state if rng_state is not None and rng_state.numel() else None, backend=backend or None,
        max_workspace_bytes=max_workspace_bytes, problem=problem)


def _bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
         dropout_p, softmax_scale, causal, window_left, window_right, softcap, deterministic, rng_state, backend,
         max_workspace_bytes=None):
    return _backward(dout, q, k, v, out, softmax_lse, None, None, None, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p, softmax_scale, causal, window_left,
                     window_right, softcap, deterministic, rng_state, backend, max_workspace_bytes)


torch.library.impl("flash_attn_ck::bwd", "CompositeExplicitAutograd", torch.no_grad()(_bwd))


@torch.library.register_fake("flash_attn_ck::bwd")
def _(dout, q, k, v, out, softmax_lse, *args, **kwargs):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), softmax_lse.new_empty(softmax_lse.shape)


def _bwd_out(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right, softcap, deterministic,
             rng_state, backend, max_workspace_bytes=None):
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right,
                     softcap, deterministic, rng_state, backend, max_workspace_bytes)[3]


torch.library.impl("flash_attn_ck::bwd_out", "CompositeExplicitAutograd", torch.no_grad()(_bwd_out))


@torch.library.register_fake("flash_attn_ck::bwd_out")
def _(dout, q, k, v, out, softmax_lse, *args, **kwargs):
    return softmax_lse.new_empty(softmax_lse.shape)


# ---- autograd: a Function around the forward op ----------------------------------------------------

_fwd_op = torch.ops.flash_attn_ck.fwd.default
_bwd_op = torch.ops.flash_attn_ck.bwd.default


def _direct(q) -> bool:
    """Whether the Function may call the ops' implementations directly instead of through the
    dispatcher: in plain eager mode (no compile tracing, no dispatch mode such as FakeTensorMode or
    FlopCounterMode, no tensor subclass), where the dispatcher would only box and unbox the 20-odd
    arguments and call the same Python function (0.14 ms of host time per backward on the H200
    host, `launch_overhead.py --breakdown`), and the backward can reuse the forward's validated
    problem. Everywhere else the ops run, so graphs, fakes and modes see one opaque op per direction."""
    # is_compiling() first: dynamo folds it to True and never traces the mode query.
    return not torch.compiler.is_compiling() and type(q) is torch.Tensor and _get_current_dispatch_mode() is None


class _Attention(torch.autograd.Function):
    """`fwd` with `out` differentiable; its backward is the `bwd` op (or, eagerly, its implementation)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p,
                softmax_scale, causal, window_left, window_right, softcap, deterministic, return_probs, backend):
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p,
                softmax_scale, causal, window_left, window_right, softcap, deterministic, return_probs, backend)
        if _direct(q):   # Function.forward runs under no_grad already
            out, lse, rng_state, probs, ctx.problem = _forward(*args)
        else:
            out, lse, rng_state, probs = _fwd_op(*args)
            ctx.problem = None
        # Only `out` carries a gradient: the backward has no term for lse or probs, so they are marked
        # non-differentiable instead of having their gradients silently dropped.
        ctx.mark_non_differentiable(lse, rng_state, probs)
        # Nothing flows back into lse/rng_state/probs: without this, autograd would allocate and zero
        # an lse-sized gradient (one more fill kernel) on every backward.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state)
        ctx.options = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
                       softcap, deterministic)
        ctx.backend = backend
        return out, lse, rng_state, probs

    @staticmethod
    def backward(ctx, dout, *_non_differentiable):
        if dout is None:   # an undefined gradient of `out` (not materialised): zero gradients, as None
            return (None,) * 17
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        max_seqlen_q, max_seqlen_k, *options = ctx.options
        rest = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, *options, rng_state, ctx.backend)
        if ctx.problem is not None and _direct(q) and not torch.is_grad_enabled():   # create_graph: the op
            dq, dk, dv, _ = _backward(dout, q, k, v, out, lse, None, None, None, *rest, None, problem=ctx.problem)
        else:
            dq, dk, dv, _ = _bwd_op(dout, q, k, v, out, lse, *rest)
        return (dq, dk, dv) + (None,) * 14


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    """`fwd`'s arguments -> `(out, softmax_lse, rng_state, probs)`, differentiable in `out`."""
    # Dynamo cannot trace a Function given one tensor twice (self-attention on one tensor, shared
    # cu_seqlens): repeats become views, which change nothing else (gradients flow through them).
    q, k, v, cu_seqlens_q, cu_seqlens_k = _distinct(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return _Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, *options)


def _distinct(*tensors):
    # `is`, not id(): dynamo resolves `is` between inputs while tracing, but guards id() on the object.
    result = []
    for t in tensors:
        if t is not None and any(t is earlier for earlier in result):
            t = t.view_as(t)
        result.append(t)
    return result
