"""One call's options: everything besides its operands, as one frozen object.

`AttentionOptions` is built and validated once (api.py builds it from flash-attn's keyword arguments)
and then carried unchanged through the ops (ops.py flattens it into plain schema arguments and back),
the autograd Function's ctx, the pipelines and the backends. Checks that need the operands' shapes
(ALiBi slopes, cu_seqlens) run in `core/inputs.describe_call`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from . import checks


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """flash-attn's options, with flash-attn's names and defaults.

    `backend`: a backend name ("triton", "ck", "reference"), a backend instance, or None (automatic).
    `max_workspace_bytes`: the backward's workspace cap (None: the environment's or the default).
    `out_dtype`: the dtype of out (forward) and dq, dk, dv (backward): None (q's), or fp32 for fp16/bf16 q, the
    kernels' results before their rounding, for callers that merge partial results (context parallelism);
    checked against q in `describe_call`.
    `learnable_sink`: None, or (h,) logits, one per query head (docs/semantics.md §Learnable sinks); checked
    against q in `check_structure`."""
    cu_seqlens_q: torch.Tensor | None = None     # int32 (b + 1,): varlen calls only
    cu_seqlens_k: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None        # int32 (b,): varlen only, the keys each sequence uses
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    alibi_slopes: torch.Tensor | None = None     # fp32 (h,) or (b, h)
    dropout_p: float = 0.0
    softmax_scale: float | None = None           # None: 1 / sqrt(head_dim)
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)         # (left, right); -1: unbounded
    softcap: float = 0.0
    deterministic: bool = False
    return_attn_probs: bool = False
    backend: Any = None
    max_workspace_bytes: int | None = None
    out_dtype: torch.dtype | None = None
    learnable_sink: torch.Tensor | None = None   # (h,) logits: each row's softmax has one more, valueless, logit

    def __post_init__(self):
        # eq=False: tensors inside, so options compare by identity; everything cached is keyed on the problem.
        # Every option is checked and normalised here, once: types, ranges, finiteness (bad values name the option).
        # object.__setattr__, not a vars() update: the constructor is what dynamo (torch 2.11) traces under compile.
        # One statement per option (no table of names): this runs on every call, and small calls are host-bound.
        setattr_ = object.__setattr__
        setattr_(self, "window_size", checks.check_window(self.window_size))
        setattr_(self, "softcap", checks.check_softcap(self.softcap))
        setattr_(self, "dropout_p", checks.check_dropout_p(self.dropout_p))
        # A flag that is a bool already is what its check returns: only other values (0/1, numpy bools) go through it.
        for flag in ("causal", "deterministic", "return_attn_probs"):
            value = getattr(self, flag)
            if value is not True and value is not False:
                setattr_(self, flag, checks.check_flag(flag, value))
        checks.check_out_dtype(self.out_dtype)      # None or a dtype, returned as given
        if self.softmax_scale is not None:
            setattr_(self, "softmax_scale", checks.check_softmax_scale(self.softmax_scale))
        if self.max_seqlen_q is not None:
            setattr_(self, "max_seqlen_q", checks.check_max_seqlen("max_seqlen_q", self.max_seqlen_q))
        if self.max_seqlen_k is not None:
            setattr_(self, "max_seqlen_k", checks.check_max_seqlen("max_seqlen_k", self.max_seqlen_k))
        for name, t in self.tensors():
            if t is not None:
                checks.check_tensor(name, t)
        if self.max_workspace_bytes is not None:
            setattr_(self, "max_workspace_bytes", checks.check_workspace_bytes("max_workspace_bytes",
                                                                              self.max_workspace_bytes))

    def replace_checked(self, **changes) -> AttentionOptions:
        """`dataclasses.replace(self, **changes)` for changes that an AttentionOptions has already checked and
        normalised (its own fields, or ops.py's flattening of them), without __post_init__: its checks would only
        repeat themselves, on every call of a host-bound small call. Never for values from outside, which go
        through the constructor."""
        if torch.compiler.is_compiling():
            # dynamo (torch 2.11) cannot trace the vars() update below; it traces the constructor, and a compiled
            # graph runs none of this host code anyway.
            return replace(self, **changes)
        options = object.__new__(type(self))
        vars(options).update(vars(self), **changes)     # frozen: only attribute assignment is blocked
        return options

    def tensors(self) -> tuple[tuple[str, torch.Tensor | None], ...]:
        """The tensor options by name (inputs that a preallocated output must not alias)."""
        return (("cu_seqlens_q", self.cu_seqlens_q), ("cu_seqlens_k", self.cu_seqlens_k), ("seqused_k", self.seqused_k),
                ("alibi_slopes", self.alibi_slopes), ("learnable_sink", self.learnable_sink))

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None or self.cu_seqlens_k is not None

    def scale_for(self, head_dim: int) -> float:
        """The softmax scale: the given one, else 1 / sqrt(head_dim)."""
        return 1.0 / math.sqrt(head_dim) if self.softmax_scale is None else float(self.softmax_scale)


OPTION_NAMES = tuple(f.name for f in fields(AttentionOptions))
