"""torch.library custom ops (namespace `flash_attn_ck`): forward, backward, and their fake versions.

The public functions call these ops, so `torch.compile(fullgraph=True)` traces through them
without graph breaks and autograd is registered on the op itself. Ops cannot return None: absent
optional results are empty tensors (`rng_state` without dropout, `probs` unless requested).

- `fwd(q, k, v, ...) -> (out, softmax_lse, rng_state, probs)`; only `out` is differentiable.
- `bwd(dout, q, k, v, out, softmax_lse, ...) -> (dq, dk, dv, softmax_d)`
- `bwd_out(...)`: the same, writing into caller-provided dq/dk/dv (declared as mutated).

With dropout, `fwd` draws `rng_state` on the device from torch's default generator (frontend/dropout.py),
so it is random per call like `torch.nn.functional.dropout`: reseeding reproduces it, and a captured CUDA
graph draws a fresh one on every replay. The fakes allocate exactly as the real ops do (the shared
frontend), so shapes, dtypes and strides match for every backend.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .frontend.backward import attention_backward
from .frontend.forward import attention_forward
from .frontend.problem import pad_head_dim


def _varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> dict:
    if cu_seqlens_q is None:
        return {}
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k)


# ---- forward -------------------------------------------------------------------------------------

@torch.library.custom_op("flash_attn_ck::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
        max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor], dropout_p: float,
        softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
        deterministic: bool, return_probs: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, lse, rng_state, probs = attention_forward(
        q, k, v, **_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, deterministic=deterministic,
        return_probs=return_probs, backend=backend or None)
    rng_state = torch.empty(0, dtype=torch.int64, device=q.device) if rng_state is None else rng_state
    # An absent `probs` keeps the dtype a present one has (fp32/fp64, like lse), so the fake matches.
    return out, lse, rng_state, lse.new_empty(0) if probs is None else probs


@fwd.register_fake
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
              softcap, deterministic, rng_state, backend, max_workspace_bytes):
    return attention_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv,
        **_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, deterministic=deterministic,
        rng_state=rng_state if rng_state is not None and rng_state.numel() else None, backend=backend or None,
        max_workspace_bytes=max_workspace_bytes)


@torch.library.custom_op("flash_attn_ck::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
        alibi_slopes: Optional[Tensor], dropout_p: float, softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, deterministic: bool, rng_state: Optional[Tensor],
        backend: str, max_workspace_bytes: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward(dout, q, k, v, out, softmax_lse, None, None, None, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p, softmax_scale, causal, window_left,
                     window_right, softcap, deterministic, rng_state, backend, max_workspace_bytes)


@bwd.register_fake
def _(dout, q, k, v, out, softmax_lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), softmax_lse.new_empty(softmax_lse.shape)


@torch.library.custom_op("flash_attn_ck::bwd_out", mutates_args=("dq", "dk", "dv"))
def bwd_out(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Tensor,
            dk: Tensor, dv: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
            max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor], dropout_p: float,
            softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
            deterministic: bool, rng_state: Optional[Tensor], backend: str,
            max_workspace_bytes: Optional[int] = None) -> Tensor:
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right,
                     softcap, deterministic, rng_state, backend, max_workspace_bytes)[3]


@bwd_out.register_fake
def _(dout, q, k, v, out, softmax_lse, *args):
    return softmax_lse.new_empty(softmax_lse.shape)


# ---- autograd on the forward op ---------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p, softmax_scale,
     causal, window_left, window_right, softcap, deterministic, _return_probs, backend) = inputs
    out, lse, rng_state, probs = output
    # Only `out` carries a gradient: the backward has no term for lse or probs, so they are marked
    # non-differentiable instead of having their gradients silently dropped.
    ctx.mark_non_differentiable(lse, rng_state, probs)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state)
    ctx.options = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                       softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                       window_right=window_right, softcap=softcap, deterministic=deterministic, backend=backend)


def _fwd_backward(ctx, dout, *_non_differentiable):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state = ctx.saved_tensors
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv, _ = torch.ops.flash_attn_ck.bwd(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes=alibi_slopes,
        rng_state=rng_state, **ctx.options)
    return (dq, dk, dv) + (None,) * 14


fwd.register_autograd(_fwd_backward, setup_context=_setup_context)
