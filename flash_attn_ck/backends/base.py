"""The backend interface: declared capabilities and readable refusals.

A backend is a class whose capabilities are data (class attributes). `not_supported_reasons`
turns those declarations, plus anything backend-specific, into sentences; selection
(pipeline/select.py) picks the highest-priority backend with no reasons, and when none fits it
lists every backend's reasons.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from ..core.mask import API_MASK_KINDS, MaskKind, describe_kinds
from ..core.plan import WorkspacePlan
from ..core.problem import AttentionParams, AttentionProblem
from ..core.rows import fill_all_outside_sequences


class Capabilities:
    """What a backend, or one kernel of a backend (backends/triton/operators.py), declares it runs, as data;
    `declared_reasons` turns a call outside it into words."""
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float16, torch.bfloat16})
    max_head_dim: ClassVar[int] = 256             # of q/k's head dim d and of v's d_v alike
    # The mask kinds the kernels run (core/mask.py); a call with another kind is refused in the kind's words.
    mask_kinds: ClassVar[frozenset[MaskKind]] = API_MASK_KINDS
    supports_alibi: ClassVar[bool] = True
    # The mask kinds ALiBi runs with (None: every kind in mask_kinds).
    alibi_mask_kinds: ClassVar[frozenset[MaskKind] | None] = None
    supports_softcap: ClassVar[bool] = True
    supports_dropout: ClassVar[bool] = True
    supports_varlen: ClassVar[bool] = True
    supports_deterministic: ClassVar[bool] = True
    # Why fp32 results for fp16/bf16 inputs (`out_dtype`, what context parallelism merges) cannot be written,
    # or None where they can.
    fp32_outputs_refusal: ClassVar[str | None] = "its kernels write out, dq, dk and dv in the input dtype"
    # Why it runs no call whose v has a head dim of its own (padded, d_v != d); None: it runs them.
    value_head_dim_refusal: ClassVar[str | None] = None


def declared_reasons(declared: type[Capabilities], problem: AttentionProblem) -> list[str]:
    """Why `problem` lies outside what `declared` says it runs, in words (empty: it does not)."""
    reasons = []
    if problem.dtype not in declared.dtypes:
        names = sorted(str(d).removeprefix("torch.") for d in declared.dtypes)
        reasons.append(f"dtype {str(problem.dtype).removeprefix('torch.')} not in {names}")
    if problem.head_dim > declared.max_head_dim:
        reasons.append(f"head dim {problem.head_dim} > {declared.max_head_dim}")
    if problem.head_dim_v > declared.max_head_dim:
        reasons.append(f"value head dim {problem.head_dim_v} > {declared.max_head_dim}")
    if problem.mask.kind not in declared.mask_kinds:
        reasons.append(f"mask: {problem.mask.kind.value} is not supported "
                       f"(runs: {describe_kinds(declared.mask_kinds)})")
    features = [("ALiBi", problem.has_alibi, declared.supports_alibi),
                ("softcap", problem.softcap != 0.0, declared.supports_softcap),
                ("dropout", problem.dropout_p > 0.0, declared.supports_dropout),
                ("varlen", problem.varlen, declared.supports_varlen),
                ("deterministic mode", problem.deterministic, declared.supports_deterministic)]
    reasons += [f"{feature} is not supported" for feature, used, supported in features if used and not supported]
    alibi_kinds = declared.alibi_mask_kinds if declared.supports_alibi else None
    if problem.has_alibi and alibi_kinds is not None and problem.mask.kind not in alibi_kinds:
        reasons.append(f"ALiBi with mask {problem.mask.kind.value} is not supported "
                       f"(ALiBi runs with: {describe_kinds(alibi_kinds)})")
    if problem.out_dtype != problem.dtype and declared.fp32_outputs_refusal:
        reasons.append(f"out_dtype {str(problem.out_dtype).removeprefix('torch.')}: {declared.fp32_outputs_refusal}")
    if problem.head_dim_v_padded != problem.head_dim_padded and declared.value_head_dim_refusal:
        reasons.append(f"value head dim {problem.head_dim_v} != head dim {problem.head_dim}: "
                       f"{declared.value_head_dim_refusal}")
    return reasons


class Backend(Capabilities, abc.ABC):
    name: ClassVar[str]
    priority: ClassVar[int] = 0                     # higher wins when several backends fit
    # Devices on which automatic selection may pick this backend (None: wherever it is supported).
    auto_select_devices: ClassVar[frozenset[str] | None] = None
    device_types: ClassVar[frozenset[str]] = frozenset()
    # Whether the backward can run on a chunk of a call (pipeline/chunking.py): views of whole
    # batch entries / KV groups / query-head slices; query-row slices (a generic (y, x) mask); and
    # dropout, which needs a kernel that draws its pattern at `problem.placement`'s global coordinates.
    supports_chunks: ClassVar[bool] = False
    supports_row_chunks: ClassVar[bool] = False
    supports_chunked_dropout: ClassVar[bool] = False
    # Whether dropout follows core/dropout.py's keep pattern (so return_attn_probs can show it).
    draws_reference_keep_pattern: ClassVar[bool] = True

    # ---- capability checks ---------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine at all (missing library, toolkit), or None."""
        return None

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        """Backend-specific refusals beyond the declared capabilities."""
        return []

    @classmethod
    def not_supported_reasons(cls, problem: AttentionProblem) -> list[str]:
        reasons = []
        missing = cls.unavailable_reason()
        if missing:
            reasons.append(missing)
        if problem.device.type not in cls.device_types:
            reasons.append(f"device type {problem.device.type!r} not in {sorted(cls.device_types)}")
        return reasons + declared_reasons(cls, problem) + cls.extra_reasons(problem)

    # ---- kernels -------------------------------------------------------------------------------
    @abc.abstractmethod
    def forward(self, problem: AttentionProblem, params: AttentionParams,
                out: torch.Tensor, lse: torch.Tensor) -> None:
        """Write `out` (layout of q) and fp32 `lse` ((b, h, s_q) or varlen (h, total_q)). The pipeline
        calls it only when the call has query rows and key rows (empty calls need no kernel)."""

    def forward_takes_sink(self, problem: AttentionProblem) -> bool:
        """Whether the forward that ran `problem` took `params.learnable_sink` into its softmax, so that its out and lse
        are already the sink's; False (the default): the pipeline folds the sink around the kernel (core/sink.py),
        one more pass over out. Asked after `forward` returns: it names what ran."""
        return False

    def fp32_outputs_slower(self, problem: AttentionProblem) -> str | None:
        """Why fp32 results (`out_dtype`) of this fp16/bf16 call would run slower kernels than its input-dtype
        results, or None where the same kernels write both (a caller that may choose, context parallelism, then
        takes fp32)."""
        return None

    def forward_kernel(self, problem: AttentionProblem) -> str:
        """Which kernel runs the forward of this call and, when a faster one was passed over, why
        (empty: the backend has one forward)."""
        return ""

    def leaner(self) -> Backend | None:
        """This backend set up to need less backward workspace, at some cost in speed: the chunk planner
        (pipeline/chunking.py) runs it when not even the smallest chunk of this setup fits the workspace cap.
        None: there is no such setup."""
        return None

    @abc.abstractmethod
    def backward_plan(self, problem: AttentionProblem) -> WorkspacePlan:
        """Every buffer `backward` needs, by name (core/plan.py); the pipeline allocates them."""

    @abc.abstractmethod
    def backward(self, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor, workspace: dict[str, torch.Tensor]) -> None:
        """Fill `workspace['softmax_d']` and dq; dk/dv, or the expanded buffers when the plan says
        `reduce_expanded_kv` (then `dk`/`dv` are left for the pipeline's group sum). The pipeline
        calls it only when the call (or chunk) has query rows and key rows."""

    def fill_outside_sequences(self, *fills: tuple[torch.Tensor, torch.Tensor, int, float]) -> None:
        """Varlen rows in no sequence: for each `(cu_seqlens, t, dim, value)`, the entries of `t` whose index
        along `dim` is `>= cu_seqlens[-1]` become `value` (core/rows.py; a backend may do it in fewer launches).
        Never syncs with a device: the offset is read on the host only for CPU tensors."""
        by_offsets: dict[int, tuple] = {}
        for cu_seqlens, t, dim, value in fills:
            by_offsets.setdefault(id(cu_seqlens), (cu_seqlens, []))[1].append((t, dim, value))
        for cu_seqlens, same in by_offsets.values():
            fill_all_outside_sequences(cu_seqlens, *same)
