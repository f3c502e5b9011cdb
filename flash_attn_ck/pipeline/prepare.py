"""The shape-only work of a call, done once per call signature: validation, the problem, the backend choice.

Small calls are host-bound, and most of what a call decides depends on its signature alone — shapes,
strides, dtypes and devices of every tensor, and the options (`core.inputs.call_signature`), never a
tensor's identity or values. `prepare` memoises the problem per signature; the backend chosen for it is
memoised per request (a name, an instance, or automatic with the `$FLASH_ATTN_CK_BACKEND` in force), and
the instance that runs it is looked up on every call (so `use_backend` blocks apply). What reads values
runs on every call: the option checks (`AttentionOptions`), the cu_seqlens offsets on the CPU
(`check_values`), and anything a backend does at launch (alignment, pointers).

Failing calls raise before anything is stored, so an error is raised again on every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.base import Backend
from ..core.errors import ArgumentError, NoBackendError
from ..core.inputs import call_signature, check_values, describe_call
from ..core.options import AttentionOptions
from ..core.problem import AttentionProblem
from .select import select_backend


@dataclass
class PreparedCall:
    problem: AttentionProblem
    # request (a backend name, a Backend class, or None: automatic with this $FLASH_ATTN_CK_BACKEND) -> the
    # backend name chosen for the problem
    choices: dict = field(default_factory=dict)


class SignatureCache:
    """A bounded dict of prepared calls by signature, oldest dropped first, counting hits and misses."""

    def __init__(self, size: int):
        self.size = size
        self.entries: dict[tuple, PreparedCall] = {}
        self.hits = self.misses = 0

    def store(self, key: tuple, entry: PreparedCall) -> PreparedCall:
        if len(self.entries) >= self.size:
            del self.entries[next(iter(self.entries))]
        self.entries[key] = entry
        return entry

    def clear(self) -> None:
        self.entries.clear()
        self.hits = self.misses = 0


CALLS = SignatureCache(256)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions) -> PreparedCall:
    """The call's problem (validated as `describe_call` validates it), from the cache when this signature was
    prepared before: a hit counts, and only its value checks run (`check_values`), which with the signature are
    the whole validation of q, k, v and the options. Made once per call, at its entry; the pipeline carries it."""
    key = call_signature(q, k, v, options)
    try:
        entry = CALLS.entries.get(key) if key is not None else None
    except TypeError:       # symbolic sizes under torch.compile are not hashable: nothing to reuse
        key = entry = None
    if entry is not None:
        CALLS.hits += 1
        check_values(entry.problem, options)
        return entry
    CALLS.misses += 1
    entry = PreparedCall(describe_call(q, k, v, options))
    if key is not None:
        CALLS.store(key, entry)
    return entry


def prepared_backend(entry: PreparedCall, requested: str | Backend | None, ran: Backend | None = None) -> Backend:
    """`select_backend(entry.problem, requested)`, with the choice memoised in the entry. `ran`: the instance this
    call's forward ran (a backward's), which is the answer: judged again only where the request now resolves to
    another instance or to none (the environment or a use_backend block changed since the forward)."""
    if ran is None:
        return select_backend(entry.problem, requested, entry.choices)
    try:
        if select_backend(entry.problem, requested, entry.choices) is ran:
            return ran
    except (ArgumentError, NoBackendError):
        pass
    return select_backend(entry.problem, ran, entry.choices)
