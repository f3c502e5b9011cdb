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
from .backends.base import NoBackendError, select_backend
from .frontend.checks import ArgumentError
from .frontend.chunking import WorkspaceError
from .frontend.mask import MaskInfo, MaskType

__all__ = [
    "ArgumentError", "WorkspaceError", "backward_workspace", "MaskInfo", "MaskType", "NoBackendError", "flash_attn_bwd", "flash_attn_func", "flash_attn_fwd",
    "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "select_backend",
]
__version__ = "0.1.0"
