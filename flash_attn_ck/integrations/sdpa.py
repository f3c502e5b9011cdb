"""flash_attn_ck as a provider of SDPA's flash-attention kernels (torch >= 2.11's provider registry).

Importing this module registers "FLASH_ATTN_CK" with `torch.nn.attention.register_flash_attention_impl`;
nothing is overridden until the user opts in:

    import flash_attn_ck.integrations.sdpa
    torch.nn.attention.activate_flash_attention_impl("FLASH_ATTN_CK")   # ... restore_flash_attention_impl()

Activation overrides, on the CUDA dispatch key (which ROCm builds of torch use for HIP devices), the aten
ops torch's own `torch/nn/attention/_fa4.py` overrides: `_scaled_dot_product_flash_attention` and its
backward (what `F.scaled_dot_product_attention` calls when it picks the flash backend),
`_flash_attention_forward` / `_flash_attention_backward` (the FA2-style ops, dense or varlen through
`cum_seq_q/k`, used by `torch.nn.attention.varlen`) and, where torch has it (2.13+),
`_flash_attention_forward_no_dropout_inplace`. torch still decides *whether* SDPA takes the flash path
(dtype, head dim, masks: its `_fused_sdp_choice`); these kernels decide only *how* it runs.

Semantics (docs/integrations.md):
- Layout: SDPA's (b, h, s, d) as transposed views of our (b, s, h, d); outputs are allocated with the
  shapes, dtypes and strides of torch's meta functions (`out` like `query`, lse (b, h, s_q) fp32,
  varlen (h, total_q)), and our forward writes `out` in place (`flash_attn_fwd(out=)`, no copy), the
  caller's own `out` for `_flash_attention_forward_no_dropout_inplace`. Our forward runs under no_grad:
  torch's autograd records the aten op, so a graph of ours inside it would serve nobody.
- `is_causal` of the SDPA ops is top-left aligned (row i keeps keys j <= i, as SDPA's math path), exactly:
  s_q >= s_k is the bottom-right window (-1, s_q - s_k); s_q < s_k is causal on the first s_q keys
  (no row sees the others; their dK/dV are 0). The FA2-style `_flash_attention_*` ops keep FA2's
  bottom-right causal and windows, which is what flash_attn_ck implements natively.
- Scale: SDPA accepts any finite `scale`; our kernels take a positive one. `scale * q.k = |scale| * (sign q).k`
  exactly, so a negative scale runs on -q with |scale| and 0 on a zero query with scale 1 (uniform attention),
  and dq is multiplied by the sign: every finite scale SDPA accepts runs on our kernels (`positive_scale`).
- GQA: K/V arrive with h_k heads (SDPA's `enable_gqa`) and run as our MQA/GQA.
- Value head dim: V's E_v may differ from Q's and K's E (SDPA takes it): out (and dV) get E_v, and the kernels
  run it as flash_attn_ck's d_v. torch's own flash selection sends such calls to its math path (its flash
  check wants one head dim) and its meta functions declare out like query, so E_v != E reaches these kernels
  through the aten flash ops called directly, eagerly.
- Dropout: our forward draws `rng_state = [seed, offset]` (int64) from torch's generator. It is returned
  in the slots torch's meta functions declare: `philox_seed` = the same 16 bytes as uint64 (2,) and
  `philox_offset` = uint64 0 on CUDA builds (FA2's layout since torch 2.5); on ROCm builds int64 scalars
  seed and offset. The backward rebuilds `[seed, offset]` from what torch hands back, so it drops exactly
  the forward's elements (torch passes the forward's outputs unchanged to the backward op).
- Dropout while torch's own context-parallel ring is on (`torch_ring_active`): refused, naming
  `torch_cp.install_torch_cp_handlers()` (torch's ring hands every backward step the last step's rng state).
- `seqused_k` (varlen): sequence i attends its first `seqused_k[i]` keys, as `flash_attn_varlen_func`.
  torch's `_flash_attention_backward` has no such argument (torch's `varlen_attn` calls it inference-only), so
  `_flash_attention_forward` refuses it while autograd records the call (grad mode on and q/k/v requiring
  grad); under torch.compile the kernel cannot see that, and the gradients would ignore it, as torch's own.
- Refused with a RuntimeError that names the reason (never a silent fallback): `return_debug_mask`,
  float64 (torch's meta declares an fp32 lse), `alibi_slopes` (torch's `_flash_attention_backward` has no
  slopes argument, so its gradients would be wrong), `seqused_k` with gradients (above), `block_table`,
  `num_splits > 1`. Errors of our own validation (`ArgumentError`, `NoBackendError`) propagate unchanged.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn.attention as _attention
from torch.library import Library

from ..api import flash_attn_bwd, flash_attn_fwd
from ..core.errors import ArgumentError

PROVIDER = "FLASH_ATTN_CK"

class UnsupportedCall(RuntimeError):
    """A call the provider cannot run as asked (the message says why)."""


def _refuse(reason: str) -> None:
    raise UnsupportedCall(f"flash_attn_ck SDPA provider: {reason}")


def _check_dtype(query: torch.Tensor, allow_fp64: bool = False) -> None:
    allowed = (torch.float16, torch.bfloat16, torch.float32) + ((torch.float64,) if allow_fp64 else ())
    if query.dtype not in allowed:
        _refuse(f"query dtype {query.dtype} is not supported here (torch's meta function declares an fp32 "
                "logsumexp; use fp16/bf16, or fp32 with the reference backend)")


_TORCH_CP = "torch.distributed.tensor.experimental._context_parallel._attention"


def torch_ring_active() -> bool:
    """Whether torch's CP dispatcher is on with torch's own ring for the flash op (not our installed one)."""
    module = sys.modules.get(_TORCH_CP)
    if module is None:         # never imported: torch's CP was never turned on
        return False
    from torch.distributed.tensor import DTensor
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    return DTensor._op_dispatcher._custom_op_handlers.get(flash) is module._sdpa_handler


def _check_dropout_outside_torch_ring(dropout_p: float) -> None:
    if dropout_p and torch_ring_active():
        _refuse("dropout under torch's context parallelism: torch's ring gives every backward step the last forward "
                "step's rng state, so the gradients would not match the forward's dropout. Call "
                "flash_attn_ck.integrations.torch_cp.install_torch_cp_handlers() first (our ring keeps a state per "
                "step), or use dropout_p=0")


def sdpa_causal(is_causal: bool, seqlen_q: int, seqlen_k: int) -> tuple[int, bool, tuple[int, int]]:
    """SDPA's causal mask (top-left: row i keeps keys j <= i) as flash-attn arguments, exactly:
    `(keys, causal, window)` = the number of leading keys the call reads, and the bottom-right mask on them."""
    if not is_causal:
        return seqlen_k, False, (-1, -1)
    if seqlen_q == seqlen_k:
        return seqlen_k, True, (-1, -1)
    if seqlen_q > seqlen_k:              # j <= i  <=>  j <= i + (s_k - s_q) + (s_q - s_k)
        return seqlen_k, False, (-1, seqlen_q - seqlen_k)
    return seqlen_q, True, (-1, -1)      # keys j >= s_q are seen by no row: square causal on the first s_q


def _rocm_rng_layout() -> bool:
    """Whether torch's meta functions declare ROCm's (int64 seed, int64 offset) scalars (their own test)."""
    return bool(torch.version.hip) and torch.cuda.is_available()


def rng_outputs(rng_state: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Our `[seed, offset]` (int64 (2,), None without dropout) as the `(philox_seed, philox_offset)` outputs
    torch's meta functions declare: CUDA builds uint64 (2,) and uint64 (); ROCm builds int64 () twice."""
    if rng_state is None:
        rng_state = torch.zeros(2, dtype=torch.int64, device=device)
    if _rocm_rng_layout():
        return rng_state[0].clone(), rng_state[1].clone()
    return rng_state.view(torch.uint64), torch.zeros((), dtype=torch.uint64, device=device)


