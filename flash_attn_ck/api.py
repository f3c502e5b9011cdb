"""The flash-attn 2.x public API, plus the low-level forward/backward for context-parallel users.

Every function takes one extra keyword, `backend`: a name ("triton", "ck", "reference"), a backend
instance (e.g. `TritonBackend(use_tma=False)`), or None: the `FLASH_ATTN_CK_BACKEND` environment
variable, else the best backend that fits the call. Each function builds and validates the call's
options once (`AttentionOptions`); packed variants pass views of the packed tensor, so gradients flow
into it without copies.

Shapes: b batch, s_q/s_k query/key lengths, h query heads, h_k key/value heads (h_k divides h),
d the head dim of q and k, d_v that of v (and so of out, dout and dv; d_v may differ from d, both <= 256);
varlen: total_q/total_k packed rows, cu_seqlens int32 (b + 1,) offsets. Packed variants (qkv, kv) hold q/k
and v in one tensor, so there d_v = d necessarily.
"""

from __future__ import annotations

import re

import torch

from . import ops
from .backends.registry import backend_class
from .core.checks import (
    check_packed_slots,
    check_real_devices,
    check_rng_state,
    check_tensor,
    check_varlen_arguments,
)
from .core.errors import ArgumentError, WorkspaceError
from .core.inputs import check_structure, describe_call, sequence_tensors
from .core.options import AttentionOptions
from .core.problem import AttentionParams
from .core.sink import sink_gradient
from .pipeline.backward import gradient_outputs
from .pipeline.chunking import ChunkPlan, plan_chunks, workspace_cap

_COMMON_ARGS = """
        dropout_p: dropout probability in [0, 1); the keep pattern comes from `rng_state`.
        softmax_scale: scale of q k^T before the softmax (default 1 / sqrt(d)).
        causal: bottom-right aligned causal mask (flash-attn 2.1+).
        window_size: (left, right) sliding window, -1 = unbounded on that side.
        softcap: 0, or c > 0 for scores c * tanh(s / c).
        alibi_slopes: fp32 (h,) or (b, h): score bias -slope * |i + s_k - s_q - j|.
        deterministic: a bit-identical backward across runs (slower, more workspace on some backends).
        learnable_sink: None, or a (h,) tensor of logits (fp32, bf16, fp16 or fp64, on q's device), one per query
            head: each row's softmax also runs over `learnable_sink[h]`, which has no value (FA4's attention
            sinks; docs/semantics.md §Learnable sinks); differentiable.
        backend: a backend name, a Backend instance, or None (automatic)."""


def _documented(fn):
    """Completes `{common}` in fn's docstring with the options every function shares."""
    fn.__doc__ = fn.__doc__.format(common=_COMMON_ARGS)
    return fn


# ---- low-level forward/backward: (out, lse, rng_state) and flash-attention's mha_bwd ---------------

