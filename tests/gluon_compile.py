"""What the CPU tests of the warp-specialised kernels (test_triton_ws.py, test_triton_fwd_ws.py) share: compiling
a Gluon kernel for sm_90a on a machine without a GPU (ptxas from the triton wheel), reading what ptxas reports,
and pretending the problem's device is an sm_90 part for the dispatch rules."""

from __future__ import annotations

import contextlib
import inspect
import re
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import torch
import triton


@contextlib.contextmanager
def pretend_capability(capability=(9, 0)):
    """Within the block the Triton backend takes every CUDA device for one of `capability` (its rules read only
    that) and runs no interpreter. A context manager, not a fixture: hypothesis examples run it each."""
    from flash_attn_ck.backends.triton.runtime import target
    with mock.patch.object(target, "capability", return_value=capability), \
            mock.patch.object(target, "INTERPRETING", False):
        yield


def ws_reasons(backend, p) -> list[str]:
    """Why the warp-specialised backward does not run the call: the reasons of the operator (bwd_ws or bwd_ws_split)
    whose tile table holds its head dim, bwd_ws's where neither does."""
    from flash_attn_ck.backends.triton import config, operators
    split = config.head_block(p.head_dim_padded) in operators.BwdWsSplit.tiles
    return backend.reasons(p, operators.BwdWsSplit if split else operators.BwdWs)


SM90_SHARED_BYTES = 227 * 1024   # the most shared memory one CTA may use on an H100/H200 (sm_90)


