"""Input validation: one function per rule, each message naming the argument and what was expected.

Every check runs before any output is allocated or written, so a failing call mutates nothing.
The rules are flash-attention's CK `mha_bwd`'s (docs/semantics.md §The CK fmha_bwd workspace
contract) plus those of the flash-attn Python API.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .errors import ArgumentError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_tensor(name: str, t, ndim: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ArgumentError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, expected: torch.dtype | Sequence[torch.dtype]) -> None:
    allowed = (expected,) if isinstance(expected, torch.dtype) else tuple(expected)
    if t.dtype not in allowed:
        names = " or ".join(_dtype_name(d) for d in allowed)
        raise ArgumentError(f"{name}: expected dtype {names}, got {_dtype_name(t.dtype)}")


def check_same_dtype(name: str, t: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if t.dtype != reference.dtype:
        raise ArgumentError(f"{name}: expected the dtype of {reference_name} ({_dtype_name(reference.dtype)}), "
                            f"got {_dtype_name(t.dtype)}")


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ArgumentError(f"{name}: expected a tensor on {device} (the device of q), got {t.device}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.size(-1) > 1 and t.stride(-1) != 1:
        raise ArgumentError(f"{name}: expected a contiguous last dimension (stride 1), got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ArgumentError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def check_head_dim(head_dim: int) -> None:
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ArgumentError(f"q: head dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")


def check_head_counts(heads_q: int, heads_k: int) -> None:
    if heads_k == 0 or heads_q % heads_k != 0:
        raise ArgumentError(f"k: the number of key/value heads ({heads_k}) must divide "
                            f"the number of query heads ({heads_q})")


def check_positive_batch(batch: int) -> None:
    if batch <= 0:
        raise ArgumentError(f"q: batch size must be positive, got {batch}")


def check_dropout_p(dropout_p: float) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ArgumentError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")


def check_softcap(softcap: float) -> None:
    if softcap < 0.0:
        raise ArgumentError(f"softcap: expected 0 (off) or a positive cap, got {softcap}")


def check_softmax_scale(scale: float) -> None:
    if not scale > 0.0:
        raise ArgumentError(f"softmax_scale: expected a positive number, got {scale}")


def check_window(window_size) -> None:
    if len(window_size) != 2 or any(int(w) != w or w < -1 for w in window_size):
        raise ArgumentError(f"window_size: expected (left, right) with each side -1 (unbounded) or >= 0, "
                            f"got {tuple(window_size)}")


def check_alibi_slopes(slopes: torch.Tensor, batch: int, heads_q: int, device: torch.device) -> None:
    check_tensor("alibi_slopes", slopes)
    check_dtype("alibi_slopes", slopes, torch.float32)
    check_device("alibi_slopes", slopes, device)
    check_last_dim_contiguous("alibi_slopes", slopes)
    if tuple(slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ArgumentError(f"alibi_slopes: expected shape ({heads_q},) or ({batch}, {heads_q}), "
                            f"got {tuple(slopes.shape)}")


def check_cu_seqlens(name: str, cu: torch.Tensor, batch: int, total: int, max_seqlen: int,
                     device: torch.device) -> None:
    """Shape and dtype always; the values only on the CPU (reading them from a GPU would sync)."""
    check_tensor(name, cu, 1)
    check_dtype(name, cu, torch.int32)
    check_device(name, cu, device)
    check_shape(name, cu, (batch + 1,))
    if not cu.is_contiguous():
        # Kernels read cu_seqlens as a plain int32 array (CK's seqstart[b]): a strided view would be misread.
        raise ArgumentError(f"{name}: must be contiguous, got stride {cu.stride()}")
    if cu.device.type == "cpu":
        values = cu.tolist()
        lengths = [b - a for a, b in zip(values, values[1:])]
        if values[0] != 0 or any(n < 0 for n in lengths) or values[-1] > total:
            raise ArgumentError(f"{name}: expected non-decreasing offsets from 0 to at most {total}, got {values}")
        if lengths and max(lengths) > max_seqlen:
            max_name = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k"
            raise ArgumentError(f"{max_name}: {max_seqlen} is smaller than the longest sequence in {name} "
                                f"({max(lengths)})")


def check_rng_state(rng_state: torch.Tensor, device: torch.device) -> None:
    check_tensor("rng_state", rng_state, 1)
    check_dtype("rng_state", rng_state, torch.int64)
    check_device("rng_state", rng_state, device)
    check_shape("rng_state", rng_state, (2,))


def check_like(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device, shape: Sequence[int]) -> None:
    """CK `mha_bwd`'s checks for an operand or a preallocated output: dtype, device, last stride, shape."""
    check_tensor(name, t)
    if t.dtype != dtype:
        raise ArgumentError(f"{name}: expected dtype {_dtype_name(dtype)} (the dtype of q), got {_dtype_name(t.dtype)}")
    check_device(name, t, device)
    check_last_dim_contiguous(name, t)
    check_shape(name, t, shape)
