"""Launch specs: what each Triton kernel of this backend is called with, built in one place.

backend.py builds a `LaunchSpec` per kernel call (`forward`, `bwd_preprocess`, `bwd_main`,
`cast_rows` below) and launches it; scripts/triton_compile_check.py builds the same specs from meta
tensors and reads their signatures (`LaunchSpec.signature`), so the two never disagree.

The kernels' arguments are grouped (Triton 3.6 kernels take tuples and named tuples, nested too; each element is
specialised like a scalar argument and the kernel's parameters are the elements in order, so grouping costs no
register and no instruction):
- `seq`, the `SequenceArgs`: the pointers of the score features (cu_seqlens, ALiBi slopes, dropout rng_state);
- `strides`, the `ForwardStrides` or `BackwardStrides` of the call: per tensor a stride tuple, `(batch, row,
  head)` of a (b, s, h, d) tensor or (0, row, head) of a varlen (total, h, d) one (`rows3`), `(batch, head)` of
  lse (`lse_strides`), and last the slopes' batch stride (`slope_batch_stride`);
- the backward's `Gradients` (dq, dk, dv) and `KVAccumulators` (the GQA accumulator epilogue's buffers);
- `sizes`, a `Sizes` (heads, group, max_seqlen_q, max_seqlen_k, head_dim) and `score_args`, a
  `ScoreArgs` (scale, softcap, dropout_p, window_left, window_right): runtime named tuples;
- `features`, the `Features`: one constexpr named tuple of every compile-time flag, read in the kernels
  as `features.HAS_ALIBI`, ... and handed whole to the helpers of scores.py.
Reordering a group's fields reorders the kernel's parameters (and moves ptxas's register allocation): the groups
keep the order of the flat parameters they replaced, so the kernels' machine code did not change with them.

Adding a feature flag: a field of `Features` (default off, so every spec and the compile check
keep compiling), its value where backend.py names the call's flags (`_scores_features`,
`_mask_args`), and its use in the kernels. A new runtime value of the scores: a field of
`ScoreArgs`, likewise.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ....core.errors import KernelCompileError
from ..config import Tile
from . import triton_versions


class Features(NamedTuple):
    """The kernels' compile-time flags (constexpr `features`). Each distinct value compiles its own variant."""
    VARLEN: bool = False         # packed (total, h, d) tensors with cu_seqlens; else dense (b, s, h, d)
    TOP_LEFT: bool = False       # mask diagonal aligned top-left (else bottom-right, per sequence)
    HAS_LEFT: bool = False       # the mask has a left (sliding window) bound: window_left
    HAS_RIGHT: bool = False      # the mask has a right bound (causal: 0): window_right
    HAS_ALIBI: bool = False      # subtract slope * |i + shift - j| (seq.slopes, strides.slope_batch)
    HAS_SOFTCAP: bool = False    # score = softcap * tanh(score / softcap)
    HAS_DROPOUT: bool = False    # Philox dropout (rng_state, dropout_p)
    EVEN_K: bool = False         # every key tile is full: no mask branch without a window bound
    USE_TMA: bool = False        # tile stores and adds through TMA descriptors (row_io.py)
    TMA_LOADS: bool = False      # tile loads through TMA descriptors too
    # backward (bwd_main) only
    LOOP_GROUP: bool = False     # a key-tile program loops over its kv head's query heads
    DQ_ATOMIC: bool = False      # dQ added into an fp32 buffer by the key-tile programs (no dQ pass)
    DETERMINISTIC: bool = False  # the GQA accumulator epilogue's adds ordered by semaphores
    DP_FIRST: bool = False       # dO V^T issued before exp2(S - lse) (config.Configs.bwd_dp_first)
    # forward and backward: v's (out's, dO's, dV's) head dim where it is not q/k's, else 0 (scores.value_head_dim: q/k's
    # sizes.head_dim), and its power-of-two block (0: the spec builders make it BLOCK_D). Compile-time: a kernel
    # variant per value head dim; with one head dim the kernels are the one-head-dim kernels, unchanged.
    HEAD_DIM_V: int = 0
    BLOCK_DV: int = 0


