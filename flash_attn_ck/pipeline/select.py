"""Backend selection, and the "no backend fits" message that lists every backend's reasons."""

from __future__ import annotations

import functools
import os

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..backends.base import Backend
from ..backends.registry import (
    BACKEND_NAMES,
    all_backend_classes,
    backend_class,
    backend_instance,
    installed_classes,
)
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
    if isinstance(requested, Backend):      # an instance runs as given, once its class is judged
        _chosen_name(problem, type(requested), type(requested), (), choices)
        return requested
    request = requested or backend_from_env()
    # a name (or automatic selection) runs the instance `use_backend` installed, so its class is what is judged
    installed = installed_classes()
    return backend_instance(_chosen_name(problem, request, (request, installed), installed, choices))


def _chosen_name(problem: AttentionProblem, request: str | type[Backend] | None, key: object,
                 installed: tuple[tuple[str, type[Backend]], ...], choices: dict | None) -> str:
    """`_choose`'s answer, read from and kept in `choices` under `key` where the caller keeps choices."""
    name = None if choices is None else choices.get(key)
    if name is None:
        name = _choose(problem, request, installed)
        if choices is not None:
            choices[key] = name
    return name


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
def _choose(problem: AttentionProblem, requested: str | type[Backend] | None,
            installed: tuple[tuple[str, type[Backend]], ...]) -> str:
    """The chosen backend's name; `requested`: a name, a backend class or None (automatic); `installed`: the classes
    of the instances `use_backend` installed, by name, which are judged instead of the registered classes.
    Memoised (a choice depends only on the problem, the request and what this process has
    installed): it runs on every call, and small calls are host-bound. Refusals raise and are not cached."""
    replaced = dict(installed)
    if requested is None:
        candidates = [replaced.get(cls.name, cls) for cls in all_backend_classes()]
    elif isinstance(requested, str):
        candidates = [replaced.get(requested) or backend_class(requested)]
    else:
        candidates = [requested]
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
    head_dims = f"d={p.head_dim}" if p.head_dim_v == p.head_dim else f"d={p.head_dim} d_v={p.head_dim_v}"
    return (f"{kind} h={p.heads_q}/{p.heads_k} {head_dims} {str(p.dtype).removeprefix('torch.')} "
            f"on {p.device.type}, mask={p.mask.type.name.lower()}")


# The backend each forward ran, by the lse it returned (held weakly: an entry goes with its lse), with what the
# forward asked for. A backward of that lse asking the same runs on that instance, whatever $FLASH_ATTN_CK_BACKEND or
# the `use_backend` blocks say by then: a CK forward draws its own dropout keep pattern, which no other backend's
# backward knows.
_FORWARD_BACKENDS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def note_forward_backend(softmax_lse: torch.Tensor, requested: str | Backend | None, chosen: Backend) -> None:
    _FORWARD_BACKENDS[softmax_lse] = (requested, chosen)


def forward_backend(softmax_lse: torch.Tensor, requested: str | Backend | None) -> Backend | None:
    """The instance the forward that returned `softmax_lse` ran, where that forward asked what `requested` asks (by
    identity for an instance); else None."""
    found = _FORWARD_BACKENDS.get(softmax_lse)
    if found is not None and (found[0] is requested or (isinstance(requested, str) and found[0] == requested)):
        return found[1]
    return None
