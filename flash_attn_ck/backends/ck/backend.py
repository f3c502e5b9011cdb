"""The CK backend: CK's `fmha_fwd` / `fmha_bwd` for AMD MI300, through the C ABI of csrc_ck/.

The library (libflash_attn_ck.so) is loaded with ctypes and needs no torch headers; hip-python
answers device questions (the GPU's gfx target) and renders HIP error codes. Both are optional:
without a ROCm build of torch, the library or hip-python, the backend explains what is missing.

The argument builders (`attention_args`, `backward_args`) are pure functions from tensors and the
problem to the ctypes structs, following flash-attention's `get_ck_fmha_bwd_args` field by field, so they
are tested on CPU tensors.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ...core.mask import WINDOW_MASK_KINDS, MaskKind, MaskType
from ...core.plan import WorkspacePlan
from ...core.problem import AttentionParams, AttentionProblem
from ..base import Backend
from .plan import ck_backward_plan

LIBRARY_ENV = "FLASH_ATTN_CK_LIBRARY"
LIBRARY_NAME = "libflash_attn_ck.so"
# A wheel built with the library copied here carries it (package data; the Dockerfile does this).
PACKAGED_LIBRARY = Path(__file__).resolve().parent / LIBRARY_NAME
# Where csrc_ck/CMakeLists.txt builds by default in a source checkout (`cmake -S csrc_ck -B build/ck`).
DEFAULT_LIBRARY = Path(__file__).resolve().parents[3] / "build" / "ck" / LIBRARY_NAME

ABI_VERSION = 3          # FACK_ABI_VERSION of csrc_ck/include/flash_attn_ck.h
DTYPES = {torch.float16: 0, torch.bfloat16: 1}      # fack_dtype
STATUS_NAMES = {1: "invalid argument", 2: "no kernel instance", 3: "HIP error", 4: "internal error",
                5: "kernel launch failed"}
FACK_HIP_ERROR = 3
FACK_LAUNCH_ERROR = 5


# ---- the C structs (csrc_ck/include/flash_attn_ck.h); tests/ck/test_ck_abi.py checks every offset ----

class FackTensor(ctypes.Structure):
    """A (batch, rows, heads, head dim) tensor, last dimension contiguous; strides in elements."""
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("batch_stride", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
    ]


class FackRowStats(ctypes.Structure):
    """fp32 lse or D: (b, h, s_q), or (h, total_q) in group mode."""
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("batch_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
    ]


class FackAttention(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int32),
        ("group_mode", ctypes.c_int32),
        ("batch", ctypes.c_int64),
        ("seqlen_q", ctypes.c_int64),
        ("seqlen_k", ctypes.c_int64),
        ("max_seqlen_q", ctypes.c_int64),
        ("max_seqlen_k", ctypes.c_int64),
        ("nhead_q", ctypes.c_int64),
        ("nhead_k", ctypes.c_int64),
        ("head_dim_q", ctypes.c_int64),
        ("head_dim_v", ctypes.c_int64),
        ("seqstart_q", ctypes.c_void_p),
        ("seqstart_k", ctypes.c_void_p),
        ("q", FackTensor),
        ("k", FackTensor),
        ("v", FackTensor),
        ("out", FackTensor),
        ("lse", FackRowStats),
        ("softmax_scale", ctypes.c_float),
        ("mask_type", ctypes.c_int32),
        ("window_left", ctypes.c_int64),
        ("window_right", ctypes.c_int64),
        ("alibi_slopes", ctypes.c_void_p),
        ("alibi_batch_stride", ctypes.c_int64),
        ("p_drop", ctypes.c_float),
        ("drop_seed", ctypes.c_void_p),
        ("drop_offset", ctypes.c_void_p),
    ]


class FackBwdArgs(ctypes.Structure):
    _fields_ = [
        ("attn", FackAttention),
        ("dout", FackTensor),
        ("dq", FackTensor),
        ("dk", FackTensor),
        ("dv", FackTensor),
        ("d", FackRowStats),
        ("dq_acc", FackTensor),
        ("dq_acc_split_stride", ctypes.c_int64),
        ("p_undrop", ctypes.c_float),
        ("deterministic", ctypes.c_int32),
    ]


# ---- argument builders: tensors -> structs (pure, CPU-testable) -------------------------------

def tensor_arg(name: str, t: torch.Tensor, varlen: bool) -> FackTensor:
    """(b, s, h, d) -> its strides; varlen (total, h, d) has batch stride 0 (CK's group mode)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the CK kernels need a contiguous last dimension, got strides {t.stride()}")
    if varlen:
        return FackTensor(t.data_ptr(), 0, t.stride(0), t.stride(1))
    return FackTensor(t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))


