"""An independent naive attention (full s_q x s_k matrices, autograd for gradients) and the
flash-attention correctness rule (docs/semantics.md §Correctness). Shares nothing with the package but the dropout
keep pattern, which is a definition, not an implementation detail."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flash_attn_ck.core.dropout import keep_mask


@dataclass
class Config:
    batch: int = 2
    seqlen_q: int = 33
    seqlen_k: int = 47
    heads_q: int = 4
    heads_k: int = 2
    head_dim: int = 40
    head_dim_v: int | None = None       # v's head dim (out, dout, dv); None: head_dim
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    diagonal: int | None = None     # naive_attention's: None is flash-attn's bottom-right alignment
    alibi: bool = False
    softcap: float = 0.0
    dropout_p: float = 0.0
    deterministic: bool = False
    dtype: torch.dtype = torch.bfloat16
    seqlens: list[tuple[int, int]] | None = field(default=None)  # varlen: (s_q, s_k) per sequence
    sink_dtype: torch.dtype | None = None      # a learnable sink of this dtype (make_sink), None: no sink

    @property
    def value_head_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


def naive_attention(q, k, v, *, causal=False, window=(-1, -1), diagonal=None, softcap=0.0, alibi_slopes=None,
                    dropout_p=0.0, rng_state=None, batch_index=0, heads=None, max_seqlen_q=None, max_seqlen_k=None,
                    softmax_scale=None, sink=None, compute_dtype=torch.float64):
    """One sequence: q (s_q, h, d), k (s_k, h_k, d), v (s_k, h_k, d_v) -> out (s_q, h, d_v), lse (h, s_q); the
    default scale is 1 / sqrt(d), q's head dim.

    `sink`: None, or (h,) logits, one more entry of every row's softmax, with no value (a learnable sink).

    Row i keeps keys j with i + c - left <= j <= i + c + right, -1 unbounded, causal: right = 0, where
    c = `diagonal` (row 0's diagonal key; 0 is top-left alignment), by default s_k - s_q: flash-attn's
    bottom-right interval exactly (no normalisation; docs/semantics.md §Masks). ALiBi's distance is always
    taken from the bottom-right diagonal."""
    s_q, h, d = q.shape
    s_k, h_k = k.shape[0], k.shape[1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    qc, kc, vc = (t.to(compute_dtype).transpose(0, 1) for t in (q, k, v))
    kc = kc.repeat_interleave(h // h_k, 0)
    vc = vc.repeat_interleave(h // h_k, 0)
    scores = qc @ kc.transpose(1, 2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(s_q)[:, None]
    j = torch.arange(s_k)[None, :]
    diag = i + s_k - s_q
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(compute_dtype)[:, None, None] * (diag - j).abs()
    left, right = window
    if causal:
        right = 0
    kept_diag = diag if diagonal is None else i + diagonal
    allowed = torch.ones(s_q, s_k, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= kept_diag - left
    if right >= 0:
        allowed &= j <= kept_diag + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        sink_column = sink.to(compute_dtype)[:, None, None].expand(h, s_q, 1)
        lse = torch.logsumexp(torch.cat((scores, sink_column), dim=-1), dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    if dropout_p > 0:
        keep = keep_mask(tuple(rng_state.tolist()), dropout_p, batch_index, heads or h, torch.arange(h),
                         torch.arange(s_q), torch.arange(s_k))
        probs = probs * keep / (1 - dropout_p)
    out = (probs @ vc).transpose(0, 1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return out, lse


def assert_close_2x(name: str, ours: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor, factor: float = 2.0,
                    unit: float = 1.0, roundings: int = 1):
    """The 2x rule: max|ours - ref| <= max(factor * max|pt - ref|, floor) + atol, atol = 2 * rounding of ref in
    ours' dtype. `floor`: `roundings` half-units of ours' dtype at max|ref|, the rounding ours cannot avoid where
    the same-precision reference happens to round luckily (a gradient summed from `roundings - 1` per-head
    gradients stored in the input dtype, the CK contract's expanded dK/dV, then rounded once more). The absolute
    1e-6: the fp32 accumulation's rounding where pt and atol are exactly 0 (rows that attend one key:
    docs/semantics.md §Correctness: the 2x rule)."""
    ref = ref.double()
    assert not torch.isnan(ours).any(), f"{name}: NaN in result"
    rounded = ref.to(ours.dtype)
    atol = 2 * ((rounded + 0.3 - 0.3) - rounded).abs().max().item() if ref.numel() else 0.0
    err = (ours.double() - ref).abs().max().item() if ref.numel() else 0.0
    pt_err = (pt.double() - ref).abs().max().item() if ref.numel() else 0.0
    if pt_err == 0.0:
        # Degenerate inputs (e.g. one key per row with dropout) where autograd in the input dtype is
        # exact but a flash kernel is not: it computes D = rowsum(dO * O) from O rounded to the
        # input dtype. Allow one rounding unit of the input dtype at the scale `unit` of a gradient
        # entry (|dO| |v| |k| for dq), which is what that rounding propagates into.
        atol = max(atol, torch.finfo(ours.dtype).eps * unit)
    floor = roundings * torch.finfo(ours.dtype).eps / 2 * ref.abs().max().item() if ref.numel() else 0.0
    assert err <= max(factor * pt_err, floor) + atol + 1e-6, \
        f"{name}: max error {err:.3e} > max({factor} x {pt_err:.3e} (same-precision reference), floor " \
        f"{floor:.3e}) + atol {atol:.3e}"