def descriptor_type(rows: int, head_dim: int, dtype: torch.dtype, parts: int = 1) -> str:
    """The mangled signature type of a host TMA descriptor with (rows, 1, head dim padded / parts) boxes."""
    from triton.runtime.jit import mangle_type

    from flash_attn_ck.backends.triton import config
    from flash_attn_ck.backends.triton.gluon import gluon_common
    return mangle_type(gluon_common.descriptor(torch.empty(512, 4, head_dim, dtype=dtype), True, rows,
                                               config.head_block(head_dim) // parts))


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, num_warps: int, **options):
    """triton.compile of a Gluon kernel for sm_90a; parameters missing from `types` and `constexprs` are i32;
    `options`: further compile options (maxnreg)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in inspect.signature(kernel.fn).parameters}
    return triton.compile(GluonASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, **options))


def _call(head_dim: int, varlen: bool, masks, heads: int = 4, rows: int = 512):
    """CPU tensors of one call's layout ((rows, heads, d) varlen, else (1, rows, heads, d)) and its keywords."""
    from flash_attn_ck.backends.triton.runtime.launch import GluonMask, MaskFlags
    shape = (rows, heads, head_dim) if varlen else (1, rows, heads, head_dim)
    lse_shape = (heads, rows) if varlen else (1, heads, rows)
    tensors = dict(q=torch.empty(shape, dtype=torch.bfloat16), lse=torch.empty(lse_shape),
                   cu_seqlens=torch.tensor([0, rows], dtype=torch.int32))
    return shape, tensors, dict(varlen=varlen, batch=1, seqlen_q=rows, seqlen_k=rows, scale=0.125,
                                mask=GluonMask((0, 0), MaskFlags(*masks)))


def _schedule(schedule: bool, block: int):
    """A varlen launch's schedule (varlen_schedule.py) for the one 512-row sequence of `_call` in tiles of `block`
    rows, or None."""
    if not schedule:
        return None
    from flash_attn_ck.backends.triton.runtime import varlen_schedule
    walk = varlen_schedule.TileWalk(block, block, owns_keys=False)
    cu = torch.tensor([0, 512], dtype=torch.int32)
    return varlen_schedule.build_schedule(cu, cu, walk, varlen_schedule.schedule_bound(512, 1, block))


def _alibi(q):
    """ALiBi's kernel argument for q's heads: (batch, heads) fp32 slopes of one batch entry and their batch stride."""
    slopes = torch.zeros(1, q.shape[-2])
    return slopes, slopes.stride(0)


def fwd_spec(tile, head_dim: int, varlen: bool = False, masks=(False, False, False), schedule: bool = False,
             sink: bool = False, softcap: float = 0.0, alibi: bool = False, dropout: bool = False,
             head_dim_v: int | None = None, qk_tail: int = 0):
    """fwd_ws.launch_spec of `tile` for a call of `head_dim` (bf16, 512 rows, 4 heads) with `masks` (TOP_LEFT,
    HAS_LEFT, HAS_RIGHT); `schedule` (varlen): with the call's varlen schedule; `sink`: with a learnable sink;
    `softcap`: with that cap (0: none); `alibi`: with (batch, heads) ALiBi slopes; `dropout`: with p = 0.1;
    `head_dim_v`: v's and out's head dim (None: q/k's); `qk_tail`: q/k's tail block's columns (0: none)."""
    from flash_attn_ck.backends.triton.gluon import fwd_ws
    _, t, call = _call(head_dim, varlen, masks)
    q = t["q"]
    v = q if head_dim_v is None else q.new_empty((*q.shape[:-1], head_dim_v))
    return fwd_ws.launch_spec(q, q.clone(), v.clone(), v.clone(), t["lse"], t["cu_seqlens"], t["cu_seqlens"],
                              tile=tile, schedule=_schedule(schedule, tile.block_m),
                              sink=torch.zeros(q.shape[-2]) if sink else None, softcap=softcap,
                              alibi=_alibi(q) if alibi else None,
                              dropout=(torch.zeros(2, dtype=torch.int64), 0.1, 4, 0) if dropout else None,
                              qk_tail=qk_tail, **call)[0]


def bwd_spec(tile, head_dim: int, varlen: bool = False, masks=(False, False, False), deterministic: bool = False,
             schedule: bool = False, softcap: float = 0.0, alibi: bool = False, dropout: bool = False,
             head_dim_v: int | None = None, qk_tail: int = 0):
    """bwd_ws.launch_spec of `tile` (bwd_ws_split's kernel for a split_d tile) for a call like fwd_spec's, in the
    deterministic mode or not, with the call's varlen schedule or not, with a softcap (0: none), with ALiBi or not,
    with dropout (p = 0.1) or not; `head_dim_v`: v's, dout's and dv's head dim (None: q/k's); `qk_tail`: q/k's tail
    block's columns (0: none)."""
    from flash_attn_ck.backends.triton.gluon import bwd_ws
    shape, t, call = _call(head_dim, varlen, masks)
    q, lse = t["q"], t["lse"]
    v = q if head_dim_v is None else q.new_empty((*q.shape[:-1], head_dim_v))
    sems = torch.zeros(1, shape[-2], 512 // tile.block_m, dtype=torch.int32) if deterministic else None
    return bwd_ws.launch_spec(q, q.clone(), v.clone(), v.clone(), lse, lse.clone(), torch.empty(shape), q.clone(),
                              v.clone(), t["cu_seqlens"], t["cu_seqlens"], tile=tile, semaphores=sems,
                              schedule=_schedule(schedule, tile.block_n), softcap=softcap,
                              alibi=_alibi(q) if alibi else None,
                              dropout=(torch.zeros(2, dtype=torch.int64), 0.1, 4, 0) if dropout else None,
                              qk_tail=qk_tail, **call)


def compile_spec(spec):
    """compile_sm90 of a launch spec (launch.LaunchSpec: the kernel's arguments as backend.py launches them)."""
    types, constexprs = spec.signature()
    return compile_sm90(spec.kernel, types, constexprs, spec.num_warps, **spec.options)


def compile_as_launched(spec):
    """compile_spec, but with the signature a launch of the spec's argument values gets: Triton's binder
    specialises them (an int equal to 1 becomes a constant, ints and pointers divisible by 16 say so), as
    `kernel[grid](...)` does before it compiles."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", 90, 32)
    kernel, backend = spec.kernel, make_backend(target)
    kwargs = dict(num_warps=spec.num_warps, num_stages=spec.num_stages, debug=False, **spec.options)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*spec.args.values(), **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def ptxas_report(ptx: str) -> dict[str, int]:
    """ptxas -v of the PTX for sm_90a (the ptxas the installed Triton uses): registers at launch (warp-specialised
    partitions then move them with setmaxnreg) and the bytes of spill stores and loads."""
    from triton.backends.nvidia.compiler import get_ptxas
    tool = get_ptxas(90).path       # the ptxas this Triton compiles sm_90 with (3.9: ptxas-blackwell, PTX 9.4)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        text = subprocess.run([str(tool), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp, "k.cubin"))],
                              capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    return dict(registers=int(regs.group(1)), spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)))


# The release whose ptxas the tiles were tuned with (their spill-free budgets were read off it).
TUNED_WITH = (3, 6)
# Spill bytes another ptxas may add: its register allocation moves by a few words either way (Triton 3.9's
# ptxas-blackwell spills 8-20 bytes in four variants that spill none under 3.6's); more means a tile to retune there.
OTHER_PTXAS_SPILL_SLACK = 32


def spill_allowance(tuned_bytes: int) -> int:
    """The spill bytes a compile test allows a kernel that spills at most `tuned_bytes` under the ptxas it was tuned
    with: exactly that under that release's ptxas, OTHER_PTXAS_SPILL_SLACK more under any other."""
    from flash_attn_ck.backends.triton.runtime import triton_versions
    same = triton_versions.release(triton_versions.installed()) == TUNED_WITH
    return tuned_bytes if same else tuned_bytes + OTHER_PTXAS_SPILL_SLACK


def sass_loops(cubin: bytes) -> list[list[str]]:
    """The innermost loops of a cubin's SASS (cuobjdump from the triton wheel) that issue a wgmma (HGMMA): each loop's
    instructions (NOPs left out), from its head to its backward branch, in program order: the consumers' key-tile
    loops of the warp-specialised kernels."""
    from triton import knobs
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(knobs.nvidia.cuobjdump.path), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    code = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
            if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line))]
    at = {address: i for i, (address, _) in enumerate(code)}
    loops = []
    for i, (address, text) in enumerate(code):
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in at:
            loops.append((at[int(target.group(1), 16)], i))
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    bodies = [[text for _, text in code[a:b + 1] if not text.startswith("NOP")] for a, b in sorted(innermost)]
    return [body for body in bodies if any("HGMMA" in text for text in body)]