@_documented
def flash_attn_fwd(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                   seqused_k=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, deterministic=False, return_attn_probs=False, rng_state=None, out=None,
                   out_dtype=None, learnable_sink=None, backend=None):
    """The forward alone, returning what a backward (or a context-parallel merge) needs.

    Args:
        q: (b, s_q, h, d), or varlen (total_q, h, d); fp16, bf16, fp32 or fp64.
        k: (b, s_k, h_k, d), or varlen (total_k, h_k, d); q's dtype and device.
        v: (b, s_k, h_k, d_v), or varlen (total_k, h_k, d_v): k's rows and heads, its own head dim d_v <= 256
            (out has it too); q's dtype and device.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: varlen offsets and longest lengths
            (all four, or none for the batch layout).
        seqused_k: varlen only, int32 (b,) on q's device: sequence i attends only its first `seqused_k[i]`
            keys (rows `[cu_seqlens_k[i], cu_seqlens_k[i] + seqused_k[i])`); the backward gives its other
            keys zero gradients. Pass the same to `flash_attn_bwd`.
        return_attn_probs: also return the probabilities (testing only).
        rng_state: with dropout, draw the keep pattern of this int64 `[seed, offset]` (one per block of a
            context-parallel ring) instead of a fresh one from torch's generator; ignored without dropout.
        out: written in place and returned instead of a new tensor: q's rows and heads, v's head dim d_v,
            q's dtype and device, a unit last stride (any other strides), sharing no memory with an input, not an
            inference tensor outside inference_mode. Not differentiable: with out, q, k, v, alibi_slopes and out
            must not require grad while grad mode is on.
        out_dtype: None (q's dtype), or torch.float32 for fp16/bf16 q: out in fp32, the kernel's result before
            its rounding to q's dtype, for callers that merge partial outputs (context parallelism does). Not
            differentiable (as `out`); backends that cannot write fp32 refuse the call with their reason (CK,
            and the warp-specialised Triton kernels, which the Triton backend then passes over).{common}

    Returns:
        `(out, softmax_lse, rng_state)`, plus `probs` with `return_attn_probs`: out (b, s_q, h, d_v) or varlen
        (total_q, h, d_v) (dtype `out_dtype`); lse fp32
        (b, h, s_q) or varlen (h, total_q) (with a sink: over the keys and the sink); rng_state int64 [seed, offset]
        with dropout, else None;
        probs (b, h, s_q, s_k) with dropped entries negated.

    Raises:
        ArgumentError: a bad argument (the message names it), before anything is written.
        NoBackendError: no backend can run the call.
    """
    options = AttentionOptions(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes, dropout_p=dropout_p, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, deterministic=deterministic,
        return_attn_probs=return_attn_probs, backend=backend, out_dtype=out_dtype, learnable_sink=learnable_sink)
    # Before the op: its schema would reject a non-tensor with a less helpful message, and a meta
    # tensor anywhere would route the call to the op's fake (uninitialised results, no error).
    call = ops.prepared(q, k, v, options)
    if call is None:
        operands = (("q", q), ("k", k), ("v", v), *options.tensors())
        for name, t in operands[:3]:
            check_tensor(name, t)
    else:       # the preparation decided these: tensors, on q's device, a real one
        operands = (("q", q),)
    if out is not None:
        check_tensor("out", out)
    if len(operands) > 1 or out is not None or rng_state is not None:    # else the preparation decided every device
        check_real_devices((*operands, ("rng_state", rng_state), ("out", out)))
    if rng_state is not None:
        check_rng_state(rng_state, q.device)
    # Only a result in another dtype, or a given out, cannot be differentiated: the common call asks nothing more.
    if out_dtype not in (None, q.dtype) or out is not None:
        differentiated = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, out, options.alibi_slopes, learnable_sink))
        if differentiated and out_dtype not in (None, q.dtype):
            raise ArgumentError(f"out_dtype: results in {str(out_dtype).removeprefix('torch.')}, not q's dtype, are "
                                "not differentiable, and q, k, v, alibi_slopes, learnable_sink or out requires "
                                "grad; call it under torch.no_grad(), or without out_dtype")
        if differentiated:      # with out (the error above names out_dtype first)
            raise ArgumentError("out: the forward into a given out is not differentiable (as torch's out= "
                                "functions), and q, k, v, alibi_slopes, learnable_sink or out requires grad; call "
                                "it under torch.no_grad(), or without out")
    if out is None:
        out, lse, rng_state, probs = ops.attention(q, k, v, options, rng_state, call)
    else:
        lse, rng_state, probs = ops.attention_into(q, k, v, out, options, rng_state, call)
    rng_state = rng_state if rng_state is not None and rng_state.numel() else None
    return (out, lse, rng_state, probs) if return_attn_probs else (out, lse, rng_state)


