"""torch.library.opcheck of the flash_attn_ck ops on random calls of several layouts (views, varlen, packed, head
dims the op pads), for any backend and device: the CPU tests (tests/api/test_ops.py) and the GPU ones
(tests/gpu/test_ops_gpu.py)."""

from __future__ import annotations

import torch
from torch.library import opcheck

import flash_attn_ck  # noqa: F401 (registers the ops)

ops = torch.ops.flash_attn_ck

# name -> (batch or varlen lengths, heads q/k, head dim, views, options). Head dims 12, 13, 20 are
# padded to a multiple of 8 by the op (out is a view of the padded buffer); packed layouts pass
# non-contiguous views of one tensor; "bhsd" passes dense but permuted views of (b, h, s, d) tensors,
# whose strides the op's empty_like gradients keep.
LAYOUTS = {
    "batch_bhsd": dict(seqlens=(5, 7), heads=(3, 3), d=16, views="bhsd"),
    "batch_gqa_d13": dict(seqlens=(4, 9), heads=(4, 2), d=13, causal=True, alibi=True),
    "qkvpacked_d12": dict(seqlens=(6, 6), heads=(2, 2), d=12, views="qkv", window=(2, 1)),
    "varlen_mqa": dict(seqlens=([3, 0, 5], [4, 2, 5]), heads=(4, 1), d=16, deterministic=True),
    "varlen_kvpacked_d20": dict(seqlens=([2, 6], [5, 3]), heads=(2, 2), d=20, views="kv", softcap=5.0),
    "varlen_seqused_k": dict(seqlens=([3, 0, 5], [4, 2, 5]), heads=(4, 2), d=16, causal=True, seqused_k=[2, 2, 0]),
}
BATCH = 2


def make_call(layout: str, dtype, device, dropout_p: float, return_probs: bool, backend: str,
              requires_grad: bool = True) -> dict:
    """Random q/k/v (strided views where the layout says so) and every op option."""
    spec = LAYOUTS[layout]
    (s_q, s_k), (h, h_k), d = spec["seqlens"], spec["heads"], spec["d"]
    varlen = isinstance(s_q, list)
    rows_q, rows_k = ((sum(s_q),), (sum(s_k),)) if varlen else ((BATCH, s_q), (BATCH, s_k))

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)

    if spec.get("views") == "bhsd":
        q, k, v = (randn(BATCH, heads, s, d).transpose(1, 2) for s, heads in ((s_q, h), (s_k, h_k), (s_k, h_k)))
    elif spec.get("views") == "qkv":
        qkv = randn(*rows_q, 3, h, d)
        q, k, v = qkv.unbind(-3)
    elif spec.get("views") == "kv":
        q, kv = randn(*rows_q, h, d), randn(*rows_k, 2, h_k, d)
        k, v = kv.unbind(-3)
    else:
        q, k, v = randn(*rows_q, h, d), randn(*rows_k, h_k, d), randn(*rows_k, h_k, d)

    def cu(lengths):
        return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)

    window = spec.get("window", (-1, -1))
    return dict(
        q=q, k=k, v=v,
        cu_seqlens_q=cu(s_q) if varlen else None, cu_seqlens_k=cu(s_k) if varlen else None,
        seqused_k=torch.tensor(spec["seqused_k"], dtype=torch.int32, device=device) if "seqused_k" in spec else None,
        max_seqlen_q=max(s_q) if varlen else 0, max_seqlen_k=max(s_k) if varlen else 0,
        alibi_slopes=torch.rand(h, device=device) if spec.get("alibi") else None,
        dropout_p=dropout_p, softmax_scale=d ** -0.5, causal=spec.get("causal", False),
        window_left=window[0], window_right=window[1], softcap=spec.get("softcap", 0.0),
        deterministic=spec.get("deterministic", False), return_probs=return_probs, backend=backend)


_FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "alibi_slopes",
             "dropout_p", "softmax_scale", "causal", "window_left", "window_right", "softcap", "deterministic",
             "return_probs", "backend")
BWD_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "alibi_slopes",
                "dropout_p", "softmax_scale", "causal", "window_left", "window_right", "softcap", "deterministic")


def fwd_args(call: dict) -> tuple:
    return tuple(call[name] for name in _FWD_ARGS)


def bwd_inputs(call: dict):
    """A real forward's out/lse/rng_state and a random dout, for opchecking the backward ops."""
    with torch.no_grad():
        out, lse, rng_state, _ = ops.fwd(*fwd_args(call))
    dout = torch.randn_like(call["q"], memory_format=torch.contiguous_format)
    options = tuple(call[name] for name in BWD_OPTIONS)
    return dout, out, lse, options, rng_state


def check_op(op, args):
    """opcheck with every sub-test; a failure shows the sub-test and its message."""
    results = opcheck(op, args, raise_exception=False)
    failures = {name: repr(result) for name, result in results.items() if result != "SUCCESS"}
    assert not failures, failures
    assert len(results) >= 4, results       # schema, autograd registration, fake, AOT dispatch


def run_fwd(layout, dtype, device, dropout_p, return_probs, backend):
    torch.manual_seed(0)
    call = make_call(layout, dtype, device, dropout_p, return_probs, backend, requires_grad=False)
    check_op(ops.fwd.default, fwd_args(call))


def run_fwd_out(layout, dtype, device, dropout_p, backend):
    torch.manual_seed(0)
    call = make_call(layout, dtype, device, dropout_p, False, backend, requires_grad=False)
    # laid out like q (strided views where the layout has them), garbage-filled: a missing write shows
    out = torch.randn_like(call["q"])
    q, k, v, *options = fwd_args(call)
    check_op(ops.fwd_out.default, (q, k, v, out, *options))


def run_bwd(layout, dtype, device, dropout_p, backend):
    torch.manual_seed(0)
    call = make_call(layout, dtype, device, dropout_p, False, backend, requires_grad=False)
    q, k, v = call["q"], call["k"], call["v"]
    dout, out, lse, options, rng_state = bwd_inputs(call)
    check_op(ops.bwd.default, (dout, q, k, v, out, lse, *options, rng_state, backend))


def run_bwd_out(layout, dtype, device, dropout_p, backend):
    torch.manual_seed(0)
    call = make_call(layout, dtype, device, dropout_p, False, backend, requires_grad=False)
    q, k, v = call["q"], call["k"], call["v"]
    dout, out, lse, options, rng_state = bwd_inputs(call)
    # Preallocated gradients laid out like their inputs (views of one packed buffer when packed),
    # filled with garbage so a missing write shows up as a value mismatch.
    grads = [torch.randn_like(t) for t in (q, k, v)]
    if LAYOUTS[layout].get("views") == "qkv":
        grads = list(torch.randn(*q.shape[:-2], 3, *q.shape[-2:], dtype=dtype, device=device).unbind(-3))
    check_op(ops.bwd_out.default, (dout, q, k, v, out, lse, *grads, *options, rng_state, backend))


DROPOUT = [0.0, 0.25]
