"""Stage 1 of every call: validate q/k/v against the options, and describe the call as a problem.

`describe_call` runs every check that does not depend on the direction (forward or backward) and
was not already run when the options were built, canonicalises causal/window into a `MaskInfo`,
and returns an `AttentionProblem`. q and k share a head dim d; v has its own, d_v (out, dout and dv have
v's). `kernel_params` pads each head dim to a multiple of 8 for the kernels (zeros, so scores and outputs
are unchanged).

`call_signature` is everything `describe_call` reads, as a hashable key: two calls with equal
signatures pass the same checks and get equal problems, except for the checks on values
(`check_values`: cu_seqlens offsets and seqused_k on the CPU), which run on every call. The pipeline memoises
problems by it (pipeline/prepare.py). A new read in `describe_call` needs its field in the signature.

`seqused_k` (varlen: sequence b attends only its first `seqused_k[b]` keys) needs no kernel of its own: the
kernels run 2b sequences (`sequence_tensors`), sequence b's queries with its used keys, then no queries
with its other keys, whose gradients are therefore 0. The offsets are built on the device (no sync, no copy
of K/V); a bad value on a device is a bad offset, caught where a backend checks offsets there (CK).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.types import IntLikeType

from . import checks
from .errors import ArgumentError
from .mask import MaskInfo
from .options import AttentionOptions
from .problem import AttentionParams, AttentionProblem


def check_structure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions) -> None:
    """The checks of describe_call that read only the operands' ranks, dtypes, devices, strides and head counts and
    which options are given (no value and no rows): the first part of check_shapes."""
    o = options
    varlen = o.varlen
    ndim = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, ndim)
    checks.check_dtype("q", q, checks.SUPPORTED_DTYPES)
    checks.check_same_dtype("k", k, "q", q)
    checks.check_same_dtype("v", v, "q", q)
    checks.check_out_dtype_for(o.out_dtype, q.dtype)
    for name, t in (("k", k), ("v", v)):
        checks.check_device(name, t, q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_last_dim_contiguous(name, t)

    head_dim, heads_q = q.shape[-1], q.shape[-2]
    heads_k = k.shape[-2]
    checks.check_head_dim(head_dim)
    checks.check_head_dim(v.shape[-1], "v")
    checks.check_positive_heads(heads_q)
    checks.check_head_counts(heads_q, heads_k)
    if varlen:
        varlen_arguments(o)
    if o.learnable_sink is not None:
        checks.check_learnable_sink(o.learnable_sink, heads_q, q.device)


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions) -> IntLikeType:
    """Every check of describe_call that reads no tensor's values (`check_values` reads those): check_structure, then
    the operands' sizes against each other and the options' tensors. What the ops' fakes run too, so only equality
    and sign tests on sizes (symbolic under torch.compile: guards, never a specialised size). The call's batch."""
    check_structure(q, k, v, options)
    o = options
    head_dim, heads_q = q.shape[-1], q.shape[-2]
    heads_k = k.shape[-2]
    if o.varlen:
        given = varlen_arguments(o)
        checks.check_tensor("cu_seqlens_q", given.cu_seqlens_q, 1)
        batch = given.cu_seqlens_q.shape[0] - 1
        checks.check_positive_batch(batch, "cu_seqlens_q")
        checks.check_cu_seqlens("cu_seqlens_q", given.cu_seqlens_q, batch, q.device)
        checks.check_cu_seqlens("cu_seqlens_k", given.cu_seqlens_k, batch, q.device)
        checks.check_shape("k", k, (k.shape[0], heads_k, head_dim))
        if o.seqused_k is not None:
            checks.check_seqused_k(o.seqused_k, batch, q.device)
    else:
        if o.seqused_k is not None:
            raise ArgumentError("seqused_k: only varlen calls take it (with cu_seqlens_q/k)")
        batch = q.shape[0]
        checks.check_positive_batch(batch)
        checks.check_shape("k", k, (batch, k.shape[1], heads_k, head_dim))
    checks.check_shape("v", v, (*k.shape[:-1], v.shape[-1]))      # k's rows and heads; its own head dim d_v
    if o.alibi_slopes is not None:
        checks.check_alibi_slopes(o.alibi_slopes, batch, heads_q, q.device)
    return batch


def describe_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions) -> AttentionProblem:
    """Check q/k/v against each other and the options that depend on their shapes, then the values; the problem."""
    batch = int(check_shapes(q, k, v, options))      # eager sizes: ints
    o = options
    varlen = o.varlen
    out_dtype = checks.check_out_dtype_for(o.out_dtype, q.dtype)
    head_dim, heads_q = q.shape[-1], q.shape[-2]
    heads_k = k.shape[-2]
    if varlen:
        given = varlen_arguments(o)
        total_q, total_k = q.shape[0], k.shape[0]
        # max_seqlen is a launch bound, not data: no sequence is longer than its packed tensor, so the
        # problem's lengths are the tighter of the two (workspace and scratch are sized from them).
        seqlen_q, seqlen_k = min(int(given.max_seqlen_q), total_q), min(int(given.max_seqlen_k), total_k)
    else:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        total_q = total_k = 0
    mask = MaskInfo.from_flash_args(o.causal, o.window_size, seqlen_q, seqlen_k)
    problem = AttentionProblem(
        batch=batch if o.seqused_k is None else 2 * batch,      # the kernels' sequences (sequence_tensors)
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_k=heads_k,
        head_dim=head_dim, head_dim_v=v.shape[-1], dtype=q.dtype, device=q.device, mask=mask,
        softmax_scale=o.scale_for(head_dim),
        varlen=varlen, total_q=total_q, total_k=total_k, has_alibi=o.alibi_slopes is not None,
        has_sink=o.learnable_sink is not None,
        dropout_p=float(o.dropout_p), softcap=float(o.softcap), deterministic=bool(o.deterministic),
        out_dtype=out_dtype)
    check_values(problem, options)
    return problem