def hardware_tanh_kernel():
    """A Gluon kernel that writes gluon_common.hardware_tanh of each of n fp32 values (grid: cdiv(n, 512), 4 warps):
    the helper alone, compiled here for sm_90a and run by the GPU tests."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from flash_attn_ck.backends.triton.gluon.gluon_common import hardware_tanh

    @gluon.jit
    def tanh_kernel(x_ptr, y_ptr, n, BLOCK: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        offsets = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
        inside = offsets < n
        gl.store(y_ptr + offsets, hardware_tanh(gl.load(x_ptr + offsets, mask=inside)), mask=inside)
    return tanh_kernel


def dropout_keep_kernel():
    """A Gluon kernel that writes gluon/dropout.Dropout.keep of one (ROWS, BLOCK_N) tile as int8 (1: kept), in the
    wgmma accumulator layout the kernels hold scores in, (rows, keys) or (keys, rows) with KEYS_FIRST (4 warps, one
    program): `call` is (int64 [seed, offset] rng_state, p, query heads), the tile is sequence b's head h, rows
    [m0, m0 + ROWS), keys [n0, n0 + BLOCK_N). Compiled here for sm_90a and run by the GPU tests."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from flash_attn_ck.backends.triton.gluon.dropout import pattern_of

    @gluon.jit
    def keep_kernel(rng_state, p, heads, out, b, head, m0, n0, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                    KEYS_FIRST: gl.constexpr):
        drop = pattern_of((rng_state, p, heads, 0), b, head)
        if KEYS_FIRST:
            layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, ROWS, 16])
            rows = gl.arange(0, ROWS, layout=gl.SliceLayout(0, layout))
            keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
            offsets = gl.expand_dims(keys, 1) * ROWS + gl.expand_dims(rows, 0)
        else:
            layout: gl.constexpr = gl.NVMMADistributedLayout(  # type: ignore[no-redef]
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
            rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
            keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            offsets = gl.expand_dims(rows, 1) * BLOCK_N + gl.expand_dims(keys, 0)
        kept = drop.keep(m0 + rows, n0, BLOCK_N, layout, KEYS_FIRST)
        gl.store(out + offsets, kept.to(gl.int8))
    return keep_kernel