def rng_input(dropout_p: float, philox_seed: torch.Tensor, philox_offset: torch.Tensor) -> torch.Tensor | None:
    """The inverse of `rng_outputs`: what the backward op receives -> our `[seed, offset]`."""
    if dropout_p == 0:
        return None
    if philox_seed.numel() == 2:
        return philox_seed.view(torch.int64)
    return torch.stack([philox_seed.reshape(()), philox_offset.reshape(())]).to(torch.int64)


def positive_scale(query: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, float | None, float]:
    """SDPA accepts any finite scale, our kernels a positive one: `scale * q.k = |scale| * (sign * q).k` exactly
    (negation and zeroing are exact), so a negative scale runs on -q with |scale| and a zero scale on zeros with
    scale 1 (uniform attention). Returns (the query to run, the scale to run, sign); dq = sign * the run's dq. A
    scale that is not finite is an ArgumentError naming SDPA's `scale`."""
    if scale is not None and not math.isfinite(scale):
        raise ArgumentError(f"scale: expected a finite real number, got {scale}")
    if scale is None or scale > 0:       # None: 1 / sqrt(d)
        return query, scale, 1.0
    sign = -1.0 if scale < 0 else 0.0
    return query * sign, (-scale if scale < 0 else 1.0), sign


def _bshd(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.transpose(1, 2) for t in tensors)


