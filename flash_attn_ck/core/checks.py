"""Input validation: one function per rule, each message naming the argument and what was expected.

Every check runs before any output is allocated or written, so a failing call mutates nothing.
The rules are flash-attention's CK `mha_bwd`'s (docs/semantics.md §The CK fmha_bwd workspace
contract) plus those of the flash-attn Python API.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.types import FloatLikeType, IntLikeType

from .errors import ArgumentError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
# Integer options reach the ops' schemas (ops.py) as int64: larger values are refused here, naming the
# argument, rather than by the dispatcher.
MAX_INT64 = 2 ** 63 - 1
WORKSPACE_EXPECTED = "an integer number of bytes in [0, 2**63 - 1], or -1 for no cap"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_tensor(name: str, t, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or t.is_nested:     # the kernels read elements through strides
        got = "a nested tensor" if t.is_nested else f"layout {str(t.layout).removeprefix('torch.')}"
        raise ArgumentError(f"{name}: expected a dense (strided) tensor, got {got}")
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
        if device.type == "meta":       # meta is a whole call's device (fakes, planning), never q's alone
            raise ArgumentError(f"q: a meta tensor beside {name} on {t.device}; every tensor of the call must be on "
                                "one device (meta tensors only where every tensor is one)")
        raise ArgumentError(f"{name}: expected a tensor on {device} (the device of q), got {t.device}")


def is_integer_tensor(t) -> bool:
    """A tensor of integers (offsets, lengths): not floating, complex or bool."""
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.size(-1) > 1 and t.stride(-1) != 1:
        raise ArgumentError(f"{name}: expected a contiguous last dimension (stride 1), got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[IntLikeType]) -> None:
    if t.shape != tuple(expected):     # torch.Size is a tuple
        raise ArgumentError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def check_head_dim(head_dim: int, name: str = "q") -> None:
    """q's head dim (k's too), or v's (`name` "v": the value head dim d_v, which may differ from q's)."""
    if not 0 < head_dim <= MAX_HEAD_DIM:
        what = "head dim" if name == "q" else "value head dim (its last dimension)"
        raise ArgumentError(f"{name}: {what} must be in 1..{MAX_HEAD_DIM}, got {head_dim}")


def check_head_counts(heads_q: int, heads_k: int) -> None:
    if heads_k == 0 or heads_q % heads_k != 0:
        raise ArgumentError(f"k: the number of key/value heads ({heads_k}) must divide "
                            f"the number of query heads ({heads_q})")


def check_positive_batch(batch: int, name: str = "q") -> None:
    if batch <= 0:
        raise ArgumentError(f"{name}: batch size must be positive, got {batch}")


def check_positive_heads(heads: int) -> None:
    if heads <= 0:
        raise ArgumentError(f"q: the number of heads must be positive, got {heads}")


def _as_int(value) -> int | None:
    """An integer-like value (numpy integer, 0-d integer tensor: anything with __index__) as an int, else None."""
    try:
        return int(value.__index__())
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None


def check_number(name: str, value) -> FloatLikeType:
    """A real number (not a bool, string, tensor or None) that is finite; returned as a float (a SymFloat as it is)."""
    if type(value) is float and value - value == 0.0:     # the common case, first: runs on every call
        return value
    if isinstance(value, torch.SymFloat):      # traced by torch.compile: checked when it is concrete
        return value
    if isinstance(value, (bool, str, bytes, torch.Tensor)) or value is None:
        raise ArgumentError(f"{name}: expected a finite real number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):      # OverflowError: an int beyond any float
        raise ArgumentError(f"{name}: expected a finite real number, got {type(value).__name__} {value!r}") from None
    if not number - number == 0.0:     # inf and nan (math.isfinite would break torch.compile's graph)
        raise ArgumentError(f"{name}: expected a finite real number, got {value!r}")
    return number


def check_flag(name: str, value) -> bool:
    """A bool (or an integer 0/1, numpy's bool): `causal`, `deterministic`, `return_attn_probs`."""
    if value is True or value is False:
        return value
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ArgumentError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def check_out_dtype(value) -> torch.dtype | None:
    """`out_dtype` before the operands are known: None or a torch.dtype (describe_call checks it against q's)."""
    if value is not None and not isinstance(value, torch.dtype):
        raise ArgumentError(f"out_dtype: expected None or a torch.dtype, got {type(value).__name__} {value!r}")
    return value


def output_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes the results of a call on `dtype` inputs may have (`out_dtype`): the input dtype, or the
    accumulation dtype (fp32; fp64 inputs accumulate in fp64)."""
    return (dtype,) if dtype in (torch.float32, torch.float64) else (dtype, torch.float32)


def check_out_dtype_for(out_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """`out_dtype` against q's dtype; the results' dtype (None: q's)."""
    if out_dtype is None:
        return dtype
    allowed = output_dtypes(dtype)
    if out_dtype not in allowed:
        raise ArgumentError(f"out_dtype: expected None or {' or '.join(_dtype_name(d) for d in allowed)} for "
                            f"{_dtype_name(dtype)} q (its dtype, or the fp32 the kernels accumulate in), got "
                            f"{_dtype_name(out_dtype)}")
    return out_dtype


def check_dropout_p(dropout_p) -> FloatLikeType:
    dropout_p = check_number("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ArgumentError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    return dropout_p


# The kernels take the scale and the softcap as fp32: a larger value would reach them as inf.
FLOAT32_MAX = torch.finfo(torch.float32).max
# The smallest normal float32: a softcap below it is 0 or a subnormal in the kernels' float32, where scores / softcap
# (scale / softcap) overflow and a zero score gives 0 * inf = NaN.
FLOAT32_TINY = torch.finfo(torch.float32).tiny


def check_softcap(softcap) -> FloatLikeType:
    softcap = check_number("softcap", softcap)
    if not (softcap == 0.0 or FLOAT32_TINY <= softcap <= FLOAT32_MAX):
        raise ArgumentError(f"softcap: expected 0 (off) or a finite positive cap that float32 holds as a normal "
                            f"number ({FLOAT32_TINY:.4g} to {FLOAT32_MAX:.4g}), got {softcap}")
    return softcap


def check_softmax_scale(scale) -> FloatLikeType:
    scale = check_number("softmax_scale", scale)
    if not 0.0 < scale <= FLOAT32_MAX:
        raise ArgumentError(f"softmax_scale: expected a finite positive number that float32 holds "
                            f"(<= {FLOAT32_MAX:.4g}), got {scale}")
    return scale


# A window side is an int32 in the kernels; any side this large already covers every key (sequences
# are shorter than 2**31), so larger values are refused rather than silently clamped.
MAX_WINDOW_SIDE = 2 ** 31 - 1


def check_window(window_size) -> tuple[int, int]:
    """(left, right), each -1 (unbounded) or an integer in [0, 2**31 - 1]; returned as ints."""
    if type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int \
            and type(window_size[1]) is int and -1 <= window_size[0] <= MAX_WINDOW_SIDE \
            and -1 <= window_size[1] <= MAX_WINDOW_SIDE:       # the common case, first: runs on every call
        return window_size
    expected = "expected (left, right) with each side an integer, -1 (unbounded) or in [0, 2**31 - 1]"
    if isinstance(window_size, (Mapping, AbstractSet)):     # no order: tuple() of one is its keys in any order
        raise ArgumentError(f"window_size: {expected}, got {window_size!r}")
    try:
        sides = tuple(window_size)
    except TypeError:
        raise ArgumentError(f"window_size: {expected}, got {window_size!r}") from None
    if len(sides) != 2:
        raise ArgumentError(f"window_size: {expected}, got {window_size!r}")
    result = []
    for w in sides:
        if isinstance(w, (bool, float, str, bytes)) or w is None:
            raise ArgumentError(f"window_size: {expected}, got {window_size!r}")
        side = w if isinstance(w, int) else _as_int(w)     # numpy integers, 0-d integer tensors; not 1.7 or nan
        if side is None:
            raise ArgumentError(f"window_size: {expected}, got {window_size!r}")
        if not -1 <= side <= MAX_WINDOW_SIDE:
            raise ArgumentError(f"window_size: {expected}, got {window_size!r}")
        result.append(side)
    return result[0], result[1]


def check_max_seqlen(name: str, value) -> IntLikeType:
    """A varlen bound: an integer in [0, 2**63 - 1] (a SymInt as it is)."""
    if isinstance(value, torch.SymInt):        # traced by torch.compile
        return value
    expected = "expected a non-negative integer below 2**63"
    if isinstance(value, (bool, float, str, bytes)) or value is None:
        raise ArgumentError(f"{name}: {expected}, got {type(value).__name__} {value!r}")
    number = value if isinstance(value, int) else _as_int(value)    # ints as they are: SymInts under compile
    if number is None:
        raise ArgumentError(f"{name}: {expected}, got {type(value).__name__} {value!r}")
    if not 0 <= number <= MAX_INT64:
        raise ArgumentError(f"{name}: {expected}, got {number}")
    return number


def check_workspace_bytes(name: str, value) -> int:
    """A workspace cap: bytes in [0, 2**63 - 1], or -1 for none (other negative values are refused, not
    "no cap"; larger ones too, as the environment variable's and the argument's rule is one)."""
    if isinstance(value, (bool, float, str, bytes)) or value is None:
        raise ArgumentError(f"{name}: expected {WORKSPACE_EXPECTED}, got {value!r}")
    number = value if isinstance(value, int) else _as_int(value)
    if number is None or not -1 <= number <= MAX_INT64:
        raise ArgumentError(f"{name}: expected {WORKSPACE_EXPECTED}, got {value!r}")
    return number


def check_packed_slots(name: str, t: torch.Tensor, dim: int, slots: int) -> None:
    """Packed qkv (3 slots) / kv (2 slots) along `dim`."""
    if t.shape[dim] != slots:
        raise ArgumentError(f"{name}: expected {slots} slots in dim {dim} ({'q, k, v' if slots == 3 else 'k, v'}), "
                            f"got shape {tuple(t.shape)}")


def check_real_devices(tensors: Iterable[tuple[str, torch.Tensor | None]]) -> None:
    """Every tensor of a call on one real device: `meta` tensors have no data (a call given one would
    run the op's fake implementation and return uninitialised results), and mixed devices are refused.
    The first tensor sets the device; None entries are skipped."""
    device = first = None
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_meta:       # a flag: no device object made per tensor
            raise ArgumentError(f"{name}: a meta tensor has no data; every tensor of the call must be on one "
                                f"real device (backward_workspace plans from meta tensors)")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ArgumentError(f"{name}: expected a tensor on {device} (the device of {first}), got {t.device}")


def check_no_internal_overlap(name: str, t: torch.Tensor) -> None:
    """An output whose elements share memory (stride 0, expanded) cannot be written element-wise."""
    if t.numel() <= 1:
        return
    overlap = torch._debug_has_internal_overlap(t)      # 0 no, 1 yes, 2 torch cannot tell
    if overlap == 1:
        raise ArgumentError(f"{name}: an output must not have overlapping elements (stride 0 or an expanded view), "
                            f"got strides {t.stride()}")
    if overlap == 2 and not _nested(t):
        raise ArgumentError(f"{name}: an output's strides must nest (each dim stepping over the span of the "
                            f"smaller-strided ones) so that its elements are known not to overlap; got shape "
                            f"{tuple(t.shape)} with strides {t.stride()} (a contiguous tensor or a slice of one "
                            f"qualifies)")


def _nested(t: torch.Tensor) -> bool:
    """Whether `t`'s dims (size > 1), sorted by stride, each step over the span of the smaller ones: then no
    two elements share memory (torch's own check answers "too hard" for any non-contiguous view)."""
    span = 0
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1]):
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True


def _element_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last] element offset of `t` in its storage (an eager tensor's: its offset is an int)."""
    lo = hi = int(t.storage_offset())
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    return lo, hi


def _lattice_hits(delta: int, dims: list[tuple[int, int, int]]) -> bool:
    """Whether delta = sum(i_k * stride_k) with lo_k <= i_k <= hi_k, for dims (lo, hi, stride) sorted by stride
    descending and nested (each stride larger than the span of the smaller ones)."""
    if not dims:
        return delta == 0
    (lo, hi, stride), rest = dims[0], dims[1:]
    q = delta // stride
    return any(lo <= i <= hi and _lattice_hits(delta - i * stride, rest) for i in (q, q + 1))


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes `t`'s elements span."""
    lo, hi = _element_range(t)
    base = t.untyped_storage().data_ptr()
    return base + lo * t.element_size(), base + (hi + 1) * t.element_size()


def _storages_meet(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether two tensors of distinct storages share memory; None where they have one storage (their views decide)."""
    a_storage, b_storage = a.untyped_storage(), b.untyped_storage()
    if is_fake(a) or is_fake(b):
        # Fake tensors (the ops' fakes, torch.compile tracing) have no memory: they share it only as one storage.
        return None if a_storage._cdata == b_storage._cdata else False
    a_base, b_base = a_storage.data_ptr(), b_storage.data_ptr()
    if a_base == b_base:
        return None
    # Two storages share memory only where one buffer backs both (torch.from_numpy / frombuffer views of one
    # array): where their memory meets, the elements' byte spans decide (spans that meet count as shared).
    if a_base + a_storage.nbytes() <= b_base or b_base + b_storage.nbytes() <= a_base:
        return False
    (a_start, a_end), (b_start, b_end) = _byte_span(a), _byte_span(b)
    return a_start < b_end and b_start < a_end


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share an element of memory. Exact for disjoint storage or element ranges and for
    equally strided views of one storage (dk, dv = dkv[:, :, 0], dkv[:, :, 1], or dkv[..., :d], dkv[..., d:] with
    d_v != d); otherwise conservative (True)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    storages_meet = _storages_meet(a, b)
    if storages_meet is not None:
        return storages_meet
    if a.element_size() != b.element_size() or a.dtype != b.dtype:
        return torch._C._overlaps(a, b)
    (a_lo, a_hi), (b_lo, b_hi) = _element_range(a), _element_range(b)
    if a_hi < b_lo or b_hi < a_lo:
        return False
    if a.dim() != b.dim() or a.stride() != b.stride() or any(s < 0 for s in a.stride()):
        return True
    # a's element i meets b's element j where sum((i_k - j_k) * stride_k) is b's offset minus a's, with
    # 1 - b.size(k) <= i_k - j_k <= a.size(k) - 1 (sizes may differ: dk, dv = dkv[..., :d], dkv[..., d:]).
    dims = sorted(((1 - n_b, n_a - 1, s) for n_a, n_b, s in zip(a.shape, b.shape, a.stride()) if max(n_a, n_b) > 1),
                  key=lambda d: -d[2])
    span = 0
    for lo, hi, s in reversed(dims):
        if s <= span:
            return True          # not nested: cannot decide cheaply
        span += max(hi, -lo) * s
    return _lattice_hits(int(b.storage_offset()) - int(a.storage_offset()), dims)


def check_outputs_disjoint(outputs: Sequence[tuple[str, torch.Tensor | None]],
                           inputs: Sequence[tuple[str, torch.Tensor | None]]) -> None:
    """Preallocated outputs: none with overlapping elements, none sharing memory with an input or with
    another output. Runs before anything is written."""
    given = [(name, t) for name, t in outputs if isinstance(t, torch.Tensor)]
    for name, t in given:
        check_no_internal_overlap(name, t)
    for index, (name, t) in enumerate(given):
        for other_name, other in list(inputs) + given[index + 1:]:
            if isinstance(other, torch.Tensor) and tensors_overlap(t, other):
                raise ArgumentError(f"{name}: shares memory with {other_name}; outputs must not alias "
                                    f"an input or another output")


def check_alibi_slopes(slopes: torch.Tensor, batch: int, heads_q: int, device: torch.device) -> None:
    check_tensor("alibi_slopes", slopes)
    check_dtype("alibi_slopes", slopes, torch.float32)
    check_device("alibi_slopes", slopes, device)
    check_last_dim_contiguous("alibi_slopes", slopes)
    if tuple(slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ArgumentError(f"alibi_slopes: expected shape ({heads_q},) or ({batch}, {heads_q}), "
                            f"got {tuple(slopes.shape)}")


def check_learnable_sink(sink: torch.Tensor, heads_q: int, device: torch.device) -> None:
    """One sink logit per query head: a floating (h,) tensor on q's device."""
    check_tensor("learnable_sink", sink)
    check_dtype("learnable_sink", sink, SUPPORTED_DTYPES)
    check_device("learnable_sink", sink, device)
    if tuple(sink.shape) != (heads_q,):
        raise ArgumentError(f"learnable_sink: expected shape ({heads_q},) (one logit per query head), "
                            f"got {tuple(sink.shape)}")


def check_cu_seqlens(name: str, cu: torch.Tensor, batch: IntLikeType, device: torch.device) -> None:
    """Shape, dtype, device and layout; not the values (`check_cu_seqlens_values`), which a fake tensor has none of."""
    check_tensor(name, cu, 1)
    check_dtype(name, cu, torch.int32)
    check_device(name, cu, device)
    check_shape(name, cu, (batch + 1,))
    if not cu.is_contiguous():
        # Kernels read cu_seqlens as a plain int32 array (CK's seqstart[b]): a strided view would be misread.
        raise ArgumentError(f"{name}: must be contiguous, got stride {cu.stride()}")


def check_cu_seqlens_values(name: str, cu: torch.Tensor, total: int, max_seqlen: IntLikeType) -> None:
    """The offsets themselves: read on the CPU only (reading them from a GPU would sync)."""
    if cu.device.type == "cpu":
        values = cu.tolist()
        lengths = [b - a for a, b in itertools.pairwise(values)]
        if values[0] != 0 or any(n < 0 for n in lengths) or values[-1] > total:
            raise ArgumentError(f"{name}: expected non-decreasing offsets from 0 to at most {total}, got {values}")
        if lengths and max(lengths) > max_seqlen:
            max_name = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k"
            raise ArgumentError(f"{max_name}: {max_seqlen} is smaller than the longest sequence in {name} "
                                f"({max(lengths)})")


def check_seqused_k(seqused_k: torch.Tensor, batch: IntLikeType, device: torch.device) -> None:
    """Shape, dtype and device; not the values (`check_seqused_k_values`), as for cu_seqlens."""
    check_tensor("seqused_k", seqused_k, 1)
    check_dtype("seqused_k", seqused_k, torch.int32)
    check_device("seqused_k", seqused_k, device)
    check_shape("seqused_k", seqused_k, (batch,))


def check_seqused_k_values(seqused_k: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """Each sequence uses at most its keys: read on the CPU only (reading them from a GPU would sync)."""
    if seqused_k.device.type == "cpu":
        used, offsets = seqused_k.tolist(), cu_seqlens_k.tolist()
        lengths = [b - a for a, b in itertools.pairwise(offsets)]
        if any(not 0 <= n <= length for n, length in zip(used, lengths)):
            raise ArgumentError(f"seqused_k: expected each value in [0, its sequence's keys in cu_seqlens_k] "
                                f"(at most {lengths}), got {used}")


def check_rng_state(rng_state: torch.Tensor, device: torch.device) -> None:
    check_tensor("rng_state", rng_state, 1)
    check_dtype("rng_state", rng_state, torch.int64)
    check_device("rng_state", rng_state, device)
    check_shape("rng_state", rng_state, (2,))
    if rng_state.stride(0) != 1:    # the kernels read [seed, offset] as two adjacent int64
        raise ArgumentError(f"rng_state: expected a contiguous [seed, offset] tensor, got stride {rng_state.stride(0)}")


def check_like(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device, shape: Sequence[int],
               dtype_source: str = "the dtype of q") -> None:
    """CK `mha_bwd`'s checks for an operand or a preallocated output: dtype, device, last stride, shape.
    `dtype_source`: where the expected dtype comes from, for the message."""
    check_tensor(name, t)
    if t.dtype != dtype:
        raise ArgumentError(f"{name}: expected dtype {_dtype_name(dtype)} ({dtype_source}), got {_dtype_name(t.dtype)}")
    check_device(name, t, device)
    check_last_dim_contiguous(name, t)
    check_shape(name, t, shape)


def check_value_head_dim(name: str, t: torch.Tensor, head_dim_v: int) -> None:
    """out or dout (or dv): v's head dim d_v in the last dimension, which may differ from q's."""
    if t.dim() and t.shape[-1] != head_dim_v:
        raise ArgumentError(f"{name}: expected v's head dim {head_dim_v} in its last dimension (out, dout and dv "
                            f"have v's head dim d_v; q and k have d), got shape {tuple(t.shape)}")


def check_result(name: str, t: torch.Tensor, q: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> None:
    """A preallocated result (out, dq, dk, dv): `check_like` with the call's result dtype, q's or `out_dtype`."""
    check_like(name, t, dtype, q.device, shape, "the dtype of q" if dtype == q.dtype else "out_dtype")


class VarlenArguments(NamedTuple):
    """The arguments every varlen call has, all present (what `check_varlen_arguments` returns)."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: IntLikeType
    max_seqlen_k: IntLikeType


VARLEN_ARGUMENTS = VarlenArguments._fields


def check_varlen_arguments(given: Mapping[str, Any]) -> VarlenArguments:
    """A varlen call has each of VARLEN_ARGUMENTS (`given` by name): the error names the first missing and lists all."""
    missing = [name for name in VARLEN_ARGUMENTS if given[name] is None]
    if missing:
        raise ArgumentError(f"{missing[0]}: varlen calls need cu_seqlens_q, cu_seqlens_k, max_seqlen_q and "
                            f"max_seqlen_k (missing: {', '.join(missing)})")
    return VarlenArguments(*(given[name] for name in VARLEN_ARGUMENTS))