def row_stats_arg(t: torch.Tensor, varlen: bool) -> FackRowStats:
    """lse-shaped: (b, h, s_q), or varlen (h, total_q) with batch stride 0."""
    if varlen:
        return FackRowStats(t.data_ptr(), 0, t.stride(0))
    return FackRowStats(t.data_ptr(), t.stride(0), t.stride(1))


def ck_window(problem: AttentionProblem) -> tuple[int, int]:
    """(window_size_left, window_size_right) for CK. ck_tile reads a left side < 0 with a right side 0 as
    "causal" and then applies ALiBi as +slope * j (its VERTICAL mode): out and the gradients are ours (a
    per-row constant), lse is ours + slope * (i + s_k - s_q). With ALiBi a bottom-right causal mask goes as
    a left side of s_k instead: no key of any sequence lies further left (i + s_k - s_q - s_k < 0), and CK
    then aligns ALiBi bottom-right, -slope * |i + s_k - s_q - j|, as we do."""
    m = problem.mask
    if problem.has_alibi and m.type == MaskType.BOTTOM_RIGHT and m.left < 0 and m.right == 0:
        return max(problem.seqlen_k, 1), 0
    return m.left, m.right


def attention_args(problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                   lse: torch.Tensor) -> FackAttention:
    """The forward's struct, also the first member of the backward's."""
    p, varlen = problem, problem.varlen
    window = ck_window(p)
    args = FackAttention(
        dtype=DTYPES[p.dtype], group_mode=int(varlen), batch=p.batch,
        # Group mode: CK takes the packed totals here and reads each length from seqstart.
        seqlen_q=p.total_q if varlen else p.seqlen_q,
        seqlen_k=p.total_k if varlen else p.seqlen_k,
        max_seqlen_q=p.seqlen_q, max_seqlen_k=p.seqlen_k,
        nhead_q=p.heads_q, nhead_k=p.heads_k, head_dim_q=p.head_dim_padded, head_dim_v=p.head_dim_v_padded,
        q=tensor_arg("q", params.q, varlen), k=tensor_arg("k", params.k, varlen),
        v=tensor_arg("v", params.v, varlen), out=tensor_arg("out", out, varlen),
        lse=row_stats_arg(lse, varlen),
        softmax_scale=p.softmax_scale,
        # Only the type and left/right reach CK; it rebuilds the window per sequence.
        mask_type=int(p.mask.type), window_left=window[0], window_right=window[1],
        p_drop=p.dropout_p,
    )
    if varlen:
        seqstart_q, seqstart_k = params.offsets()
        args.seqstart_q, args.seqstart_k = seqstart_q.data_ptr(), seqstart_k.data_ptr()
    if params.alibi_slopes is not None:
        slopes = params.alibi_slopes
        if slopes.dtype != torch.float32 or (slopes.size(-1) > 1 and slopes.stride(-1) != 1):   # one head: any stride
            raise ValueError("alibi_slopes: CK needs fp32 with a contiguous last dimension")
        args.alibi_slopes = slopes.data_ptr()
        args.alibi_batch_stride = slopes.stride(0) if slopes.dim() == 2 else 0   # (b, h) or broadcast (h,)
    if p.dropout_p > 0:
        rng = params.rng_state
        if rng is None or rng.dtype != torch.int64 or not rng.is_contiguous():
            raise ValueError("rng_state: dropout needs a contiguous int64 [seed, offset] tensor")
        # Device pointers (not values), so a captured graph reads each replay's rng_state.
        args.drop_seed = rng.data_ptr()
        args.drop_offset = rng.data_ptr() + rng.element_size()
    return args


