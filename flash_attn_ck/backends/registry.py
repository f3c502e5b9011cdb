"""Which backends exist, and which instance of each the pipelines use.

By default every backend runs as one instance with its default options. `use_backend(instance)`
installs a configured instance (a Triton backend with forced options, say) for a block of code,
process-wide: autograd runs backward passes on its own threads, which must see it too. A call may
also pass an instance as `backend=` directly; `backend_key` / `backend_from_key` carry it through
the torch.library ops, whose schemas take a string.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from collections.abc import Iterator

from ..core.errors import ArgumentError
from .base import Backend

# Module paths, in the order they are tried when several fit with equal priority.
_BACKEND_MODULES = {
    "triton": "flash_attn_ck.backends.triton",
    "ck": "flash_attn_ck.backends.ck",
    "reference": "flash_attn_ck.backends.reference",
}
BACKEND_NAMES = tuple(_BACKEND_MODULES)


def _unloadable(name: str, reason: str) -> type[Backend]:
    """A backend class standing in for one whose module failed to load: it refuses every call with
    `reason` and can be instantiated (so reports such as backward_workspace list the reason)."""
    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"backend {name!r}: {reason}")
    return type(f"Unloadable_{name}", (Backend,), {
        "name": name, "unavailable_reason": classmethod(lambda cls: reason),
        "forward": refuse, "backward_plan": refuse, "backward": refuse})


def backend_class(name: str) -> type[Backend]:
    """The backend's class; a backend whose module fails to load becomes one that explains why."""
    if name not in _BACKEND_MODULES:
        raise ArgumentError(f"backend={name!r}: expected one of {sorted(_BACKEND_MODULES)}")
    try:
        return importlib.import_module(_BACKEND_MODULES[name]).BACKEND
    except (ImportError, AttributeError) as error:
        reason = f"its module {_BACKEND_MODULES[name]} failed to load ({type(error).__name__}: {error})"
        return _unloadable(name, reason)


def all_backend_classes() -> list[type[Backend]]:
    return [backend_class(name) for name in _BACKEND_MODULES]


_defaults: dict[str, Backend] = {}       # one instance per backend with default options, made on first use
_installed: dict[str, Backend] = {}      # the instances of the innermost `use_backend` blocks


def installed_classes() -> tuple[tuple[str, type[Backend]], ...]:
    """(name, class) of each instance the innermost `use_backend` blocks installed; () outside any."""
    return tuple((name, type(b)) for name, b in _installed.items()) if _installed else ()


def backend_instance(name: str) -> Backend:
    """The instance that runs backend `name`: the one `use_backend` installed, else the default one."""
    if name in _installed:
        return _installed[name]
    if name not in _defaults:
        _defaults[name] = backend_class(name)()
    return _defaults[name]


@contextlib.contextmanager
def use_backend(*backends: Backend) -> Iterator[None]:
    """Within the block, calls that run backend `b.name` (asked for by name or chosen automatically)
    run on the instance `b`, for each of `backends`; on exit the previous instances return.

        with flash_attn_ck.use_backend(TritonBackend(use_tma=True, dq_mode="pass")):
            out = flash_attn_func(q, k, v, backend="triton")
            out.sum().backward()

    Process-wide (autograd's backward threads see it too), so not for concurrent threads that need
    different instances: pass `backend=instance` to each call instead.

    Raises:
        TypeError: an argument is not a Backend instance.
    """
    for b in backends:
        if not isinstance(b, Backend):
            raise TypeError(f"use_backend: expected Backend instances, got {type(b).__name__}")
    saved = dict(_installed)
    _installed.update({b.name: b for b in backends})
    try:
        yield
    finally:
        _installed.clear()
        _installed.update(saved)


# Instances passed as `backend=` that are on their way through an op: a weak table, so it holds
# nothing alive (the autograd ctx holds the call's options, and with them the instance, until backward).
_passed: weakref.WeakValueDictionary[str, Backend] = weakref.WeakValueDictionary()


def backend_key(backend: str | Backend | None) -> str:
    """A `backend=` argument as a string for an op schema: "" (automatic), a name, or a key of an instance."""
    if backend is None or isinstance(backend, str):
        return backend or ""
    if not isinstance(backend, Backend):
        raise ArgumentError(f"backend: expected a name or a Backend instance, got {type(backend).__name__}")
    key = f"{backend.name}@{id(backend):x}"
    _passed[key] = backend
    return key


def backend_from_key(key: str) -> str | Backend | None:
    """The inverse of `backend_key`."""
    if "@" not in key:
        return key or None
    try:
        return _passed[key]
    except KeyError:
        raise ArgumentError(f"backend: {key!r} names no backend instance alive (an op's backend= is a backend "
                            "name, or the key the API made for an instance it was passed)") from None