def out_like_query(query: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The forward's out: like `query` (torch's meta functions declare it so), with `value`'s head dim E_v when it
    differs from query's E (query's dimension order, new strides)."""
    if value.shape[-1] == query.shape[-1]:
        return torch.empty_like(query)
    strides = query.stride()
    order = sorted(range(query.dim()), key=lambda dim: -strides[dim])       # outermost dimension first
    return torch.empty_permuted((*query.shape[:-1], value.shape[-1]), order, dtype=query.dtype, device=query.device)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass(frozen=True)
class Adapters:
    """The aten kernels, running flash_attn_ck with `backend` (None: automatic; "reference" for CPU tests).
    Methods take the aten schemas' arguments; each returns what torch's meta function declares."""

    backend: str | None = None

    # ---- the shared (b, h, s, d) core of the SDPA ops -------------------------------------------------
    def sdpa_forward(self, query, key, value, dropout_p, is_causal, scale, out):
        """Writes `out` (b, h, s_q, E_v); returns lse (b, h, s_q) and rng_state (None without dropout)."""
        q, k, v = _bshd(query, key, value)
        q, scale, _ = positive_scale(q, scale)
        keys, causal, window = sdpa_causal(is_causal, q.shape[1], k.shape[1])
        with torch.no_grad():
            _, lse, rng_state = flash_attn_fwd(q, k[:, :keys], v[:, :keys], dropout_p=dropout_p, softmax_scale=scale,
                                               causal=causal, window_size=window, out=out.transpose(1, 2),
                                               backend=self.backend)
        return lse, rng_state

    def sdpa_backward(self, grad_out, query, key, value, out, lse, dropout_p, is_causal, scale, rng_state,
                      grads):
        """Writes dq, dk, dv (`grads`, (b, h, s, d) like the inputs)."""
        q, k, v, o, do = _bshd(query, key, value, out, _unit_last_stride(grad_out))
        q, scale, sign = positive_scale(q, scale)
        dq, dk, dv = _bshd(*grads)
        keys, causal, window = sdpa_causal(is_causal, q.shape[1], k.shape[1])
        if keys < k.shape[1]:
            dk[:, keys:].zero_()
            dv[:, keys:].zero_()
        flash_attn_bwd(_unit_last_stride(do), q, k[:, :keys], v[:, :keys], _unit_last_stride(o), lse.contiguous(),
                       dq, dk[:, :keys], dv[:, :keys], dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                       window_size=window, deterministic=torch.are_deterministic_algorithms_enabled(),
                       rng_state=rng_state, backend=self.backend)
        if sign != 1.0:
            dq.mul_(sign)

    # ---- aten::_scaled_dot_product_flash_attention (+ backward) ---------------------------------------
    def sdpa_flash(self, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        _check_dtype(query)
        if return_debug_mask:
            _refuse("return_debug_mask=True (FA2's debug mask layout) is not supported")
        _check_dropout_outside_torch_ring(dropout_p)
        out = out_like_query(query, value)
        lse, rng_state = self.sdpa_forward(query, key, value, dropout_p, is_causal, scale, out)
        seed, offset = rng_outputs(rng_state, query.device)
        debug_mask = query.new_empty(0)
        return out, lse, None, None, query.size(2), key.size(2), seed, offset, debug_mask

    def sdpa_flash_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                            dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        # max_q/max_k are ignored: torch's context-parallel ring passes its last step's.
        _check_dtype(query)
        _check_dropout_outside_torch_ring(dropout_p)
        grads = (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value))
        self.sdpa_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale,
                           rng_input(dropout_p, philox_seed, philox_offset), grads)
        return grads

    # ---- aten::_scaled_dot_product_flash_attention_for_cpu (+ backward): CPU test registration only ----
    def sdpa_flash_cpu(self, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        """What F.scaled_dot_product_attention calls on CPU when it picks flash (torch never passes dropout
        here: its CPU flash path refuses dropout). lse is laid out as torch's meta declares: (b, s, h) storage."""
        _check_dtype(query, allow_fp64=True)
        if attn_mask is not None:
            _refuse("attn_mask is not supported (SDPA's flash path takes is_causal only)")
        out = out_like_query(query, value)
        lse, _ = self.sdpa_forward(query, key, value, dropout_p, is_causal, scale, out)
        lse_out = lse.new_empty((lse.shape[0], lse.shape[2], lse.shape[1])).transpose(1, 2)
        return out, lse_out.copy_(lse)

    def sdpa_flash_cpu_backward(self, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                                attn_mask=None, scale=None):
        _check_dtype(query, allow_fp64=True)
        if attn_mask is not None:
            _refuse("attn_mask is not supported (SDPA's flash path takes is_causal only)")
        if dropout_p:
            _refuse("dropout on the CPU flash op: its schema carries no rng state")
        grads = tuple(torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device)
                      for t in (query, key, value))     # torch's meta: (b, s, h, d) storage
        self.sdpa_backward(grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale, None, grads)
        return grads

    # ---- aten::_flash_attention_forward / _backward: FA2's ops, (b, s, h, d) or varlen (total, h, d) -----
    def _fa2_forward(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                     return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
                     block_table, num_splits, out):
        _check_dtype(query)
        for reason, asked in (("return_debug_mask=True", return_debug_mask),
                              ("alibi_slopes (torch's _flash_attention_backward has no slopes argument, so its "
                               "gradients would ignore them)", alibi_slopes is not None),
                              ("block_table (paged KV)", block_table is not None),
                              ("num_splits > 1", num_splits is not None and num_splits > 1)):
            if asked:
                _refuse(f"{reason} is not supported")
        varlen = {} if cum_seq_q is None else dict(cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k,
                                                     max_seqlen_q=max_q, max_seqlen_k=max_k)
        window = (-1 if window_size_left is None else window_size_left,
                  -1 if window_size_right is None else window_size_right)
        out = out_like_query(query, value) if out is None else out     # like the given query, as torch's meta
        query, scale, _ = positive_scale(query, scale)
        with torch.no_grad():
            _, lse, rng_state = flash_attn_fwd(query, key, value, **varlen, seqused_k=seqused_k, dropout_p=dropout_p,
                                               softmax_scale=scale, causal=is_causal, window_size=window, out=out,
                                               backend=self.backend)
        return out, lse, rng_state

    def fa2_forward(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                    return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                    alibi_slopes=None, block_table=None, num_splits=None):
        if seqused_k is not None and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                                                  or value.requires_grad):
            _refuse("seqused_k with gradients: torch's _flash_attention_backward has no seqused_k argument, so its "
                    "gradients would ignore it (torch's varlen_attn: inference-only); run under torch.no_grad(), or "
                    "use flash_attn_ck.flash_attn_varlen_func(seqused_k=), whose backward takes it")
        out, lse, rng_state = self._fa2_forward(
            query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, scale,
            window_size_left, window_size_right, seqused_k, alibi_slopes, block_table, num_splits, None)
        seed, offset = rng_outputs(rng_state, query.device)
        return out, lse, seed, offset, query.new_empty(0)

    def fa2_forward_no_dropout_inplace(self, out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                       is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                                       window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
                                       num_splits=None):
        if dropout_p:
            _refuse("_flash_attention_forward_no_dropout_inplace was given dropout_p > 0")
        return self._fa2_forward(
            query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, is_causal, return_debug_mask, scale,
            window_size_left, window_size_right, seqused_k, alibi_slopes, block_table, num_splits, out)[1]

    def fa2_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                     dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                     window_size_right=None):
        _check_dtype(query)
        varlen = {} if cum_seq_q is None else dict(cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k,
                                                     max_seqlen_q=max_q, max_seqlen_k=max_k)
        window = (-1 if window_size_left is None else window_size_left,
                  -1 if window_size_right is None else window_size_right)
        grads = (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value))
        query, scale, sign = positive_scale(query, scale)
        flash_attn_bwd(_unit_last_stride(grad_out), query, key, value, _unit_last_stride(out), logsumexp.contiguous(),
                       *grads, **varlen, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal,
                       window_size=window, deterministic=torch.are_deterministic_algorithms_enabled(),
                       rng_state=rng_input(dropout_p, rng_state, unused), backend=self.backend)
        if sign != 1.0:
            grads[0].mul_(sign)
        return grads