@dataclass(frozen=True)     # not a tuple: a kernel reads it as CALL.MASK, which Triton would turn into a plain tuple
class MaskFlags:
    """The mask's compile-time flags as the Gluon kernels take them (`GluonCall.MASK`, read by gluon_common.Mask)."""
    TOP_LEFT: bool = False
    HAS_LEFT: bool = False
    HAS_RIGHT: bool = False


class GluonMask(NamedTuple):
    """A call's mask for the Gluon kernels (gluon_common.Mask): its runtime values, the window bounds (left, right),
    >= 0 (`flags` says which apply), and its compile-time flags."""
    window: tuple[int, int]
    flags: MaskFlags


@dataclass(frozen=True)
class GluonCall:
    """A call's compile-time values beside its tile, as the Gluon kernels take them (constexpr `CALL`; the tile is
    the constexpr `TILE`, the operator's config.FwdWsTile or config.WsTile itself)."""
    HEAD_D: int              # the head dim in shared memory: the power of two at or above head_dim (q/k's first
                             # block where the forward has a tail block)
    VARLEN: bool
    MASK: MaskFlags
    DETERMINISTIC: bool = False     # the backward's dQ adds ordered by semaphores
    QK_TAIL: int = 0         # the forward's q/k tail block's columns (config.fwd_ws_qk_tail; 0: none)


class GluonSizes(NamedTuple):
    """A call's sizes and softmax scale as the Gluon kernels take them (runtime `sizes` of fwd_ws/bwd_ws)."""
    seqlen_q: int        # the longest query sequence (dense: every sequence's length)
    seqlen_k: int
    head_dim: int        # of the rows the kernel writes: q/k's in the backward, out's (v's) in the forward
    group: int           # query heads per kv head
    scale: float         # softmax scale


class Sizes(NamedTuple):
    """Problem sizes (runtime `sizes`). The batch is not one of them: only the backward's epilogue needs it
    (an argument of its own there), and an unused kernel parameter moves ptxas's register allocation."""
    heads: int           # query heads
    group: int           # query heads per kv head
    max_seqlen_q: int
    max_seqlen_k: int
    head_dim: int


class ScoreArgs(NamedTuple):
    """Runtime values of the scores (runtime `score_args`); window bounds are >= 0 (Features says which apply)."""
    scale: float
    softcap: float
    dropout_p: float
    window_left: int
    window_right: int


class SequenceArgs(NamedTuple):
    """Per-call pointers of the score features (runtime `seq`; a dummy tensor where a feature is off)."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    slopes: torch.Tensor
    rng_state: torch.Tensor


def _stride_fields(tensors: tuple[str, ...], tail: tuple[str, ...]) -> list[tuple[str, type]]:
    """`{tensor}_batch`, `_row`, `_head` per tensor (launch.rows3), then `tail`: the fields of a flat stride group."""
    names = [f"{t}_{axis}" for t in tensors for axis in ("batch", "row", "head")] + list(tail)
    return [(name, int) for name in names]


# The stride groups are flat named tuples of ints, not a tuple per tensor: Triton 3.6 loses an int that it
# specialises to the constant 1 (a stride of a size-1 dimension: lse's head stride at s_q = 1) two tuple levels
# down once the group is handed to a helper (scripts/triton_compile_check.py's "ones" variants).
# (mypy reads only a literal field list)
ForwardStrides = NamedTuple("ForwardStrides", _stride_fields(  # type: ignore[misc]
    ("q", "k", "v", "out"), ("lse_batch", "lse_head", "slope_batch")))
ForwardStrides.__doc__ = """The forward's strides (runtime `strides`): `rows3` of q, k, v and out, `lse_strides` of lse,
the slopes' batch stride (slope_batch_stride)."""
BackwardStrides = NamedTuple("BackwardStrides", _stride_fields(  # type: ignore[misc]
    ("q", "k", "v", "dout", "dq", "dk", "dv"), ("kv_acc_batch", "kv_acc_head", "lse_batch", "lse_head", "slope_batch")))
BackwardStrides.__doc__ = """The backward's strides (runtime `strides`): `rows3` of q, k, v, dO and the gradients;
(batch, head) of the fp32 dK/dV accumulators, whose rows are head_dim apart; `lse_strides` of lse (and delta, strided
alike); the slopes' batch stride."""


