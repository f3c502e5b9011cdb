"""Backend selection, and the "no backend fits" message that lists every backend's reasons."""

from __future__ import annotations

import functools
import os

from ..backends.base import Backend
from ..backends.registry import BACKEND_NAMES, all_backend_classes, backend_class, backend_instance
from ..core.errors import ArgumentError, NoBackendError
from ..core.problem import AttentionProblem

BACKEND_ENV = "FLASH_ATTN_CK_BACKEND"


def select_backend(problem: AttentionProblem, requested: str | Backend | None = None,
                   choices: dict | None = None) -> Backend:
    """`requested` (a name or an instance), else `$FLASH_ATTN_CK_BACKEND`, else the highest-priority
    backend that fits. A name resolves to the instance `use_backend` installed, else the default one.
    `choices`: the names chosen before for this problem, by request (pipeline/prepare.py keeps one per
    call signature); read and filled here.

    Raises:
        NoBackendError: the requested backend, or every backend, refuses the call (with the reasons).
        ValueError: an unknown backend name.
    """
    given_instance = isinstance(requested, Backend)     # once: an ABC's isinstance runs Python code
    request = type(requested) if given_instance else requested or backend_from_env()
    name = None if choices is None else choices.get(request)
    if name is None:
        name = _choose(problem, request)        # raises with the reasons when nothing fits
        if choices is not None:
            choices[request] = name
    return requested if given_instance else backend_instance(name)


def backend_from_env() -> str | None:
    """`$FLASH_ATTN_CK_BACKEND`: a backend name, exactly; unset or empty means automatic."""
    name = os.environ.get(BACKEND_ENV, "")
    if not name:
        return None
    if name not in BACKEND_NAMES:
        raise ArgumentError(f"{BACKEND_ENV}={name!r}: expected one of {', '.join(BACKEND_NAMES)} "
                            f"(exactly, lower case), or unset/empty for automatic selection")
    return name


@functools.lru_cache(maxsize=256)
def _choose(problem: AttentionProblem, requested: str | type[Backend] | None) -> str:
    """The chosen backend's name; `requested`: a name, a backend class or None (automatic).
    Memoised (a choice depends only on the problem, the request and what this process has
    installed): it runs on every call, and small calls are host-bound. Refusals raise and are not cached."""
    if requested is None:
        candidates = all_backend_classes()
    else:
        candidates = [backend_class(requested) if isinstance(requested, str) else requested]
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
        what = f"backend {candidates[0].name!r} cannot run" if requested else "no backend can run"
        raise NoBackendError(f"{what} this call ({describe_problem(problem)}):\n" + "\n".join(lines))
    return max(fitting, key=lambda c: c.priority).name


def describe_problem(p: AttentionProblem) -> str:
    kind = f"varlen b={p.batch} max_s_q={p.seqlen_q} max_s_k={p.seqlen_k}" if p.varlen else \
        f"b={p.batch} s_q={p.seqlen_q} s_k={p.seqlen_k}"
    return (f"{kind} h={p.heads_q}/{p.heads_k} d={p.head_dim} {str(p.dtype).removeprefix('torch.')} "
            f"on {p.device.type}, mask={p.mask.type.name.lower()}")