@_documented
def flash_attn_bwd(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, *, cu_seqlens_q=None,
                   cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, alibi_slopes=None,
                   dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                   deterministic=False, rng_state=None, backend=None, max_workspace_bytes=None, out_dtype=None,
                   learnable_sink=None):
    """The backward alone, shaped like flash-attention's `mha_bwd`.

    Args:
        dout, out: q's rows and heads, v's head dim d_v. q, k, v and the options (seqused_k included): as given to
            `flash_attn_fwd`.
        softmax_lse, rng_state: what `flash_attn_fwd` returned (rng_state only with dropout).
        dq, dk, dv: preallocated gradients, written in place (checked for dtype, device, last-dim
            stride, shape); missing ones are allocated.
        out_dtype: None (q's dtype), or torch.float32 for fp16/bf16 q: dq, dk, dv in fp32, the kernels' results
            before their rounding to q's dtype, for callers that add partial gradients (context parallelism
            does); refused as by `flash_attn_fwd`.
        max_workspace_bytes: cap on the backward's workspace (default `$FLASH_ATTN_CK_MAX_WORKSPACE_BYTES`,
            else 4 GiB; -1: no cap); larger calls run in chunks (pipeline/chunking.py).
        learnable_sink: the forward's; out and softmax_lse are then the forward's with the sink, and the
            result has `dsink` too.{common}

    Returns:
        `(dq, dk, dv, softmax_d)`, and `dsink` after them with a learnable_sink: dq like q, dk like k, dv like v (dtype
        `out_dtype`); softmax_d = rowsum(dout * out), like lse; dsink like learnable_sink.

    Raises:
        ArgumentError: a bad argument. NoBackendError: no backend can run the call.
        WorkspaceError: even the smallest chunk's workspace exceeds the cap.
    """
    options = AttentionOptions(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes, dropout_p=dropout_p, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, deterministic=deterministic, backend=backend,
        max_workspace_bytes=max_workspace_bytes, out_dtype=out_dtype, learnable_sink=learnable_sink)
    operands = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("softmax_lse", softmax_lse))
    for name, t in operands:
        check_tensor(name, t)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv), ("rng_state", rng_state)):     # the op's schema takes
        if t is not None:                                                               # tensors or None only
            check_tensor(name, t)
    check_real_devices((("q", q), *operands, ("dq", dq), ("dk", dk), ("dv", dv), *options.tensors(),
                        ("rng_state", rng_state)))
    if learnable_sink is not None:      # the backward ops take no sink (ops.py): checked here, after q's rank
        check_structure(q, k, v, options)
    if dq is None and dk is None and dv is None:
        return _with_sink_gradient(ops.backward(dout, q, k, v, out, softmax_lse, options, rng_state),
                                   learnable_sink, softmax_lse)
    if torch.is_grad_enabled():
        for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
            if t is not None and t.requires_grad:
                raise ArgumentError(f"{name}: requires grad, and flash_attn_bwd writes it in place, which autograd "
                                    "cannot record (as torch's out= functions); call it under torch.no_grad(), or "
                                    "pass a tensor that does not require grad")
    dq, dk, dv = gradient_outputs(q, k, v, dq, dk, dv, options.out_dtype)
    softmax_d = ops.backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, options, rng_state)
    return _with_sink_gradient((dq, dk, dv, softmax_d), learnable_sink, softmax_lse)


def _with_sink_gradient(grads: tuple, sink, softmax_lse) -> tuple:
    """The backward's results, with dsink after them where the call has a learnable sink."""
    if sink is None:
        return grads
    return (*grads, sink_gradient(sink, softmax_lse, grads[3]))