class Gradients(NamedTuple):
    """What the backward writes (runtime `grads`): dQ (in the atomic mode, features.DQ_ATOMIC, an fp32 buffer laid out
    like q that bwd_postprocess casts), dK and dV."""
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


class KVAccumulators(NamedTuple):
    """The GQA accumulator epilogue's buffers (runtime `kv_acc`, bwd_epilogue.accumulate_kv): fp32 dK and dV and the
    deterministic mode's semaphores; a dummy tensor where the plan has none."""
    dk: torch.Tensor
    dv: torch.Tensor
    semaphores: torch.Tensor


def rows3(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of a q/k/v-like tensor: (b, s, h, d) or varlen (total, h, d)."""
    strides = t.stride()   # one call: this runs ~10 times per backward, on the host-bound path
    assert strides[-1] == 1, "the head dim must be contiguous"
    return (0, strides[0], strides[1]) if varlen else (strides[0], strides[1], strides[2])


def lse_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of an lse-like tensor: (b, h, s_q) or varlen (h, total_q); rows unit."""
    strides = t.stride()
    assert strides[-1] == 1
    return (0, strides[0]) if varlen else (strides[0], strides[1])


def slope_batch_stride(slopes: torch.Tensor, alibi: bool) -> int:
    """The batch stride of ALiBi slopes: (b, h) slopes have one, (h,) slopes (shared by the batch) and a call without
    ALiBi (`slopes` a dummy) 0."""
    return slopes.stride(0) if alibi and slopes.dim() == 2 else 0


def bhr(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, row) strides of a q/k-like tensor."""
    b, r, h = rows3(t, varlen)
    return b, h, r


_NAMED = frozenset(ScoreArgs._fields) | frozenset(Features._fields)


def split_named(named: dict, **flags: bool) -> tuple[ScoreArgs, Features]:
    """The ScoreArgs and Features of a call from backend.py's named values (`_scores_features`,
    `_mask_args`) plus `flags`; names that are neither are an error, so no flag is dropped."""
    assert _NAMED.issuperset(named), f"not a ScoreArgs or Features field: {sorted(set(named) - _NAMED)}"
    assert _NAMED.issuperset(flags), f"not a Features field: {sorted(set(flags) - _NAMED)}"
    scores = ScoreArgs._make([named[f] for f in ScoreArgs._fields])
    values = {**named, **flags}   # (on the host-bound launch path: no keyword construction)
    return scores, Features._make([values.get(f, False) for f in Features._fields])


# ---- the spec --------------------------------------------------------------------------------------

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.int8: "i8"}


def _type_of(value: Any) -> Any:
    """Triton's signature type of a runtime argument (unspecialised: every int is i32)."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, tuple):
        types = [_type_of(v) for v in value]
        return type(value)(*types) if hasattr(value, "_fields") else tuple(types)
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32"
    if isinstance(value, float):
        return "fp32"
    if hasattr(value, "block_shape"):   # a host TMA descriptor
        from triton.runtime.jit import mangle_type
        return mangle_type(value)
    raise TypeError(f"no Triton type for {type(value).__name__}")