def backward_args(problem: AttentionProblem, params: AttentionParams, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                  workspace: dict[str, torch.Tensor]) -> FackBwdArgs:
    """flash-attention's `get_ck_fmha_bwd_args`: MQA/GQA write per-query-head dK/dV into the expanded buffers."""
    p, varlen = problem, problem.varlen
    dk_target = workspace["dk_expanded"] if p.is_gqa else dk
    dv_target = workspace["dv_expanded"] if p.is_gqa else dv
    dq_acc = workspace["dq_accum"]          # (splits, b, s_q, h, d) or varlen (splits, total_q, h, d)
    softmax_d = workspace["softmax_d"]      # strided like lse: CK reads both with one set of strides
    if softmax_d.stride() != lse.stride():
        raise ValueError(f"softmax_d strides {softmax_d.stride()} differ from lse strides {lse.stride()}")
    return FackBwdArgs(
        attn=attention_args(p, params, out, lse),
        dout=tensor_arg("dout", dout, varlen), dq=tensor_arg("dq", dq, varlen),
        dk=tensor_arg("dk", dk_target, varlen), dv=tensor_arg("dv", dv_target, varlen),
        d=row_stats_arg(softmax_d, varlen),
        dq_acc=tensor_arg("dq_accum", dq_acc[0], varlen), dq_acc_split_stride=dq_acc.stride(0),
        p_undrop=1.0 - p.dropout_p, deterministic=int(p.deterministic),
    )


def tile_query_args(problem: AttentionProblem) -> FackBwdArgs:
    """The backward struct with sizes and features only, for `fack_bwd_tile` (planning happens before
    the tensors exist). The library tests pointers for NULL only: ALiBi is flagged by a non-NULL
    stand-in that is never dereferenced."""
    p = problem
    left, right = ck_window(p)
    attn = FackAttention(
        dtype=DTYPES[p.dtype], group_mode=int(p.varlen), batch=p.batch,
        seqlen_q=p.total_q if p.varlen else p.seqlen_q, seqlen_k=p.total_k if p.varlen else p.seqlen_k,
        max_seqlen_q=p.seqlen_q, max_seqlen_k=p.seqlen_k, nhead_q=p.heads_q, nhead_k=p.heads_k,
        head_dim_q=p.head_dim_padded, head_dim_v=p.head_dim_v_padded, softmax_scale=p.softmax_scale,
        mask_type=int(p.mask.type),
        window_left=left, window_right=right, p_drop=p.dropout_p,
        alibi_slopes=1 if p.has_alibi else None)
    return FackBwdArgs(attn=attn, p_undrop=1.0 - p.dropout_p, deterministic=int(p.deterministic))


# ---- loading ----------------------------------------------------------------------------------

def library_path() -> Path:
    """$FLASH_ATTN_CK_LIBRARY, else the library inside the installed package, else the source tree's build."""
    if os.environ.get(LIBRARY_ENV):
        return Path(os.environ[LIBRARY_ENV])
    return PACKAGED_LIBRARY if PACKAGED_LIBRARY.is_file() else DEFAULT_LIBRARY


