"""flash_attn_ck: exact FlashAttention forward and backward behind one flash-attn-compatible API."""

from .api import (
    backward_workspace,
    flash_attn_bwd,
    flash_attn_func,
    flash_attn_fwd,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .backends.base import Backend
from .backends.registry import use_backend
from .core.errors import ArgumentError, KernelCompileError, NoBackendError, WorkspaceError
from .core.mask import MaskInfo, MaskKind, MaskType
from .core.options import AttentionOptions
from .pipeline.select import select_backend

__all__ = [
    "ArgumentError", "AttentionOptions", "Backend", "KernelCompileError", "MaskInfo", "MaskKind", "MaskType",
    "NoBackendError",
    "WorkspaceError",
    "backward_workspace", "flash_attn_bwd", "flash_attn_func", "flash_attn_fwd", "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func", "select_backend", "use_backend",
]
__version__ = "0.2.0"      # CHANGELOG.md; pyproject.toml reads it from here