@dataclass(frozen=True)
class LaunchSpec:
    """One kernel call: `kernel[grid](*args.values(), num_warps=, num_stages=, **options)`. `args` holds every
    parameter of the kernel by name, in its order (runtime values, then the constexprs); `options`: further
    compile options (maxnreg). Gluon kernels have no software pipeliner: their num_stages is Triton's default."""
    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int
    num_stages: int = 3
    options: dict[str, Any] = field(default_factory=dict)

    def launch(self) -> None:
        launch_kernel(self.kernel, self.grid, tuple(self.args.values()), self.num_warps, self.num_stages,
                      self.options)

    def signature(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(signature, constexprs) for triton.compiler.ASTSource, from the kernel's parameters."""
        names = self.kernel.arg_names
        assert list(self.args) == names, f"{self.kernel.__name__}: spec {list(self.args)} != kernel {names}"
        sig, constexprs = {}, {}
        for param in self.kernel.params:
            value = self.args[param.name]
            if param.is_constexpr or value is None:   # Triton specialises a None argument as a constexpr
                sig[param.name] = "constexpr"
                constexprs[param.name] = value
            else:
                sig[param.name] = _type_of(value)
        return sig, constexprs


# ---- launching: the compiled kernel looked up once per specialisation ---------------------------------

class _Kernel:
    """What launches of one kernel share: its parameters' specialisation flags (per parameter: constexpr, then
    `native_specialize_impl`'s is_const, specialise, align) and its compiled variants by key."""
    __slots__ = ("compiled", "kernel", "params")

    def __init__(self, kernel):
        self.kernel = kernel
        self.params = tuple((p.is_constexpr, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                            for p in kernel.params)
        # (warps, stages, compile options, debug knobs, device, each argument's specialisation) -> CompiledKernel
        self.compiled: dict[tuple, Any] = {}


# While a backend method is recorded for replay (replay.py), on this thread: `launches`, the list its launches are
# appended to, `(compiled kernel, grid, args)`, or None for a launch that cannot be replayed; `views`, the views it made
# of its tensors (`derived`).
_RECORDING = threading.local()


def derived(view: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`view`, a view the caller made of `source` (a slice of its heads, a prefix) whose offset, shape and strides
    follow from `source`'s layout alone; while a replay is recorded it is noted, so that a replay re-issues the launch
    at the same offset of the later call's tensor in `source`'s role (replay.py)."""
    views = getattr(_RECORDING, "views", None)
    if views is not None:
        views[id(view)] = (view, source)
    return view


# id(kernel) -> _Kernel (which holds the kernel, so the id is not reused); an int hashes in C, while a JITFunction
# hashes in Python under a lock
_KERNELS: dict[int, _Kernel] = {}
# (knobs, triton.runtime, native_specialize_impl), imported on the first launch
_TRITON: tuple[Any, Any, Any] | None = None


def _triton():
    global _TRITON, _DIRECT
    if _TRITON is None:
        import triton.runtime
        from triton import knobs
        _DIRECT = triton_versions.launch_path_refusal() is None
        specialize = None
        if _DIRECT:
            from triton.runtime.jit import native_specialize_impl as specialize
        _TRITON = knobs, triton.runtime, specialize
    return _TRITON


# Whether launch_kernel launches compiled kernels itself (the private APIs it reads are as it reads them:
# triton_versions.launch_path_refusal); otherwise every launch goes through `kernel[grid](...)`.
_DIRECT = True


_COMPILER_OUTPUT_LOCK = threading.Lock()


@contextlib.contextmanager
def compiler_output_held(kernel):
    """Around a launch that may compile `kernel`: what the compiler writes to the process's stderr (MLIR's C++
    diagnostics go to file descriptor 2, past Python) is held back, then written out where the block succeeds; a
    compiler failure becomes a KernelCompileError with the first error line. Errors of the launch itself (CUDA
    errors, bad arguments) pass unchanged."""
    with _COMPILER_OUTPUT_LOCK, tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        except Exception as error:
            output = _restore_stderr(saved, held)
            if _is_compile_failure(error):
                name = getattr(kernel, "__name__", str(kernel))
                raise KernelCompileError(name, f"Triton {triton_versions.installed()}", _first_error(error, output),
                                         f"{output}\n{error}") from None
            sys.stderr.write(output)
            raise
        except BaseException:       # an interrupt: what was held is shown
            sys.stderr.write(_restore_stderr(saved, held))
            raise
        else:
            sys.stderr.write(_restore_stderr(saved, held))
        finally:
            os.close(saved)


def _restore_stderr(saved: int, held) -> str:
    """File descriptor 2 back to `saved`; what was written to `held` meanwhile."""
    sys.stderr.flush()
    os.dup2(saved, 2)
    held.seek(0)
    return held.read().decode(errors="replace")


def _is_compile_failure(error: BaseException) -> bool:
    """Whether an error of a launch came from compiling the kernel, not from running it: Triton's front end
    (CompilationError), an MLIR pass pipeline ('PassManager::run failed'), or any error raised inside Triton's own
    Python code other than its launcher (the JIT's reading of the kernel's globals: 'Unsupported function
    referenced'; a kernel that needs more shared memory than the GPU has: OutOfResources)."""
    from triton.compiler.errors import CompilationError
    if isinstance(error, CompilationError) or "PassManager::run failed" in str(error):
        return True
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = frame.tb_frame.f_code.co_filename if frame is not None else ""
    import triton
    package = os.path.dirname(os.path.abspath(triton.__file__)) + os.sep
    return where.startswith(package) and not where.endswith("driver.py")



def _first_error(error: BaseException, output: str) -> str:
    """The first line of the compiler's output that says `error:` (without its source position), else the error's
    own first line."""
    for line in output.splitlines():
        if " error: " in line:
            return line.split(" error: ", 1)[1].strip()
    from triton.compiler.errors import CompilationError
    if isinstance(error, CompilationError):
        lines = [line for line in str(error).splitlines() if line.strip()]
        return lines[-1].strip() if lines else type(error).__name__
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def launch_kernel(kernel, grid: tuple[int, ...], args: tuple, num_warps: int, num_stages: int,
                  options: dict[str, Any] | None = None) -> None:
    """`kernel[grid](*args, num_warps=, num_stages=, **options)`, through the compiled kernel's launcher
    directly once Triton has compiled this specialisation. Triton's `run` binds the arguments into a dict,
    builds a cache key with `str(options)`, checks the kernel's globals and builds launch metadata on every
    call; here the key is Triton's own specialisation of each runtime argument (`native_specialize_impl`, the
    C++ function its binder calls: dtype, 16-byte alignment, ints == 1 and % 16, descriptors' blocks and
    layouts), the constexprs and compile options by value and the debug knobs, and the first launch of each
    key goes through `run` (so Triton compiles what it would). Launch hooks (profilers), the interpreter,
    unhashable arguments and a Triton whose private APIs moved (triton_versions.launch_path_refusal) take Triton's
    path. A compiler failure is a KernelCompileError (compiler_output_held). Not re-checked on a hit: the kernel's
    globals (constants of the modules, fixed once imported)."""
    knobs, runtime_module, specialize = _triton()
    recorded = getattr(_RECORDING, "launches", None)
    entry = _KERNELS.get(id(kernel))
    runtime = knobs.runtime
    interpreted = entry is None and getattr(kernel, "params", None) is None     # TRITON_INTERPRET=1's kernels
    if interpreted or not _DIRECT or _installed(runtime.launch_enter_hook) or _installed(runtime.launch_exit_hook):
        with compiler_output_held(kernel):
            kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **(options or {}))
        if recorded is not None:
            recorded.append(None)
        return
    if entry is None:
        entry = _KERNELS[id(kernel)] = _Kernel(kernel)
    driver = runtime_module.driver.active
    device = driver.get_current_device()
    backend = kernel.device_caches[device][3]
    key: Any = (num_warps, num_stages, tuple(options.items()) if options else (), runtime.debug,
           knobs.compilation.instrumentation_mode, device,
           *[a if constexpr else specialize(backend, a, is_const, specialise, align)
             for a, (constexpr, is_const, specialise, align) in zip(args, entry.params)])
    try:
        compiled = entry.compiled.get(key)
    except TypeError:       # an unhashable constexpr: nothing to keep
        compiled = key = None
    if compiled is None:
        with compiler_output_held(kernel):
            compiled = kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **(options or {}))
        if key is not None:
            entry.compiled[key] = compiled
    else:
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     driver.get_current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args)
    if recorded is not None:
        recorded.append((compiled, grid, args) if key is not None else None)


