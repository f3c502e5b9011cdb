"""The backend interface: declared capabilities, readable refusals, and selection.

A backend is a class whose capabilities are data (class attributes). `not_supported_reasons`
turns those declarations, plus anything backend-specific, into sentences; the dispatcher picks
the highest-priority backend with no reasons, and when none fits it lists every backend's reasons.
"""

from __future__ import annotations

import abc
import functools
import importlib
import os
from typing import ClassVar, Optional

import torch

from ..frontend.plan import WorkspacePlan
from ..frontend.problem import AttentionParams, AttentionProblem

BACKEND_ENV = "FLASH_ATTN_CK_BACKEND"


class Backend(abc.ABC):
    name: ClassVar[str]
    priority: ClassVar[int] = 0                     # higher wins when several backends fit
    # Devices on which automatic selection may pick this backend (None: wherever it is supported).
    auto_select_devices: ClassVar[Optional[frozenset[str]]] = None
    device_types: ClassVar[frozenset[str]] = frozenset()
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float16, torch.bfloat16})
    max_head_dim: ClassVar[int] = 256
    supports_alibi: ClassVar[bool] = True
    supports_softcap: ClassVar[bool] = True
    supports_dropout: ClassVar[bool] = True
    supports_varlen: ClassVar[bool] = True
    supports_deterministic: ClassVar[bool] = True
    # Whether the backward can run on a chunk of a call (frontend/chunking.py): views of whole
    # batch entries / KV groups / query-head slices; query-row slices (a generic (y, x) mask); and
    # dropout, which needs a kernel that draws its pattern at `problem.placement`'s global coordinates.
    supports_chunks: ClassVar[bool] = False
    supports_row_chunks: ClassVar[bool] = False
    supports_chunked_dropout: ClassVar[bool] = False
    # Whether dropout follows frontend/dropout.py's keep pattern (so return_attn_probs can show it).
    draws_reference_keep_pattern: ClassVar[bool] = True

    # ---- capability checks ---------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
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
        if problem.dtype not in cls.dtypes:
            names = sorted(str(d).removeprefix("torch.") for d in cls.dtypes)
            reasons.append(f"dtype {str(problem.dtype).removeprefix('torch.')} not in {names}")
        if problem.head_dim > cls.max_head_dim:
            reasons.append(f"head dim {problem.head_dim} > {cls.max_head_dim}")
        features = [("ALiBi", problem.has_alibi, cls.supports_alibi),
                    ("softcap", problem.softcap != 0.0, cls.supports_softcap),
                    ("dropout", problem.dropout_p > 0.0, cls.supports_dropout),
                    ("varlen", problem.varlen, cls.supports_varlen),
                    ("deterministic mode", problem.deterministic, cls.supports_deterministic)]
        reasons += [f"{feature} is not supported" for feature, used, supported in features if used and not supported]
        return reasons + cls.extra_reasons(problem)

    # ---- kernels -------------------------------------------------------------------------------
    @abc.abstractmethod
    def forward(self, problem: AttentionProblem, params: AttentionParams,
                out: torch.Tensor, lse: torch.Tensor) -> None:
        """Write `out` (layout of q) and fp32 `lse` ((b, h, s_q) or varlen (h, total_q))."""

    @abc.abstractmethod
    def backward_plan(self, problem: AttentionProblem) -> WorkspacePlan:
        """Every buffer `backward` needs, by name (frontend/plan.py); the frontend allocates them."""

    @abc.abstractmethod
    def backward(self, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor, workspace: dict[str, torch.Tensor]) -> None:
        """Fill `workspace['softmax_d']` and dq; dk/dv, or the expanded buffers when the plan says
        `reduce_expanded_kv` (then `dk`/`dv` are left for the frontend's group sum)."""


# Module paths, in the order they are tried when several fit with equal priority.
_BACKEND_MODULES = {
    "triton": "flash_attn_ck.backends.triton",
    "ck": "flash_attn_ck.backends.ck",
    "reference": "flash_attn_ck.backends.reference",
}


class NoBackendError(RuntimeError):
    pass


def backend_class(name: str) -> type[Backend]:
    """The backend's class; a backend whose module fails to load becomes one that explains why."""
    if name not in _BACKEND_MODULES:
        raise ValueError(f"backend={name!r}: expected one of {sorted(_BACKEND_MODULES)}")
    try:
        return importlib.import_module(_BACKEND_MODULES[name]).BACKEND
    except (ImportError, AttributeError) as error:
        reason = f"its module {_BACKEND_MODULES[name]} failed to load ({type(error).__name__}: {error})"
        return type(f"Unloadable_{name}", (Backend,), {"name": name, "unavailable_reason": classmethod(lambda cls: reason)})


def all_backend_classes() -> list[type[Backend]]:
    return [backend_class(name) for name in _BACKEND_MODULES]


_instances: dict[str, Backend] = {}


def select_backend(problem: AttentionProblem, requested: Optional[str] = None) -> Backend:
    """`requested`, else `$FLASH_ATTN_CK_BACKEND`, else the highest-priority backend that fits."""
    name = _choose(problem, requested or os.environ.get(BACKEND_ENV) or None)
    if name not in _instances:
        _instances[name] = backend_class(name)()
    return _instances[name]


@functools.lru_cache(maxsize=256)
def _choose(problem: AttentionProblem, requested: Optional[str]) -> str:
    """The chosen backend's name. Memoised (a choice depends only on the problem, the request and
    what this process has installed): it runs on every call, and small calls are host-bound.
    Refusals raise and are not cached."""
    candidates = [backend_class(requested)] if requested else all_backend_classes()
    refusals = {}
    fitting = []
    for cls in candidates:
        reasons = cls.not_supported_reasons(problem)
        if not requested and cls.auto_select_devices is not None and problem.device.type not in cls.auto_select_devices:
            reasons.append(f"not chosen automatically on {problem.device.type} (pass backend={cls.name!r})")
        if reasons:
            refusals[cls.name] = reasons
        else:
            fitting.append(cls)
    if not fitting:
        lines = [f"  {name}: " + "; ".join(reasons) for name, reasons in refusals.items()]
        what = f"backend {requested!r} cannot run" if requested else "no backend can run"
        raise NoBackendError(f"{what} this call ({describe_problem(problem)}):\n" + "\n".join(lines))
    return max(fitting, key=lambda c: c.priority).name


def describe_problem(p: AttentionProblem) -> str:
    kind = f"varlen b={p.batch} max_s_q={p.seqlen_q} max_s_k={p.seqlen_k}" if p.varlen else \
        f"b={p.batch} s_q={p.seqlen_q} s_k={p.seqlen_k}"
    return (f"{kind} h={p.heads_q}/{p.heads_k} d={p.head_dim} {str(p.dtype).removeprefix('torch.')} "
            f"on {p.device.type}, mask={p.mask.type.name.lower()}")
