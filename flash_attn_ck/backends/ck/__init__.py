"""The CK backend: ctypes over csrc_ck's C ABI (backend.py) and CK's workspace contract (plan.py)."""

from .backend import CkBackend

BACKEND = CkBackend

__all__ = ["BACKEND", "CkBackend"]