# aten op -> Adapters method: the ops torch's _fa4.py overrides, then (CPU test registration) the CPU flash pair.
_OPS = {
    "_scaled_dot_product_flash_attention": "sdpa_flash",
    "_scaled_dot_product_flash_attention_backward": "sdpa_flash_backward",
    "_flash_attention_forward": "fa2_forward",
    "_flash_attention_backward": "fa2_backward",
    "_flash_attention_forward_no_dropout_inplace": "fa2_forward_no_dropout_inplace",   # torch 2.13+
}
_CPU_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": "sdpa_flash_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "sdpa_flash_cpu_backward",
}


@dataclass
class Handle:
    """What `register` returns (torch's registry keeps it while active): `remove()` drops the kernels."""

    library: Library | None
    ops: tuple[str, ...]

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()     # deregister now, not whenever the Library is collected
            self.library = None


@functools.cache
def _warn_nothing_overridden() -> None:
    """Once per process: activated where it overrides nothing that runs."""
    warnings.warn(f"{PROVIDER}: activated on a machine without a CUDA or ROCm device: it overrides SDPA's flash ops "
                  "on GPU tensors only, so SDPA here keeps running torch's own kernels", RuntimeWarning, stacklevel=4)


def register(device_type: str = "cuda") -> Handle:
    """torch's `register_fn`: override the flash ops on `device_type`'s dispatch key.

    "cuda" (the provider; HIP devices on ROCm builds): the automatic backend (Triton on NVIDIA, CK on AMD).
    "cpu" (tests only): the reference backend, plus `_scaled_dot_product_flash_attention_for_cpu` and its
    backward, the ops F.scaled_dot_product_attention calls on CPU."""
    keys = {"cuda": "CUDA", "cpu": "CPU"}
    if device_type not in keys:
        raise ValueError(f"device_type must be one of {sorted(keys)}, got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        _warn_nothing_overridden()
    adapters = Adapters(backend="reference" if device_type == "cpu" else None)
    ops = {**_OPS, **(_CPU_OPS if device_type == "cpu" else {})}
    library = Library("aten", "IMPL", keys[device_type])
    registered = []
    for op, method in ops.items():
        if hasattr(torch.ops.aten, op):
            library.impl(op, getattr(adapters, method), keys[device_type])
            registered.append(op)
    return Handle(library, tuple(registered))


_attention.register_flash_attention_impl(PROVIDER, register_fn=register)