def varlen_arguments(options: AttentionOptions) -> checks.VarlenArguments:
    """The options' varlen arguments, each present (else the ArgumentError naming the first missing)."""
    return checks.check_varlen_arguments({name: getattr(options, name) for name in checks.VARLEN_ARGUMENTS})


def _tensor_signature(t: torch.Tensor | None):
    """What the checks read of a tensor: shape, strides, dtype, device (not its values or address)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def call_signature(q, k, v, options: AttentionOptions) -> tuple | None:
    """The key of `describe_call`'s result (see the module docstring); None when an operand is not a tensor or has
    no sizes and strides (a nested tensor): describe_call raises the error. Symbolic sizes (torch.compile) make a
    key that cannot be hashed."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    o = options
    # One flat tuple (built on every call): q, k, v, then the scalar options; the tensor options follow as one
    # nested entry each only where some is given, so keys with and without them differ in length.
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device,
               o.max_seqlen_q, o.max_seqlen_k, o.causal, o.window_size, o.softmax_scale, o.dropout_p, o.softcap,
               o.deterministic, o.out_dtype)
    except RuntimeError:        # a nested tensor's sizes and strides raise
        return None
    if o.cu_seqlens_q is None and o.cu_seqlens_k is None and o.seqused_k is None and o.alibi_slopes is None \
            and o.learnable_sink is None:
        return key
    return (*key, _tensor_signature(o.cu_seqlens_q), _tensor_signature(o.cu_seqlens_k),
            _tensor_signature(o.seqused_k), _tensor_signature(o.alibi_slopes), _tensor_signature(o.learnable_sink))


def check_values(problem: AttentionProblem, options: AttentionOptions) -> None:
    """The checks of `describe_call` that read values, not signatures: a memoised problem runs them again."""
    if problem.varlen:
        given = varlen_arguments(options)
        for name, cu, total, longest in (("cu_seqlens_q", given.cu_seqlens_q, problem.total_q, given.max_seqlen_q),
                                         ("cu_seqlens_k", given.cu_seqlens_k, problem.total_k, given.max_seqlen_k)):
            checks.check_cu_seqlens_values(name, cu, total, longest)
        if options.seqused_k is not None:
            checks.check_seqused_k_values(options.seqused_k, given.cu_seqlens_k)


def pad_to(t: torch.Tensor, head_dim_padded: int) -> torch.Tensor:
    """Zero-pad the last dim (a no-op view when it already has the kernel's size)."""
    extra = head_dim_padded - t.shape[-1]
    return t if extra == 0 else F.pad(t, (0, extra))


SequenceTensors = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def sequence_tensors(options: AttentionOptions) -> SequenceTensors:
    """`(cu_seqlens_q, cu_seqlens_k, alibi_slopes)` as the kernels read them: the options' own, or with
    `seqused_k` those of 2b sequences (module docstring): sequence 2i has sequence i's queries and keys
    `[cu_k[i], cu_k[i] + seqused_k[i])`, sequence 2i + 1 no queries and keys up to `cu_k[i + 1]`; batch slopes
    repeat per pair. Device ops only (no host sync)."""
    o = options
    if o.seqused_k is None:
        return o.cu_seqlens_q, o.cu_seqlens_k, o.alibi_slopes
    given = varlen_arguments(o)
    cu_q = given.cu_seqlens_q.repeat_interleave(2)[1:]      # q0, q1, q1, ..., qb, qb (an int repeat: no sync)
    starts = given.cu_seqlens_k[:-1]
    cu_k = torch.cat((torch.stack((starts, starts + o.seqused_k), 1).flatten(), given.cu_seqlens_k[-1:]))
    slopes = o.alibi_slopes
    if slopes is not None and slopes.dim() == 2:
        slopes = slopes.repeat_interleave(2, dim=0)
    return cu_q, cu_k, slopes


def kernel_params(problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  options: AttentionOptions, rng_state: torch.Tensor | None) -> AttentionParams:
    p = problem
    if p.padded:
        q, k, v = pad_to(q, p.head_dim_padded), pad_to(k, p.head_dim_padded), pad_to(v, p.head_dim_v_padded)
    sink = options.learnable_sink
    if sink is not None:
        sink = sink.detach().to(p.accum_dtype).contiguous()     # lse's dtype: fp32, fp64 for fp64 calls
    return AttentionParams(q, k, v, *sequence_tensors(options), rng_state, sink)