@_documented
def backward_workspace(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       seqused_k=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, deterministic=False, max_workspace_bytes=None,
                       out_dtype=None, learnable_sink=None,
                       backends=("reference", "ck", "triton")) -> dict[str, ChunkPlan | str]:
    """The backward workspace each backend would allocate for this call. Plans depend only on shapes,
    so q/k/v may be `device="meta"` tensors of any size.

    Args:
        q, k, v, varlen arguments, options: as for `flash_attn_bwd`.
        backends: the backend names to plan for (one name: that backend).{common}

    Returns:
        backend name -> a `ChunkPlan` (buffers and bytes per chunk, number of chunks, peak;
        `.describe()` prints it), or a string saying why there is none.

    Raises:
        ArgumentError: a bad argument.
    """
    options = AttentionOptions(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes, dropout_p=dropout_p, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, deterministic=deterministic,
        max_workspace_bytes=max_workspace_bytes, out_dtype=out_dtype, learnable_sink=learnable_sink)
    problem = describe_call(q, k, v, options)
    params = AttentionParams(q, k, v, *sequence_tensors(options))
    cap = workspace_cap(max_workspace_bytes)
    report: dict[str, ChunkPlan | str] = {}
    for name in (backends,) if isinstance(backends, str) else backends:
        try:     # a backend whose module failed to import refuses to plan with its reason (registry.py)
            report[name] = plan_chunks(problem, backend_class(name)(), cap, params)
        except (WorkspaceError, RuntimeError, ImportError) as error:
            report[name] = f"{type(error).__name__}: {error}"
    return report


# ---- flash-attn 2.x functions -------------------------------------------------------------------

def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, backend, varlen=None, learnable_sink=None):
    result = flash_attn_fwd(q, k, v, **(varlen or {}), dropout_p=dropout_p, softmax_scale=softmax_scale,
                            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            deterministic=deterministic, return_attn_probs=return_attn_probs,
                            learnable_sink=learnable_sink, backend=backend)
    if return_attn_probs:
        out, lse, _, probs = result
        return out, lse, probs
    return result[0]


_RETURNS = """
    Returns:
        out, q's rows and heads with v's head dim d_v; with `return_attn_probs` (testing only)
        `(out, softmax_lse, probs)`: lse fp32 {lse}, probs {probs} softmax probabilities with dropped entries negated.

    Raises:
        ArgumentError: a bad argument (the message names it). NoBackendError: no backend can run the call."""
_BATCH_RETURNS = _RETURNS.format(lse="(b, h, s_q)", probs="(b, h, s_q, s_k)")
_VARLEN_RETURNS = _RETURNS.format(lse="(h, total_q)",
                                  probs="(b, h, min(max_seqlen_q, total_q), min(max_seqlen_k, total_k))")


def _flash_documented(returns: str):
    def document(fn):
        fn.__doc__ = fn.__doc__.format(common=_COMMON_ARGS + "\n        return_attn_probs: see Returns.",
                                       returns=returns)
        return fn
    return document


