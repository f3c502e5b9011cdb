"""Whether this tree's Triton backend makes the same kernel launches as another tree's, call for call, without a GPU.

    git archive REV flash_attn_ck | tar -x -C /tmp/old
    python3 scripts/launch_compare.py /tmp/old [NAME_PART ...]

Runs a grid of calls (`calls`: forward and backward of every Triton operator and mode: the warp-specialised Gluon
kernels and the one-launch ones, head dims 32..256 with odd ones, MHA and GQA, each mask, ALiBi, softcap, dropout,
sinks, dense and varlen with empty sequences, s_q != s_k, deterministic, a workspace cap, d_v != d) through the public
API (flash_attn_func, the varlen and packed forms, and flash_attn_fwd / flash_attn_bwd into given gradients, fp32
results among them) with the Triton backend on CPU tensors that pretend to be on an sm_90 GPU (`pretend_sm90`), each
call twice, so that the second runs through the launch memo and the replay (each launch says which path issued it:
Triton's own run, the backend's direct launcher, or a replay). Nothing runs: Triton's compile step
(`JITFunction._do_compile`, below both trees' own launch code) returns a stand-in whose launcher records the launch
(`record_launches`), so Triton's own argument binding and specialisation run, and every later launch, through
Triton's `run`, launch.py's direct path or a replay, reaches the same recorder. Each launch becomes a record without
addresses (`_Recorder.launch`): the kernel's name, grid, num_warps/num_stages and other compile options, every
argument by the kernel's parameter name (tensors as the call's buffer they lie in, q, k, v, out, lse, dq, ... or
`buf<i>` by first use, with byte offset, shape, strides and dtype; a pointer passed as an address as its buffer and
offset; TMA descriptors with their boxes; scalars and constexprs by value), and per call how each launched buffer was
allocated and which torch fills wrote it. Outputs are garbage: only the launches are compared.

Each tree's grid runs in a subprocess with that tree first on sys.path (this file is run with PYTHONPATH=TREE and
`--dump`); the two runs' records are compared call by call: `N calls identical, M differ`, then each difference. A call
only this tree can make (d_v != d) is listed as new. Exits 1 if any call differs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

# ---- pretending to be an sm_90 GPU ----------------------------------------------------------------------------

_REAL_DEVICE = torch._C.TensorBase.device.__get__      # type: ignore[attr-defined]
_CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")


def _on_cpu(value):
    """`value` with a CUDA device (a torch.device or its name) replaced by the CPU."""
    if isinstance(value, torch.device) and value.type == "cuda":
        return _CPU
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    return value


class _FakeDriver:
    """Triton's active driver on an sm_90 GPU: device 0, stream 0."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def pretend_sm90():
    """Within the block CPU tensors say they are on CUDA device 0 of compute capability 9.0 (`Tensor.device`,
    `is_cuda`), CUDA allocations land on the CPU (`_Buffers`), torch.cuda answers as on an H100, Triton's driver is
    `_FakeDriver` and the Triton backend accepts the tensors (`device_types`). What the backends decide from the device
    is then what they decide on the GPU, in any tree (nothing of the package is patched but that class attribute)."""
    from triton.runtime.jit import driver

    from flash_attn_ck.backends.triton import TritonBackend
    patches = [(torch.Tensor, "device", property(lambda t: _CUDA if _REAL_DEVICE(t).type == "cpu"
                                                 else _REAL_DEVICE(t))),
               (torch.Tensor, "is_cuda", property(lambda t: True)),
               (torch.cuda, "is_available", lambda: True),
               (torch.cuda, "_lazy_init", lambda: None),
               (torch.cuda, "current_device", lambda: 0),
               (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
               (TritonBackend, "device_types", frozenset({"cuda", "cpu"}))]
    saved = [(owner, name, owner.__dict__.get(name, _ABSENT)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    active = driver._active
    driver.set_active(_FakeDriver())
    try:
        yield
    finally:
        driver._active = active
        for owner, name, value in saved:
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


_ABSENT = object()

# ---- recording the launches -------------------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class _Buffers(torch.utils._python_dispatch.TorchDispatchMode):
    """What torch does to memory during a call: each new storage (by address) numbered in allocation order with the
    operation that made it, and the in-place operations (fills, copies) on each."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args = [_on_cpu(a) for a in args]
        kwargs = {name: _on_cpu(value) for name, value in (kwargs or {}).items()}
        if func.namespace == "flash_attn_ck":       # its implementation's operations seen too
            with self:
                return func.redispatch(_CPU_KEYS, *args, **kwargs)
        result = func(*args, **kwargs)
        if func.is_view:
            return result
        schema = func._schema
        written = [a for a, arg in zip(args, schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write
                   and isinstance(a, torch.Tensor)]
        for t in written:
            self.recorder.wrote(t, func.__name__)
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for t in outputs:
            if isinstance(t, torch.Tensor) and not any(t is w for w in written):
                self.recorder.allocated(t, func.__name__)
        return result


# allocations of uninitialised memory: one kind
_UNINITIALISED = frozenset({"empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
                            "new_empty_strided.default"})


class _Recorder:
    """The launches of one call, and the buffers they take."""

    def __init__(self):
        self.launches: list[dict] = []
        self.live: dict[int, tuple[int, int]] = {}       # storage address -> (serial, bytes)
        self.serial = 0
        self.made: dict[tuple[int, int], tuple[str, list]] = {}     # (address, serial) -> (how, fills)
        self.named: dict[tuple[int, int], str] = {}
        self.used: list[tuple[int, int]] = []               # buffers in order of first use by a launch

    def name(self, t: torch.Tensor, name: str) -> None:
        """A tensor of the call's own (an input or an output) by its role."""
        self.named.setdefault(self._buffer(t), name)

    def allocated(self, t: torch.Tensor, how: str) -> None:
        address = _storage_key(t)
        self.serial += 1
        self.live[address] = (self.serial, t.untyped_storage().nbytes())
        how = "empty" if how in _UNINITIALISED else how
        self.made[(address, self.serial)] = (f"{how} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}", [])

    def wrote(self, t: torch.Tensor, how: str) -> None:
        key = self._buffer(t)
        self.made.setdefault(key, ("given", []))[1].append(how)

    def _buffer(self, t: torch.Tensor) -> tuple[int, int]:
        address = _storage_key(t)
        if address not in self.live:
            self.serial += 1
            self.live[address] = (self.serial, t.untyped_storage().nbytes())
        return address, self.live[address][0]

    def _at(self, address: int) -> tuple[tuple[int, int], int]:
        """The buffer holding a device address, and the offset into it."""
        for start, (serial, size) in self.live.items():
            if start <= address < start + max(size, 1):
                return (start, serial), address - start
        raise LookupError(f"address {address:#x} is in no buffer of the call")

    def _use(self, key: tuple[int, int]) -> tuple[int, int]:
        if key not in self.used:
            self.used.append(key)
        return key

    def value(self, value: Any, kind: Any) -> Any:
        """An argument without addresses (`kind`: its signature type, nested like it)."""
        if isinstance(value, torch.Tensor):
            key = self._use(self._buffer(value))
            return {"tensor": key, "offset": value.storage_offset() * value.element_size(),
                    "shape": list(value.shape), "stride": list(value.stride()),
                    "dtype": str(value.dtype).removeprefix("torch.")}
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(kind, str) and kind.startswith("*"):
            key, offset = self._at(value)
            return {"address": self._use(key), "offset": offset}
        if hasattr(value, "block_shape") and hasattr(value, "base"):      # a host TMA descriptor
            fields = {name: self.value(v, "*") if name == "base" else _plain(v) for name, v in vars(value).items()}
            return {"descriptor": type(value).__name__, **fields}
        if isinstance(value, (tuple, list)):
            kinds = kind if isinstance(kind, (tuple, list)) and len(kind) == len(value) else [None] * len(value)
            values = [self.value(v, k) for v, k in zip(value, kinds)]
            if hasattr(value, "_fields"):
                return {"type": type(value).__name__, **dict(zip(value._fields, values))}
            return values
        return _plain(value)

    def launch(self, kernel, options, signature: dict, grid, args, through: str) -> None:
        """A launch as the GPU gets it: the runtime arguments in the kernel's order (each leaf of a tuple argument,
        by its path), the compile-time ones by the name of each leaf (`BLOCK_M`, a tile's `block_m`, a flag of
        `features` or of a mask), so that regrouping the arguments (which leaves the PTX as it was) changes no
        record."""
        assert len(kernel.params) == len(args), f"{kernel.__name__}: {len(args)} arguments"
        runtime: list = []
        constexprs: dict[str, Any] = {}
        for param, arg in zip(kernel.params, args):
            value = self.value(arg, signature.get(param.name))
            for path, leaf in _leaves(param.name, value):
                if param.is_constexpr or arg is None:       # Triton specialises a None argument as a constant
                    name = path.rsplit(".", 1)[-1].upper()
                    constexprs[name if constexprs.get(name, leaf) == leaf else path] = leaf
                else:
                    runtime.append([path, leaf])
        self.launches.append({
            "kernel": kernel.__name__, "grid": list(grid), "through": through,
            "options": {name: _plain(getattr(options, name)) for name in _OPTIONS if hasattr(options, name)},
            "runtime": runtime, "constexprs": dict(sorted(constexprs.items()))})

    def finish(self) -> dict:
        """The call's record: buffers named (the call's own by role, the rest `buf<i>` in order of first use)."""
        names = dict(self.named)
        for key in self.used:
            if key not in names:
                names[key] = f"buf{sum(n.startswith('buf') for n in names.values())}"

        def rename(value):
            if isinstance(value, dict):
                return {k: names[tuple(v)] if k in ("tensor", "address") else rename(v) for k, v in value.items()}
            if isinstance(value, list):
                return [rename(v) for v in value]
            return value
        buffers = {names[key]: {"made": self.made.get(key, ("given", []))[0],
                                "written": self.made.get(key, ("given", []))[1]}
                   for key in self.used}
        return {"launches": rename(self.launches), "buffers": buffers}


def _leaves(path: str, value: Any):
    """(path, leaf) of each leaf of an argument's record: named tuples and dataclasses by field, lists by index;
    a tensor, an address or a descriptor is a leaf."""
    if isinstance(value, dict) and "type" in value:
        for name, field_value in value.items():
            if name != "type":
                yield from _leaves(f"{path}.{name}", field_value)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(f"{path}[{index}]", item)
    else:
        yield path, value


# the compile options a launch's record keeps (CUDAOptions)
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
            "launch_pdl")


def _plain(value: Any) -> Any:
    """A JSON value of a scalar or constexpr argument, without addresses."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {"type": type(value).__name__, **{f: _plain(v) for f, v in zip(value._fields, value)}}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__,
                **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if hasattr(value, "value") and type(value).__name__ == "constexpr":
        return _plain(value.value)
    return repr(value)


_CURRENT: list[_Recorder] = []
_IN_TRITON_RUN: list[bool] = []     # within Triton's own `JITFunction.run`
_IN_REPLAY: list[bool] = []         # within the backend's `Replay.run`


class _StandIn:
    """A compiled kernel that never ran: its launcher records the launch with the current call's recorder."""

    def __init__(self, kernel, options, signature):
        self.kernel, self.options, self.signature = kernel, options, signature
        self.function, self.packed_metadata = None, None

    def launch_metadata(self, *args):
        return None

    def run(self, grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter, exit, *args):
        _CURRENT[-1].launch(self.kernel, self.options, self.signature, (grid_x, grid_y, grid_z), args,
                            "triton" if _IN_TRITON_RUN else "replay" if _IN_REPLAY else "launcher")


@contextlib.contextmanager
def record_launches():
    """Within the block Triton compiles nothing: a kernel's first launch of each specialisation gets a `_StandIn`; a
    launch re-issued by the backend's replay (its module where this tree keeps it) is told from a direct one."""
    from triton.runtime.jit import JITFunction
    replay = _replay_module()

    def stand_in(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _StandIn(self, options, signature)
        self.device_caches[device][0][key] = kernel
        return kernel
    real, real_run = JITFunction._do_compile, JITFunction.run
    real_replay = replay.Replay.run if replay else None
    JITFunction._do_compile, JITFunction.run = stand_in, _marking(_IN_TRITON_RUN, real_run)
    if replay:
        replay.Replay.run = _marking(_IN_REPLAY, real_replay)
    try:
        yield
    finally:
        JITFunction._do_compile, JITFunction.run = real, real_run
        if replay:
            replay.Replay.run = real_replay


def _marking(marks: list, method):
    """`method` that keeps a mark on `marks` while it runs (which path a launch inside it came through)."""
    def marked(self, *args, **kwargs):
        marks.append(True)
        try:
            return method(self, *args, **kwargs)
        finally:
            marks.pop()
    return marked


def _replay_module():
    """The Triton backend's replay module, where a tree keeps it (None: a tree without one)."""
    for name in ("flash_attn_ck.backends.triton.runtime.replay", "flash_attn_ck.backends.triton.replay"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    return None


# ---- the calls ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    d: int = 64
    d_v: int | None = None
    heads: tuple[int, int] = (4, 4)
    batch: int = 2
    seqlens: tuple[int, int] = (256, 256)
    varlen: tuple[tuple[int, int], ...] | None = None     # (s_q, s_k) per sequence
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    alibi: bool = False
    softcap: float = 0.0
    dropout: float = 0.0
    sink: bool = False
    deterministic: bool = False
    dtype: str = "bfloat16"
    backend: dict = dataclasses.field(default_factory=dict, hash=False)   # TritonBackend settings
    workspace_cap: int | None = None
    packed: bool = False        # q, k, v as views of one (b, s, 3, h, d) tensor (flash_attn_qkvpacked_func)
    ops: bool = False           # flash_attn_fwd, then flash_attn_bwd into given dq, dk, dv (the ops' own path)
    out_dtype: str | None = None


# The Triton backend's settings (operators): each of the grid's calls is made under each.
OPERATORS: dict[str, dict[str, Any]] = {
    "default": {}, "one_launch": dict(ws=False, fwd_ws=False), "ws": dict(ws=True, fwd_ws=True),
    "atomic_dq": dict(ws=False, fwd_ws=False, dq_mode="atomic"), "tma": dict(ws=False, fwd_ws=False, use_tma=True),
    "accumulate": dict(ws=False, fwd_ws=False, gqa_epilogue="accumulate")}
MASKS: dict[str, dict[str, Any]] = {"plain": {}, "causal": dict(causal=True), "window": dict(window=(64, 16))}
# (s_q, s_k) per sequence of the varlen calls: empty query and key sequences among them
VARLEN = ((100, 90), (0, 17), (300, 300), (5, 0), (64, 200))
FEATURES: dict[str, dict[str, Any]] = {
    "sq-ne-sk": dict(seqlens=(100, 333), causal=True), "sq1": dict(seqlens=(1, 77)),
    "alibi": dict(alibi=True, causal=True), "softcap": dict(softcap=30.0, window=(40, 0)),
    "dropout": dict(dropout=0.1, causal=True), "sink": dict(sink=True, causal=True),
    "deterministic": dict(deterministic=True, causal=True), "fp16": dict(dtype="float16", causal=True),
    "everything": dict(alibi=True, softcap=20.0, dropout=0.2, window=(50, 7), seqlens=(200, 150)),
    "varlen-everything": dict(varlen=VARLEN, alibi=True, softcap=20.0, dropout=0.2, window=(50, 7)),
    "packed": dict(packed=True, causal=True), "ops": dict(ops=True, dropout=0.1, causal=True),
    "ops-fp32-out": dict(ops=True, out_dtype="float32", window=(30, 30)),
    "ops-varlen": dict(ops=True, varlen=VARLEN, alibi=True)}


def calls():
    """The grid: every operator and mode of the Triton backend."""
    for op, settings in OPERATORS.items():
        for d in (32, 40, 64, 80, 96, 128, 192, 256):
            for mask, masked in MASKS.items():
                yield Call(f"d{d}-{mask}-{op}", d=d, backend=settings, **masked)
                yield Call(f"d{d}-{mask}-{op}-gqa", d=d, heads=(8, 2), backend=settings, **masked)
        for d in (64, 128, 256):
            for mask, masked in MASKS.items():
                yield Call(f"varlen-d{d}-{mask}-{op}", d=d, heads=(4, 2), varlen=VARLEN, backend=settings, **masked)
                yield Call(f"varlen-d{d}-{mask}-{op}-schedule-off", d=d, heads=(4, 2), varlen=VARLEN,
                           backend=dict(settings, varlen_schedule=False), **masked)
            yield Call(f"varlen-d{d}-{op}-deterministic", d=d, heads=(4, 2), varlen=VARLEN, causal=True,
                       deterministic=True, backend=settings)
        for d in (64, 128):
            for feature, options in FEATURES.items():
                yield Call(f"d{d}-{op}-{feature}", d=d, heads=(8, 2), backend=settings, **options)
            for through_ops in (False, True):      # chunks: by batch entries or kv heads
                yield Call(f"d{d}-{op}{'-ops' * through_ops}-workspace-cap", d=d, heads=(8, 2), seqlens=(512, 512),
                           causal=True, workspace_cap=(d // 64) << 20, ops=through_ops, backend=settings)
        for d, d_v in ((64, 128), (128, 64), (96, 40), (192, 128)):
            yield Call(f"dv-d{d}-v{d_v}-{op}", d=d, d_v=d_v, heads=(8, 2), causal=True, backend=settings)
            yield Call(f"dv-varlen-d{d}-v{d_v}-{op}", d=d, d_v=d_v, heads=(4, 2), varlen=VARLEN, backend=settings)


def _inputs(call: Call, generator: torch.Generator) -> dict[str, Any]:
    dtype = getattr(torch, call.dtype)
    h, h_k = call.heads

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()
    d_v = call.d_v or call.d
    if call.packed:
        tensors = dict(qkv=randn(call.batch, call.seqlens[0], 3, h, call.d))
    elif call.varlen is None:
        b, (s_q, s_k) = call.batch, call.seqlens
        tensors = dict(q=randn(b, s_q, h, call.d), k=randn(b, s_k, h_k, call.d), v=randn(b, s_k, h_k, d_v))
    else:
        cu_q = torch.tensor([0, *torch.tensor([s for s, _ in call.varlen]).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor([s for _, s in call.varlen]).cumsum(0).tolist()], dtype=torch.int32)
        tensors = dict(q=randn(int(cu_q[-1]), h, call.d), k=randn(int(cu_k[-1]), h_k, call.d),
                       v=randn(int(cu_k[-1]), h_k, d_v), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if call.alibi:
        tensors["alibi_slopes"] = torch.rand(h, generator=generator)
    if call.sink:
        tensors["learnable_sink"] = torch.randn(h, generator=generator).requires_grad_()
    return tensors


def _run(call: Call, backend, recorder: _Recorder, seed: int) -> None:
    """One forward and backward of `call` through the public API on `backend`."""
    import flash_attn_ck as fa
    tensors = _inputs(call, torch.Generator().manual_seed(seed))
    for name, t in tensors.items():
        recorder.name(t, name)
    options: dict[str, Any] = dict(dropout_p=call.dropout, causal=call.causal, window_size=call.window,
                                   softcap=call.softcap, alibi_slopes=tensors.get("alibi_slopes"),
                                   deterministic=call.deterministic, backend=backend)
    if "learnable_sink" in tensors:
        options["learnable_sink"] = tensors["learnable_sink"]
    if call.ops:
        _run_ops(call, tensors, options, recorder, seed)
        return
    if call.packed:
        out = fa.flash_attn_qkvpacked_func(tensors["qkv"], **options)
    elif call.varlen is None:
        out = fa.flash_attn_func(tensors["q"], tensors["k"], tensors["v"], **options)
    else:
        lengths_q, lengths_k = zip(*call.varlen)
        out = fa.flash_attn_varlen_func(tensors["q"], tensors["k"], tensors["v"], tensors["cu_seqlens_q"],
                                        tensors["cu_seqlens_k"], max(lengths_q), max(lengths_k), **options)
    recorder.name(out, "out")
    dout = _dout(out, recorder, seed)
    leaves = [t for t in tensors.values() if t.requires_grad]
    grads = torch.autograd.grad(out, leaves, dout)
    for name, grad in zip([n for n, t in tensors.items() if t.requires_grad], grads):
        recorder.name(grad, f"d{name}")


def _dout(out: torch.Tensor, recorder: _Recorder, seed: int) -> torch.Tensor:
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out.dtype)
    recorder.name(dout, "dout")
    return dout


def _run_ops(call: Call, tensors: dict, options: dict, recorder: _Recorder, seed: int) -> None:
    """`call` through flash_attn_fwd and flash_attn_bwd (the workspace cap as max_workspace_bytes)."""
    import flash_attn_ck as fa
    q, k, v = (tensors[name].detach() for name in "qkv")
    if call.varlen is not None:
        lengths_q, lengths_k = zip(*call.varlen)
        options = dict(options, cu_seqlens_q=tensors["cu_seqlens_q"], cu_seqlens_k=tensors["cu_seqlens_k"],
                       max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    out_dtype = getattr(torch, call.out_dtype) if call.out_dtype else None
    out, lse, rng_state = fa.flash_attn_fwd(q, k, v, out_dtype=out_dtype, **options)
    recorder.name(out, "out")
    recorder.name(lse, "lse")
    if out.dtype != q.dtype:        # the backward takes out and dout in q's dtype
        out = out.to(q.dtype)
        recorder.name(out, "out_rounded")
    grads = tuple(torch.empty(t.shape, dtype=out_dtype or t.dtype) for t in (q, k, v))
    for name, grad in zip(("dq", "dk", "dv"), grads):
        recorder.name(grad, name)
    fa.flash_attn_bwd(_dout(out, recorder, seed), q, k, v, out, lse, *grads, rng_state=rng_state,
                      max_workspace_bytes=call.workspace_cap, out_dtype=out_dtype, **options)


@contextlib.contextmanager
def _environment(name: str, value: str | None):
    """Within the block the environment variable `name` is `value` (None: as it was)."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def record(*names: str) -> dict[str, Any]:
    """Every call of the grid whose name contains one of `names` (all by default), run twice: {call: [first record,
    second record]} (a call that raised: its error's first line). Run it in a process of its own: Triton's kernel
    caches and the backend's launch memos keep the stand-ins."""
    from flash_attn_ck.backends.triton import TritonBackend
    records: dict[str, Any] = {}
    with pretend_sm90(), record_launches():
        for call in calls():
            if names and not any(part in call.name for part in names):
                continue
            runs = []
            backend = TritonBackend(**call.backend)     # one instance: its second call finds the first's replay
            for seed in (0, 1):
                recorder = _Recorder()
                _CURRENT.append(recorder)
                # the workspace cap: the ops' max_workspace_bytes, else the environment's
                cap = None if call.ops or call.workspace_cap is None else str(call.workspace_cap)
                try:
                    with _environment("FLASH_ATTN_CK_MAX_WORKSPACE_BYTES", cap), _Buffers(recorder):
                        _run(call, backend, recorder, seed)
                    runs.append(recorder.finish())
                except Exception as error:      # a call one tree refuses: compared like a record
                    runs.append({"error": f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"})
                finally:
                    _CURRENT.pop()
            records[call.name] = runs
    return records


# ---- comparing two trees --------------------------------------------------------------------------------------------


def tree_records(tree: Path, *names: str) -> dict[str, Any]:
    """`record(*names)` of `tree`'s package, in a process of its own."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("FLASH_ATTN_CK_BACKEND", None)
    run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dump", *names], cwd=tree, env=env,
                         capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"recording the launches of {tree} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout)


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """Each place where two records differ, as `where: old -> new`."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in list(old) + [k for k in new if k not in old]:
            if key not in new:
                found.append(f"{where}.{key}: {json.dumps(old[key])[:200]} -> (absent)")
            elif key not in old:
                found.append(f"{where}.{key}: (absent) -> {json.dumps(new[key])[:200]}")
            else:
                found += differences(old[key], new[key], f"{where}.{key}")
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{where}[{i}]")]
    if old != new:
        return [f"{where}: {json.dumps(old)[:300]} -> {json.dumps(new)[:300]}"]
    return []


def _launch_names(run: dict) -> str:
    return " ".join(x["kernel"] for x in run.get("launches", [])) or run.get("error", "(none)")


# Compile-time values this tree's launches pass that OLD_TREE's did not, which change no kernel: (rule, the kernels
# it applies to (None: every kernel), the launch -> {constexpr: the value that leaves the kernel as it was}).
INTENDED = (
    ("v's head dim (Features.HEAD_DIM_V off, BLOCK_DV = BLOCK_D: the one-head-dim kernels)", None,
     lambda launch: {"HEAD_DIM_V": False, "BLOCK_DV": launch["constexprs"].get("BLOCK_D")}),
    ("the backward's whole tile as TILE (split_d: which kernel; max_registers: the maxnreg option)",
     ("attn_bwd_ws_kernel", "attn_bwd_ws_split_kernel"),
     lambda launch: {"SPLIT_D": launch["kernel"] == "attn_bwd_ws_split_kernel",
                     "MAX_REGISTERS": launch["options"].get("maxnreg") or 0}),
    ("GluonCall.DETERMINISTIC off in the forward's CALL (only the backward reads it)", ("attn_fwd_ws_kernel",),
     lambda launch: {"DETERMINISTIC": False}),
    ("WsTile.named_barriers off (the hand-offs by one-thread mbarrier arrives)",
     ("attn_bwd_ws_kernel", "attn_bwd_ws_split_kernel"), lambda launch: {"NAMED_BARRIERS": False}),
    ("FwdWsTile.split_mask off (each key tile tests at run time whether it needs the mask)", ("attn_fwd_ws_kernel",),
     lambda launch: {"SPLIT_MASK": False}),
    ("no learnable sink in the forward kernel (Sink None)", ("attn_fwd_kernel", "attn_fwd_ws_kernel"),
     lambda launch: {"SINK": None}),
)


def _intended(old: dict, new: dict) -> list[str]:
    """Drop from `new` (a launch of this tree) the constexprs that OLD_TREE's launch `old` has not and that an INTENDED
    rule gives the value that leaves the kernel as it was; the rules that did."""
    applied = []
    for rule, kernels, neutral in INTENDED:
        if kernels is not None and new["kernel"] not in kernels:
            continue
        fields = {name: value for name, value in neutral(new).items() if name not in old["constexprs"]}
        if fields and all(new["constexprs"].get(name, _ABSENT) == value for name, value in fields.items()):
            for name in fields:
                del new["constexprs"][name]
            applied.append(rule)
    return applied


def compare(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """The differences of two runs of a call (records of OLD_TREE and of this tree), and the INTENDED rules that
    explained others (one per launch and rule)."""
    found = []
    if [x["kernel"] for x in old.get("launches", [])] != [x["kernel"] for x in new.get("launches", [])]:
        found.append(f"launches {_launch_names(old)} -> {_launch_names(new)}")
    paths = []
    old, new = json.loads(json.dumps(old)), json.loads(json.dumps(new))
    intended = []
    for a, b in zip(old.get("launches", []), new.get("launches", [])):
        intended += _intended(a, b)
        a["runtime"] = [value for _, value in a["runtime"]]
        paths.append([path for path, _ in b["runtime"]])
        b["runtime"] = [value for _, value in b["runtime"]]
    for line in differences(old, new):
        at = re.match(r"\.launches\[(\d+)\]\.runtime\[(\d+)\]", line)
        if at and int(at[2]) < len(paths[int(at[1])]):
            line = f"{line[:at.end()]} ({paths[int(at[1])][int(at[2])]}){line[at.end():]}"
        found.append(line)
    return found, intended


def main():
    if sys.argv[1:2] == ["--dump"]:
        print(json.dumps(record(*sys.argv[2:])))
        return
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    names = sys.argv[2:]
    old = tree_records(Path(sys.argv[1]).resolve(), *names)
    new = tree_records(Path(__file__).resolve().parents[1], *names)
    same = differ = added = 0
    intended: collections.Counter = collections.Counter()
    for name in new:
        refused = name in old and all("error" in run for run in old[name])
        if name not in old or (refused and not any("error" in run for run in new[name])):
            added += 1
            why = old[name][0]["error"] if name in old else "not in its grid"
            print(f"{name}: new in this tree ({why} there): {_launch_names(new[name][0])}")
            continue
        found = []
        for run, (a, b) in enumerate(zip(old[name], new[name])):
            lines, rules = compare(a, b)
            intended.update(rules)
            found += [f"run {run}: {line.lstrip('.')}" for line in lines]
        if found:
            differ += 1
            print(f"{name}: DIFFERS\n  " + "\n  ".join(found[:40])
                  + (f"\n  ... {len(found) - 40} more" if len(found) > 40 else ""))
        else:
            same += 1
    print(f"{same} calls identical, {differ} differ" + (f"; {added} new in this tree" if added else ""))
    for rule, launches in intended.items():
        print(f"intended, not counted as a difference: {rule}: {launches} launches")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