def hooked() -> bool:
    """Whether a launch hook (a profiler's) is installed."""
    runtime = (_TRITON or _triton())[0].runtime
    return _installed(runtime.launch_enter_hook) or _installed(runtime.launch_exit_hook)


def _installed(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))    # triton 3.6 keeps an empty HookChain


def current_device_and_stream() -> tuple[int, int]:
    """Triton's current device and its current stream (what launch_kernel launches on): the active driver's
    `get_current_device` and `get_current_stream`, as Triton's own launch reads them."""
    driver = (_TRITON or _triton())[1].driver.active
    device = driver.get_current_device()
    return device, driver.get_current_stream(device)


# ---- the kernels' specs --------------------------------------------------------------------------

def _with_value_block(features: Features, block_d: int) -> Features:
    """`features` with v's head block: its own, else block_d (the backend names it: no copy on its launch path)."""
    return features if features.BLOCK_DV else features._replace(BLOCK_DV=block_d)


def forward(q, k, v, out, lse, seq: SequenceArgs, sizes: Sizes, scores: ScoreArgs, features: Features,
            tile: Tile, block_d: int, grid: tuple[int, int], sink: torch.Tensor | None = None) -> LaunchSpec:
    """The one-launch forward; `sink`: fp32 (h,) logits taken into each row's softmax, or None (a constexpr None: the
    kernel compiles without it)."""
    from ..one_launch.forward import attn_fwd_kernel
    features = _with_value_block(features, block_d)
    varlen = features.VARLEN
    strides = ForwardStrides(*rows3(q, varlen), *rows3(k, varlen), *rows3(v, varlen), *rows3(out, varlen),  # type: ignore[call-arg]
                             *lse_strides(lse, varlen), slope_batch_stride(seq.slopes, features.HAS_ALIBI))
    return LaunchSpec(attn_fwd_kernel, grid, dict(
        Q=q, K=k, V=v, Out=out, Lse=lse, seq=seq, strides=strides, sizes=sizes, score_args=scores, Sink=sink,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_D=block_d, features=features),
        tile.num_warps, tile.num_stages)