class CkError(RuntimeError):
    pass


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) or (None, why not); cached: the answer does not change within a process."""
    if torch.version.hip is None:
        return None, "torch is not a ROCm build (torch.version.hip is None)"
    path = library_path()
    if not path.is_file():
        return None, (f"the CK library {path} does not exist (build csrc_ck/ with CMake, copy it to "
                      f"{PACKAGED_LIBRARY}, or point ${LIBRARY_ENV} at {LIBRARY_NAME})")
    try:
        import hip  # noqa: F401  (hip-python: arch queries and error strings)
    except ImportError:
        return None, "hip-python is not installed (pip install 'flash_attn_ck[rocm]')"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        return None, f"the CK library {path} failed to load: {error}"
    declare_functions(lib)
    mismatch = abi_mismatch(lib)
    return (None, f"the CK library {path}: {mismatch}") if mismatch else (lib, None)


def declare_functions(lib: ctypes.CDLL) -> None:
    """Signatures of the exported C functions (flash_attn_ck.h)."""
    lib.fack_fwd.argtypes = [ctypes.POINTER(FackAttention), ctypes.c_void_p]
    lib.fack_bwd.argtypes = [ctypes.POINTER(FackBwdArgs), ctypes.c_void_p]
    lib.fack_abi_version.argtypes = []
    if lib.fack_abi_version() != ABI_VERSION:
        return      # abi_mismatch() says so; other functions may be missing
    lib.fack_bwd_tile.argtypes = [ctypes.POINTER(FackBwdArgs), ctypes.c_char_p, ctypes.POINTER(ctypes.c_int32)]
    for fn in (lib.fack_fwd, lib.fack_bwd, lib.fack_bwd_tile, lib.fack_last_hip_error, lib.fack_abi_version):
        fn.restype = ctypes.c_int
    for fn in (lib.fack_last_error, lib.fack_gpu_targets, lib.fack_fwd_head_dims, lib.fack_bwd_head_dims):
        fn.argtypes, fn.restype = [], ctypes.c_char_p
    for fn in (lib.fack_attention_size, lib.fack_bwd_args_size):
        fn.argtypes, fn.restype = [], ctypes.c_int64


def abi_mismatch(lib: ctypes.CDLL) -> str | None:
    if lib.fack_abi_version() != ABI_VERSION:
        return f"ABI version {lib.fack_abi_version()}, this package expects {ABI_VERSION} (rebuild it)"
    sizes = {"fack_attention": (lib.fack_attention_size(), ctypes.sizeof(FackAttention)),
             "fack_bwd_args": (lib.fack_bwd_args_size(), ctypes.sizeof(FackBwdArgs))}
    wrong = [f"sizeof({name}) is {c} in C, {py} in Python" for name, (c, py) in sizes.items() if c != py]
    return "; ".join(wrong) or None


def library_targets(lib: ctypes.CDLL) -> list[str]:
    return [t for t in lib.fack_gpu_targets().decode().split(",") if t]


@dataclass(frozen=True)
class HeadDimBuckets:
    """The (hdim_q, hdim_v) buckets of a library's compiled instances, per direction (its `fack_fwd_head_dims` /
    `fack_bwd_head_dims`, generated with the instances by scripts/ck_generate.py). CK dispatches a call with
    padded head dims (d, d_v) to the first bucket with `d <= hdim_q and d_v <= hdim_v`: with none, the library
    has no instance for the call."""
    forward: tuple[tuple[int, int], ...]
    backward: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, lib) -> HeadDimBuckets:
        return cls(_pairs(lib.fack_fwd_head_dims()), _pairs(lib.fack_bwd_head_dims()))

    def missing(self, head_dim: int, head_dim_v: int) -> list[str]:
        """Why no instance holds padded head dims (head_dim, head_dim_v), per direction ([] when both have one)."""
        reasons = []
        for direction, buckets in (("forward", self.forward), ("backward", self.backward)):
            if not any(head_dim <= q and head_dim_v <= v for q, v in buckets):
                listed = ", ".join(f"{q}x{v}" for q, v in buckets) or "none"
                reasons.append(f"head dims d={head_dim}, d_v={head_dim_v} (padded): the CK library has no {direction} "
                               f"instance for them (its {direction} buckets, hdim_q x hdim_v: {listed})")
        return reasons


def _pairs(text: bytes) -> tuple[tuple[int, int], ...]:
    """"128x128,192x128" -> ((128, 128), (192, 128))."""
    pairs = []
    for pair in text.decode().split(","):
        if pair:
            head_dim_q, head_dim_v = pair.split("x")
            pairs.append((int(head_dim_q), int(head_dim_v)))
    return tuple(pairs)


@functools.cache
def device_arch(index: int) -> str:
    """The gfx target of HIP device `index` ("gfx942"), without feature suffixes like ":sramecc+"."""
    from hip import hip
    props = hip.hipDeviceProp_t()
    (err,) = hip.hipGetDeviceProperties(props, index)
    if err != hip.hipError_t.hipSuccess:
        raise CkError(f"hipGetDeviceProperties({index}) failed: {hip_error_string(err)}")
    name = props.gcnArchName
    return (name.decode() if isinstance(name, bytes) else str(name)).split(":")[0]


def hip_error_string(code) -> str:
    from hip import hip
    result = hip.hipGetErrorString(hip.hipError_t(int(code)))
    text = result[0] if isinstance(result, tuple) else result
    return text.decode() if isinstance(text, bytes) else str(text)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


# ---- the backend ------------------------------------------------------------------------------

class CkBackend(Backend):
    name = "ck"
    priority = 20                       # the native kernels, preferred wherever they can run
    device_types = frozenset({"cuda"})  # ROCm builds of torch call HIP devices "cuda"
    max_head_dim = 256
    supports_softcap = False            # CK's kernels have none: refuse, never ignore
    # CK's top-left and bottom-right masks (rebuilt per sequence from left/right); generic (y, x)
    # windows need CK's generic mask, which our instance set does not build.
    mask_kinds = WINDOW_MASK_KINDS
    # ck_tile aligns ALiBi with a top-left mask's corner (-slope * |i - j|); ours is bottom-right always.
    alibi_mask_kinds = frozenset({MaskKind.NONE, MaskKind.CAUSAL, MaskKind.WINDOW})
    # Chunks of whole batch entries, KV groups or query-head slices are plain views for CK. Not query
    # rows (that needs CK's generic mask, which our instance set does not build) and not with dropout
    # (CK draws its pattern from positions inside the launch).
    supports_chunks = True
    draws_reference_keep_pattern = False
    fp32_outputs_refusal = ("CK's fmha kernels write out, dq, dk and dv in the input dtype (context parallelism "
                            "keeps its per-step results in the input dtype on CK)")
    # The library to run: None is libflash_attn_ck.so (loaded on first use). `on_library` makes a
    # backend over another object with the same fack_* entry points (the tests' CPU emulation of CK).
    _library: ClassVar[object | None] = None
    _arch_of: ClassVar[Callable[[torch.device], str] | None] = None

    @classmethod
    def on_library(cls, library, device_types: Iterable[str], arch_of: Callable[[torch.device], str]) -> CkBackend:
        """A CK backend whose kernels are `library`'s (an object with the entry points of
        flash_attn_ck.h, already declared), for devices of `device_types`, whose gfx target is
        `arch_of(device)`. Tests run the backend end to end on CPU tensors through an emulation of
        CK's kernels this way; the default backend (libflash_attn_ck.so, HIP devices) is unchanged."""
        attrs = {"_library": library, "device_types": frozenset(device_types), "_arch_of": staticmethod(arch_of)}
        return type(f"{cls.__name__}On{type(library).__name__}", (cls,), attrs)()

    @classmethod
    def _resolve(cls):
        """(library, None) or (None, why not)."""
        if cls._library is None:
            return _load()
        mismatch = abi_mismatch(cls._library)
        return (None, f"the CK library {cls._library!r}: {mismatch}") if mismatch else (cls._library, None)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return cls._resolve()[1]

    @classmethod
    def _device_arch(cls, device: torch.device) -> str:
        return cls._arch_of(device) if cls._arch_of is not None else device_arch(_device_index(device))

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        lib = cls._resolve()[0]
        if lib is None or problem.device.type not in cls.device_types:
            return []
        arch = cls._device_arch(problem.device)
        targets = library_targets(lib)
        if arch not in targets:
            return [f"the CK library was built for {', '.join(targets)}, the device is {arch} "
                    f"(rebuild with GPU_ARCHS={arch})"]
        return HeadDimBuckets.of(lib).missing(problem.head_dim_padded, problem.head_dim_v_padded)

    @property
    def lib(self):
        """The loaded library; resolved at the first kernel call, so plans need no ROCm machine."""
        lib, reason = self._resolve()
        if lib is None:
            raise CkError(f"the CK backend cannot run: {reason}")
        return lib

    def forward(self, problem: AttentionProblem, params: AttentionParams,
                out: torch.Tensor, lse: torch.Tensor) -> None:
        if problem.varlen:
            check_seqlens_on_device(problem, params)
        args = attention_args(problem, params, out, lse)
        self._launch("fack_fwd", self.lib.fack_fwd, args, problem.device)
        # CK writes lse = -inf for a row that sees no key; flash-attn's convention (and what keeps
        # exp(s - lse) at 0, not NaN, in the backward) is +inf.
        lse.masked_fill_(lse == float("-inf"), float("inf"))

    def key_tile(self, problem: AttentionProblem) -> int | None:
        """kN0 of the dq_dk_dv instance the library will run for `problem` (its `fack_bwd_tile`), or
        None where no library is loaded (plans on machines without ROCm: CK's gfx942 table then)."""
        lib = self._resolve()[0]
        if lib is None or problem.device.type not in self.device_types:
            return None
        kn0 = ctypes.c_int32(0)
        args = tile_query_args(problem)
        arch = self._device_arch(problem.device)
        status = lib.fack_bwd_tile(ctypes.byref(args), arch.encode(), ctypes.byref(kn0))
        if status != 0:
            raise CkError(f"fack_bwd_tile: {STATUS_NAMES.get(status, f'status {status}')}: "
                          f"{lib.fack_last_error().decode()}")
        return kn0.value

    def backward_plan(self, problem: AttentionProblem) -> WorkspacePlan:
        return ck_backward_plan(problem, self.name, kn0=self.key_tile(problem))

    def backward(self, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor, workspace: dict[str, torch.Tensor]) -> None:
        if lse.stride() != workspace["softmax_d"].stride():
            lse = lse.contiguous()      # CK reads lse and D with one set of strides (D is contiguous)
        if problem.varlen:
            check_seqlens_on_device(problem, params)
            # CK's group-mode dq_dk_dv returns before its dK/dV epilogue for a sequence with
            # seqlen_q == 0 or seqlen_k == 0, and no kernel visits rows past cu_seqlens[-1]: those
            # rows would keep whatever the buffers held. Zero the targets first (upstream's
            # `zero_tensors`, always on here); CK overwrites every row it computes.
            for name, t in (("dk_expanded", dk), ("dv_expanded", dv)):
                (workspace[name] if problem.is_gqa else t).zero_()
            dq.zero_()
        args = backward_args(problem, params, out, lse, dout, dq, dk, dv, workspace)
        self._launch("fack_bwd", self.lib.fack_bwd, args, problem.device)
        if problem.dropout_p > 0:   # CK's dot_do_o writes D scaled by p_undrop; the package's D is rowsum(dO * O)
            workspace["softmax_d"].div_(1.0 - problem.dropout_p)

    def _launch(self, api: str, fn, args: ctypes.Structure, device: torch.device) -> None:
        if device.type == "cuda":
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device).cuda_stream
                status = fn(ctypes.byref(args), ctypes.c_void_p(stream))
        else:       # a library given to on_library for another device type (the CPU emulation)
            status = fn(ctypes.byref(args), None)
        if status != 0:
            message = self.lib.fack_last_error().decode()
            code = self.lib.fack_last_hip_error()
            if status in (FACK_HIP_ERROR, FACK_LAUNCH_ERROR) and code and self._library is None:
                message += f" ({hip_error_string(code)})"
            raise CkError(f"{api}: {STATUS_NAMES.get(status, f'status {status}')}: {message}")


def check_seqlens_on_device(problem: AttentionProblem, params: AttentionParams) -> None:
    """CK sizes its grids (and the frontend dq_accum) from max_seqlen_q/k on the host but reads each
    sequence's length from cu_seqlens on the device: a longer sequence would have key tiles never
    launched and, deterministic, convert_dq would read splits past dq_accum. On the CPU the values
    are checked before anything runs (core/checks.py); on a GPU reading them would sync, so this
    asserts on the device (torch._assert_async: asynchronous, no host sync; a failure is a device
    assert that the next synchronising call reports, and the HIP context is then unusable). On CPU
    tensors it raises at once (the emulated-CK tests)."""
    if not problem.varlen:
        return
    for cu, longest in zip(params.offsets(), (problem.seqlen_q, problem.seqlen_k)):
        lengths = cu[1:] - cu[:-1]
        torch._assert_async(((lengths >= 0) & (lengths <= longest)).all() & (cu[0] == 0),
                            "cu_seqlens: a sequence longer than max_seqlen (or decreasing offsets)")


BACKEND = CkBackend