@_flash_documented(_BATCH_RETURNS)
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, learnable_sink=None,
                    backend=None):
    """Exact attention softmax(scale * q k^T) v, differentiable in q, k and v.

    Args:
        q: (b, s_q, h, d); fp16, bf16, fp32 or fp64.
        k: (b, s_k, h_k, d), q's dtype and device.
        v: (b, s_k, h_k, d_v), d_v <= 256 (out has it; d_v may differ from d), q's dtype and device.{common}
{returns}
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, backend, learnable_sink=learnable_sink)


@_flash_documented(_BATCH_RETURNS)
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              learnable_sink=None, backend=None):
    """`flash_attn_func` on q, k, v packed in one tensor (self-attention, h_k = h).

    Args:
        qkv: (b, s, 3, h, d); its gradient flows into the packed tensor. One tensor holds q, k and v, so
            d_v = d (pass q, k, v to `flash_attn_func` for a value head dim of its own).{common}
{returns}
    """
    check_tensor("qkv", qkv, 5)
    check_packed_slots("qkv", qkv, 2, 3)
    check_real_devices((("qkv", qkv),))
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs, backend,
                      learnable_sink=learnable_sink)


@_flash_documented(_BATCH_RETURNS)
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None, backend=None):
    """`flash_attn_func` with k and v packed in one tensor.

    Args:
        q: (b, s_q, h, d).
        kv: (b, s_k, 2, h_k, d), q's dtype and device: k and v in one tensor, so d_v = d.{common}
{returns}
    """
    check_tensor("kv", kv, 5)
    check_packed_slots("kv", kv, 2, 2)
    check_real_devices((("kv", kv),))
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, backend, learnable_sink=learnable_sink)


@_flash_documented(_VARLEN_RETURNS)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, seqused_k=None,
                           learnable_sink=None, backend=None):
    """`flash_attn_func` on sequences of different lengths packed along the first dim.

    Args:
        q: (total_q, h, d). k: (total_k, h_k, d). v: (total_k, h_k, d_v), its own head dim (out has it).
        cu_seqlens_q, cu_seqlens_k: int32 (b + 1,) offsets of each sequence's rows, from 0.
        max_seqlen_q, max_seqlen_k: the longest query / key length.
        block_table: must be None (paged KV caches are not supported).
        seqused_k: int32 (b,) on q's device, or None: sequence i attends only its first `seqused_k[i]` keys
            (e.g. a KV cache slot longer than its sequence); its other keys get zero gradients.{common}
{returns}
    """
    if block_table is not None:
        raise ArgumentError("block_table: paged KV caches are not supported by flash_attn_ck (pass None)")
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
    if cu_seqlens_q is None or cu_seqlens_k is None:      # else the call would be read as a dense one
        check_varlen_arguments(varlen)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, backend, varlen, learnable_sink)


@_flash_documented(_VARLEN_RETURNS)
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None, backend=None):
    """`flash_attn_varlen_func` on q, k, v packed in one tensor (self-attention, h_k = h).

    Args:
        qkv: (total, 3, h, d): one tensor, so d_v = d.
        cu_seqlens: int32 (b + 1,) offsets, for queries and keys. max_seqlen: the longest sequence.{common}
{returns}
    """
    check_tensor("qkv", qkv, 4)
    check_packed_slots("qkv", qkv, 1, 3)
    check_real_devices((("qkv", qkv),))
    try:
        return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      deterministic, return_attn_probs, learnable_sink=learnable_sink,
                                  backend=backend)
    except ArgumentError as error:
        raise ArgumentError(_one_cu_seqlens_and_max_seqlen(str(error))) from None


def _one_cu_seqlens_and_max_seqlen(message: str) -> str:
    """A varlen message in the names of a function with one cu_seqlens and one max_seqlen: `cu_seqlens_q`/`_k` become
    `cu_seqlens` (likewise max_seqlen), each named once where a list named both ("cu_seqlens_q, cu_seqlens_k and
    max_seqlen_q" -> "cu_seqlens and max_seqlen")."""
    message = re.sub(r"\b(cu_seqlens|max_seqlen)_[qk]\b", r"\1", message)
    while True:
        shorter = re.sub(r"\b(cu_seqlens|max_seqlen)(?:, | and )\1\b", r"\1", message)
        shorter = re.sub(r"\bcu_seqlens, max_seqlen\b(?= \(| and)", "cu_seqlens and max_seqlen", shorter)
        if shorter == message:
            return message
        message = shorter


@_flash_documented(_VARLEN_RETURNS)
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    learnable_sink=None, backend=None):
    """`flash_attn_varlen_func` with k and v packed in one tensor.

    Args:
        q: (total_q, h, d). kv: (total_k, 2, h_k, d): one tensor, so d_v = d.
        cu_seqlens_q, cu_seqlens_k: int32 (b + 1,) offsets. max_seqlen_q, max_seqlen_k: the longest lengths.{common}
{returns}
    """
    check_tensor("kv", kv, 4)
    check_packed_slots("kv", kv, 1, 2)
    check_real_devices((("kv", kv),))
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, learnable_sink=learnable_sink,
                                  backend=backend)
