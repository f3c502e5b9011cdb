"""The errors flash_attn_ck raises on purpose, each naming what to change."""

from __future__ import annotations


class ArgumentError(ValueError):
    """A bad argument to a flash_attn_ck function."""


class WorkspaceError(RuntimeError):
    """The backward's workspace does not fit under the cap, even in its smallest chunk."""


class NoBackendError(RuntimeError):
    """No backend (or not the requested one) can run the call; the message lists every refusal."""