def bwd_preprocess(out, dout, delta, zero: tuple[torch.Tensor | None, ...], batch: int,
                   sizes: Sizes, varlen: bool, block_d: int, block_m: int = 64,
                   value: tuple[int, int] | None = None) -> LaunchSpec:
    """delta = rowsum(dO * O) into `delta` (over v's head dim: `value` = (head dim, block) where it is not q/k's,
    Features.HEAD_DIM_V and BLOCK_DV); zero the buffers of `zero` (dq, dk, dv accumulators, semaphores; None where
    the plan has none)."""
    head_dim, block_d = (sizes.head_dim, block_d) if value is None else value
    from .bwd_preprocess import ZERO_BLOCK, bwd_preprocess_kernel
    # A varlen call's delta is per packed row whichever sequence holds it: one grid over the rows, as one batch entry,
    # not batch x tiles(max_seqlen) programs that mostly exit (9x as many on a 38-document pack). Rows in no
    # sequence get a value the pipeline's outside-rows fill then replaces.
    rows, batch = (out.shape[0], 1) if varlen else (sizes.max_seqlen_q, batch)
    grid = (max(1, -(-rows // block_m)), batch * sizes.heads)
    return LaunchSpec(bwd_preprocess_kernel, grid, dict(
        Out=out, dOut=dout, Delta=delta,
        stride_o=rows3(out, varlen), stride_do=rows3(dout, varlen), stride_delta=lse_strides(delta, varlen),
        heads=sizes.heads, n_rows=rows, head_dim=head_dim,
        zero_ptrs=tuple(t if t is not None else delta for t in zero),
        zero_numels=tuple(t.numel() if t is not None else 0 for t in zero),
        BLOCK_M=block_m, BLOCK_D=block_d, ZERO_BLOCK=ZERO_BLOCK,
        ZERO=tuple(t is not None for t in zero)), 4, 1)


def bwd_main(q, k, v, dout, lse, delta, dq, dk, dv, dk_acc, dv_acc, sems, seq: SequenceArgs, batch: int,
             sizes: Sizes, scores: ScoreArgs, features: Features, kv: Tile, dq_tile: Tile, block_d: int,
             grid: tuple[int, int]) -> LaunchSpec:
    """The backward's one launch (bwd_main.attn_bwd_kernel). dq is the fp32 accumulator in the atomic
    mode; dk_acc/dv_acc/sems are None where the plan has none (always with features.HEAD_DIM_V: the accumulators have
    one row width)."""
    from ..one_launch.bwd_main import attn_bwd_kernel
    assert features.LOOP_GROUP or not features.HEAD_DIM_V, "the dK/dV accumulators have q/k's head dim only"
    features = _with_value_block(features, block_d)
    varlen, d = features.VARLEN, sizes.head_dim
    total_k = dk.shape[0] if varlen else sizes.max_seqlen_k
    heads_k = sizes.heads // sizes.group
    acc_strides = (0, total_k * d) if varlen else (heads_k * sizes.max_seqlen_k * d, sizes.max_seqlen_k * d)
    strides = BackwardStrides(*rows3(q, varlen), *rows3(k, varlen), *rows3(v, varlen), *rows3(dout, varlen),  # type: ignore[call-arg]
                              *rows3(dq, varlen), *rows3(dk, varlen), *rows3(dv, varlen), *acc_strides,
                              *lse_strides(lse, varlen), slope_batch_stride(seq.slopes, features.HAS_ALIBI))
    kv_acc = KVAccumulators(dk_acc if dk_acc is not None else delta, dv_acc if dv_acc is not None else delta,
                            sems if sems is not None else delta)
    return LaunchSpec(attn_bwd_kernel, grid, dict(
        Q=q, K=k, V=v, dOut=dout, Lse=lse, Delta=delta, grads=Gradients(dq, dk, dv), kv_acc=kv_acc, seq=seq,
        strides=strides, batch=batch, sizes=sizes, score_args=scores, BLOCK_M=kv.block_m, BLOCK_N=kv.block_n,
        DQ_BLOCK_M=dq_tile.block_m, DQ_BLOCK_N=dq_tile.block_n, BLOCK_D=block_d, features=features),
        kv.num_warps, kv.num_stages)


def cast_rows(src, dst, src_bhr, dst_bhr, heads: int, batch: int, rows: int, block_d: int,
              head_dim: int) -> LaunchSpec:
    """fp32 accumulator -> output dtype (bwd_postprocess.cast_rows_kernel)."""
    from .bwd_postprocess import cast_rows_kernel
    return LaunchSpec(cast_rows_kernel, (-(-rows // 64), heads, batch), dict(
        Src=src, Dst=dst, stride_src=tuple(src_bhr), stride_dst=tuple(dst_bhr), n_rows=rows, head_dim=head_dim,
        BLOCK_R=64, BLOCK_D=block_d), 4, 1)


def zero_flat(*buffers: torch.Tensor) -> LaunchSpec:
    """Zero contiguous `buffers` in one launch (bwd_postprocess.zero_kernel): a kernel, not a torch fill, so that a
    replay can re-issue it."""
    from .bwd_postprocess import zero_kernel
    from .bwd_preprocess import ZERO_BLOCK
    assert all(t.is_contiguous() for t in buffers), "zero_flat zeroes whole contiguous buffers"
    programs = max(1, min(65535, -(-max(t.numel() for t in buffers) // (16 * ZERO_BLOCK))))
    return LaunchSpec(zero_kernel, (programs,), dict(
        buffers=buffers, numels=tuple(t.numel() for t in buffers), ZERO_BLOCK=ZERO_BLOCK, COUNT=len(buffers)), 4, 1)


def fill_outside(fills: tuple[tuple[torch.Tensor, torch.Tensor, int, float], ...]) -> LaunchSpec | None:
    """Every `(cu_seqlens, t, dim, value)` fill of a call (Backend.fill_outside_sequences) in one launch of
    outside_rows.fill_outside_kernel (at most two offset tensors: the call's cu_seqlens_q and _k); None when
    no tensor has rows."""
    from .outside_rows import BLOCK_I, BLOCK_R, fill_outside_kernel, target
    cu_q = fills[0][0]
    cu_k = next((cu for cu, *_ in fills if cu is not cu_q), cu_q)
    assert all(cu is cu_q or cu is cu_k for cu, *_ in fills), "at most two offset tensors per launch"
    chosen = [(cu is not cu_q, target(t, dim, value)) for cu, t, dim, value in fills if t.numel()]
    if not chosen:
        return None
    rows = max(t.rows for _, t in chosen)
    inner = max(t.inner_a * t.inner_b for _, t in chosen)
    return LaunchSpec(fill_outside_kernel, (-(-rows // BLOCK_R), len(chosen), -(-inner // BLOCK_I)), dict(
        targets=tuple(t for _, t in chosen), cu_seqlens_q=cu_q, last_q=cu_q.shape[0] - 1, cu_seqlens_k=cu_k,
        last_k=cu_k.shape[0] - 1, USES_K=tuple(uses_k for uses_k, _ in chosen), BLOCK_R=BLOCK_R,
        BLOCK_I=BLOCK_I), 4, 1)
