"""Probe the Gluon (triton.experimental.gluon, Triton 3.6) features the warp-specialised FlashAttention
backward kernel (flash_attn_ck/backends/triton/gluon/bwd_ws.py) builds on, one tiny kernel per feature, each
checked against a torch reference on random data:

  1. tma_ss_wgmma   TMA loads (host TensorDescriptor) behind an mbarrier (init/expect/wait), an SS
                    warpgroup_mma with B = smem.permute((1, 0)) (C = A @ B^T, like K Q^T), and a TMA store
                    of the fp32 result (async_copy_shared_to_global + store_wait).
  2. rs_wgmma       an fp32 wgmma accumulator (8 warps, M = 128) cast to bf16 and convert_layout'ed to a
                    DotOperandLayout(0, k_width=2) of a second mma layout, used as the register A operand
                    of a second wgmma ((A @ B^T).bf16 @ C); and an SS wgmma whose A operand is a transposed
                    shared view of a bf16 tile written with smem.store + fence_async_shared + thread_barrier
                    (S.bf16^T @ E, like dQ = dS K).
  3. warp_spec      gl.warp_specialize: a 1-warp TMA loader fills a 2-stage ring (ready/empty mbarriers),
                    the 8-warp default partition accumulates X_i @ W^T with wgmma and hands each running
                    sum to a 1-warp writer (full/empty mbarriers) that TMA-stores it; checks the prefix
                    sums and whether the PTX has setmaxnreg.
  4. tma_reduce     cp.reduce.async.bulk.tensor .add.f32 (builder op, no Gluon 3.6 wrapper): many CTAs add
                    fp32 tiles at overlapping rows of one buffer; timed against gl.atomic_add of the same data.
  5. atomic_add     vectorised fp32 gl.atomic_add from registers (the fallback), correctness only.

Each probe prints one PASS/FAIL line (max abs error, tolerance, timing where meaningful) plus PTX instruction
counts; a failing probe does not stop the others; the exit status is non-zero if any failed.

On the device (H200, sm_90):   python3 scripts/lab/gluon_probe.py
Without a GPU:                  python3 scripts/lab/gluon_probe.py --compile-only
    (compiles every probe kernel for sm_90a and reports the PTX instruction counts, no numerical check)
Pick probes by name:            python3 scripts/lab/gluon_probe.py rs_wgmma tma_reduce
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flash_attn_ck.backends.triton.gluon.bwd_ws_workers import tma_reduce_add

WARPS: gl.constexpr = gl.constexpr(8)   # num_warps of every probe kernel (the default partition's warps)
COMPILE_ONLY = False
DEVICE = "cuda"


# ---- host helpers ----------------------------------------------------------------------------
@dataclass
class Result:
    err: float | None = None        # max abs error against the torch reference
    tol: float | None = None
    note: str = ""
    kernels: list = field(default_factory=list)   # (name, compiled kernel)


def desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[t.dtype]
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt))


def launch(kernel, grid, args, constexprs):
    """Run kernel[grid] on the GPU, or (--compile-only) compile it for sm_90a; returns the compiled kernel."""
    if not COMPILE_ONLY:
        return kernel[grid](*args, **constexprs, num_warps=WARPS.value)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = list(inspect.signature(kernel.fn).parameters)
    values = dict(zip([n for n in names if n not in constexprs], args))
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
            continue
        v = values[n]
        sig[n] = mangle_type(v)
        if isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]   # what the launcher specialises on the GPU
    src = GluonASTSource(kernel, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS.value})


def ptx_counts(k) -> str:
    ptx = k.asm["ptx"]
    keys = ["wgmma.mma_async", "cp.async.bulk.tensor", "cp.reduce.async.bulk", "setmaxnreg", "mbarrier"]
    counts = {key: ptx.count(key) for key in keys}
    atom = [ln for ln in ptx.splitlines() if re.search(r"\b(red|atom)\.", ln)]
    counts["atom/red"] = len(atom)
    counts["atom/red.v2|v4"] = sum(bool(re.search(r"\.v[24]\.", ln)) for ln in atom)
    return " ".join(f"{key}={n}" for key, n in counts.items())


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=50) * 1e3


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def randn(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


# ---- 1. TMA load + SS wgmma (A @ B^T) + TMA store ----------------------------------------------
@gluon.jit
def _tma_ss_kernel(a_desc, b_desc, c_desc, BM: gl.constexpr, BN: gl.constexpr):
    row = gl.program_id(0) * BM
    a_smem = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(gl.float32, c_desc.block_type.shape, c_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row, 0], bar, a_smem)
    tma.async_copy_global_to_shared(b_desc, [0, 0], bar, b_smem)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)

    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, BN, 16])
    acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), gl.zeros([BM, BN], gl.float32, layout), use_acc=False)
    c_smem.store(acc)
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(c_desc, [row, 0], c_smem)
    tma.store_wait(0)


def _tma_ss_case(tiles, bm=128, bn=64, d=128):
    a, b = randn(tiles * bm, d), randn(bn, d)
    c = torch.empty(tiles * bm, bn, device=DEVICE, dtype=torch.float32)
    return a, b, c, (desc(a, [bm, d]), desc(b, [bn, d]), desc(c, [bm, bn])), {"BM": bm, "BN": bn}


def probe_tma_ss_wgmma() -> Result:
    a, b, c, args, cx = _tma_ss_case(4)
    k = launch(_tma_ss_kernel, (4,), args, cx)
    res = Result(kernels=[("_tma_ss_kernel", k)])
    if COMPILE_ONLY:
        return res
    res.err, res.tol = max_err(c, a.float() @ b.float().T), 1e-3 * a.shape[1]
    tiles = 2048   # timing on a grid that fills the GPU
    a, b, c, args, cx = _tma_ss_case(tiles)
    us = bench_us(lambda: _tma_ss_kernel[(tiles,)](*args, **cx, num_warps=WARPS.value))
    gbs = (a.numel() * 2 + c.numel() * 4) / us * 1e-3
    res.note = f"{tiles} CTAs, [128x128]@[64x128]^T each: {us:.1f} us ({gbs:.0f} GB/s)"
    return res


# ---- 2. RS wgmma (accumulator -> bf16 -> dot operand) and SS wgmma with a transposed A view ----
@gluon.jit
def _rs_kernel(a_desc, b_desc, c_desc, e_desc, out1_ptr, out2_ptr,
               M: gl.constexpr, N1: gl.constexpr, N2: gl.constexpr, N3: gl.constexpr):
    a_smem = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    e_smem = gl.allocate_shared_memory(e_desc.dtype, e_desc.block_type.shape, e_desc.layout)
    s_layout_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, N1], gl.bfloat16)
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [M, N1], s_layout_smem)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes + c_desc.block_type.nbytes
                    + e_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [0, 0], bar, a_smem)
    tma.async_copy_global_to_shared(b_desc, [0, 0], bar, b_smem)
    tma.async_copy_global_to_shared(c_desc, [0, 0], bar, c_smem)
    tma.async_copy_global_to_shared(e_desc, [0, 0], bar, e_smem)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)

    l1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, N1, 16])
    l2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, N2, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l2, k_width=2)
    s = warpgroup_mma(a_smem, b_smem.permute((1, 0)), gl.zeros([M, N1], gl.float32, l1), use_acc=False)
    s_bf = s.to(gl.bfloat16)
    o1 = warpgroup_mma(gl.convert_layout(s_bf, op_layout), c_smem, gl.zeros([M, N2], gl.float32, l2),
                       use_acc=False, is_async=True)
    o1 = warpgroup_mma_wait(0, deps=(o1,))
    r1 = gl.arange(0, M, layout=gl.SliceLayout(1, l2))
    c1 = gl.arange(0, N2, layout=gl.SliceLayout(0, l2))
    gl.store(out1_ptr + gl.expand_dims(r1, 1) * N2 + gl.expand_dims(c1, 0), o1)

    # S^T @ E with S^T a transposed view of a tile the warps stored themselves (dQ = dS K in the kernel)
    s_smem.store(s_bf)
    fence_async_shared()
    gl.thread_barrier()
    warps_m: gl.constexpr = min(WARPS, N1 // 16)
    l3: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, WARPS // warps_m],
                                                 instr_shape=[16, N3 // (WARPS // warps_m), 16])
    o2 = warpgroup_mma(s_smem.permute((1, 0)), e_smem, gl.zeros([N1, N3], gl.float32, l3), use_acc=False)
    r2 = gl.arange(0, N1, layout=gl.SliceLayout(1, l3))
    c2 = gl.arange(0, N3, layout=gl.SliceLayout(0, l3))
    gl.store(out2_ptr + gl.expand_dims(r2, 1) * N3 + gl.expand_dims(c2, 0), o2)


def probe_rs_wgmma() -> Result:
    m, k1, n1, n2, n3 = 128, 64, 64, 128, 128
    a, b = randn(m, k1, scale=0.25), randn(n1, k1, scale=0.25)
    c, e = randn(n1, n2), randn(m, n3)
    out1 = torch.empty(m, n2, device=DEVICE, dtype=torch.float32)
    out2 = torch.empty(n1, n3, device=DEVICE, dtype=torch.float32)
    args = (desc(a, [m, k1]), desc(b, [n1, k1]), desc(c, [n1, n2]), desc(e, [m, n3]), out1, out2)
    k = launch(_rs_kernel, (1,), args, {"M": m, "N1": n1, "N2": n2, "N3": n3})
    res = Result(kernels=[("_rs_kernel", k)])
    if COMPILE_ONLY:
        return res
    s = (a.float() @ b.float().T).bfloat16().float()
    ref1, ref2 = s @ c.float(), s.T @ e.float()
    # the kernel's fp32 sums may round to bf16 differently from torch's at a few ties: allow ~1 bf16 ulp of S
    err1, err2 = max_err(out1, ref1), max_err(out2, ref2)
    res.err, res.tol = max(err1, err2), 2e-2 * max(ref1.abs().max().item(), ref2.abs().max().item())
    res.note = f"RS (A@B^T).bf16@C err={err1:.3g}, SS S^T@E (transposed smem view) err={err2:.3g}"
    return res


# ---- 3. warp_specialize: loader -> ring -> wgmma consumer -> writer ---------------------------
@gluon.jit
def _ws_loader(x_desc, w_desc, x_smem, w_smem, ready, empty, w_ready, n_tiles,
               BM: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(w_ready, w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(w_desc, [0, 0], w_ready, w_smem)
    for i in range(n_tiles):
        stage = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(empty.index(stage), phase ^ 1)
        mbarrier.expect(ready.index(stage), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [i * BM, 0], ready.index(stage), x_smem.index(stage))


@gluon.jit
def _ws_consumer(x_smem, w_smem, out_smem, ready, empty, w_ready, out_full, out_empty, n_tiles,
                 BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, layout)
    mbarrier.wait(w_ready, 0)
    for i in range(n_tiles):
        stage = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(ready.index(stage), phase)
        acc = warpgroup_mma(x_smem.index(stage), w_smem.permute((1, 0)), acc)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(stage), count=1)
        mbarrier.wait(out_empty, (i & 1) ^ 1)
        out_smem.store(acc)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(out_full, count=1)


@gluon.jit
def _ws_writer(out_desc, out_smem, out_full, out_empty, n_tiles, BM: gl.constexpr):
    for i in range(n_tiles):
        mbarrier.wait(out_full, i & 1)
        tma.async_copy_shared_to_global(out_desc, [i * BM, 0], out_smem)
        tma.store_wait(0)
        mbarrier.arrive(out_empty, count=1)


@gluon.jit
def _ws_kernel(x_desc, w_desc, out_desc, n_tiles, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
               WORKER_REGS: gl.constexpr):
    # (no starred arguments in Gluon: the box's two dims spelled out)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, x_desc.block_type.shape[0], x_desc.block_type.shape[1]],
                                       x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, w_desc.block_type.shape, w_desc.layout)
    out_smem = gl.allocate_shared_memory(gl.float32, out_desc.block_type.shape, out_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    out_full = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    out_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(w_ready, count=1)
    mbarrier.init(out_full, count=1)
    mbarrier.init(out_empty, count=1)
    gl.warp_specialize([
        (_ws_consumer, (x_smem, w_smem, out_smem, ready, empty, w_ready, out_full, out_empty, n_tiles,
                        BM, BN, STAGES)),
        (_ws_loader, (x_desc, w_desc, x_smem, w_smem, ready, empty, w_ready, n_tiles, BM, STAGES)),
        (_ws_writer, (out_desc, out_smem, out_full, out_empty, n_tiles, BM)),
    ], worker_num_warps=[1, 1], worker_num_regs=[WORKER_REGS, WORKER_REGS])


def probe_warp_spec() -> Result:
    bm, bn, d, n_tiles = 128, 64, 64, 9   # odd tile count: the ring wraps with both phases
    x, w = randn(n_tiles * bm, d, scale=0.5), randn(bn, d, scale=0.5)
    out = torch.empty(n_tiles * bm, bn, device=DEVICE, dtype=torch.float32)
    args = (desc(x, [bm, d]), desc(w, [bn, d]), desc(out, [bm, bn]), n_tiles)
    k = launch(_ws_kernel, (1,), args, {"BM": bm, "BN": bn, "STAGES": 2, "WORKER_REGS": 24})
    res = Result(kernels=[("_ws_kernel", k)])
    res.note = f"setmaxnreg in PTX: {'yes' if 'setmaxnreg' in k.asm['ptx'] else 'NO'}"
    if COMPILE_ONLY:
        return res
    ref = (x.float() @ w.float().T).view(n_tiles, bm, bn).cumsum(0).view(-1, bn)
    res.err, res.tol = max_err(out, ref), 1e-3 * d
    return res


# ---- 4./5. TMA reduce-add vs register atomics ---------------------------------------------------
@gluon.jit
def _load_tile(src_ptr, BM: gl.constexpr, BN: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims(rows, 1) * BN + gl.expand_dims(cols, 0)
    return gl.load(src_ptr + gl.program_id(0).to(gl.int64) * (BM * BN) + offs), rows, cols


@gluon.jit
def _reduce_kernel(src_ptr, out_desc, ROW_STEP: gl.constexpr, N_SLOTS: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr):
    x, _, _ = _load_tile(src_ptr, BM, BN)
    smem = gl.allocate_shared_memory(gl.float32, [BM, BN], out_desc.layout)
    smem.store(x)
    fence_async_shared()
    gl.thread_barrier()
    tma_reduce_add(out_desc, [(gl.program_id(0) % N_SLOTS) * ROW_STEP, 0], smem)
    tma.store_wait(0)


@gluon.jit
def _atomic_kernel(src_ptr, out_ptr, ROW_STEP: gl.constexpr, N_SLOTS: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr):
    x, rows, cols = _load_tile(src_ptr, BM, BN)
    row0 = (gl.program_id(0) % N_SLOTS) * ROW_STEP
    ptrs = out_ptr + gl.expand_dims(row0 + rows, 1) * BN + gl.expand_dims(cols, 0)
    gl.atomic_add(ptrs, x, sem="relaxed")


def _reduce_case(n_ctas, n_slots, bm=64, bn=128, step=32, want_ref=True):
    """n_ctas tiles [bm, bn]; CTA i adds its tile at row (i % n_slots) * step (tiles overlap when step < bm)."""
    src = torch.randn(n_ctas, bm, bn, device=DEVICE)
    out = torch.zeros(n_slots * step + bm - step, bn, device=DEVICE)
    ref = None
    if want_ref and not COMPILE_ONLY:
        ref = torch.zeros_like(out, dtype=torch.float64)
        per_slot = torch.zeros(n_slots, bm, bn, device=DEVICE, dtype=torch.float64)
        per_slot.index_add_(0, torch.arange(n_ctas, device=DEVICE) % n_slots, src.double())
        for s in range(n_slots):
            ref[s * step:s * step + bm] += per_slot[s]
    return src, out, ref, {"ROW_STEP": step, "N_SLOTS": n_slots, "BM": bm, "BN": bn}


def probe_tma_reduce() -> Result:
    src, out, ref, cx = _reduce_case(64, 8)
    odesc = desc(out, [cx["BM"], cx["BN"]])
    k = launch(_reduce_kernel, (64,), (src, odesc), cx)
    res = Result(kernels=[("_reduce_kernel", k)])
    if COMPILE_ONLY:
        return res
    res.err, res.tol = max_err(out, ref), 1e-4
    # timing: 4096 CTAs of 32 KiB each into 64 overlapping slots, TMA reduce vs register atomics
    n = 4096
    src, out, _, cx = _reduce_case(n, 64, want_ref=False)
    odesc = desc(out, [cx["BM"], cx["BN"]])
    t_tma = bench_us(lambda: _reduce_kernel[(n,)](src, odesc, **cx, num_warps=WARPS.value))
    t_atom = bench_us(lambda: _atomic_kernel[(n,)](src, out, **cx, num_warps=WARPS.value))
    res.note = f"{n} CTAs x [64x128] fp32: TMA reduce {t_tma:.1f} us, gl.atomic_add {t_atom:.1f} us"
    return res


def probe_atomic_add() -> Result:
    src, out, ref, cx = _reduce_case(64, 8)
    k = launch(_atomic_kernel, (64,), (src, out), cx)
    res = Result(kernels=[("_atomic_kernel", k)])
    if COMPILE_ONLY:
        return res
    res.err, res.tol = max_err(out, ref), 1e-4
    return res


PROBES = {
    "tma_ss_wgmma": probe_tma_ss_wgmma,
    "rs_wgmma": probe_rs_wgmma,
    "warp_spec": probe_warp_spec,
    "tma_reduce": probe_tma_reduce,
    "atomic_add": probe_atomic_add,
}


def main() -> int:
    global COMPILE_ONLY, DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a, no GPU needed")
    parser.add_argument("--verbose", "-v", action="store_true", help="print tracebacks of failures")
    parser.add_argument("probes", nargs="*", help=f"probes to run (default: all): {', '.join(PROBES)}")
    opts = parser.parse_args()
    unknown = [p for p in opts.probes if p not in PROBES]
    if unknown:
        parser.error(f"unknown probes {unknown}; choose from {list(PROBES)}")
    COMPILE_ONLY = opts.compile_only
    if not COMPILE_ONLY and not torch.cuda.is_available():
        print("no GPU: use --compile-only")
        return 2
    DEVICE = "cpu" if COMPILE_ONLY else "cuda"
    torch.manual_seed(0)
    if COMPILE_ONLY:
        print(f"compile-only for sm_90a, triton {triton.__version__}, torch {torch.__version__}")
    else:
        print(f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}, "
              f"triton {triton.__version__}, torch {torch.__version__}")
    failed = []
    for name in opts.probes or list(PROBES):
        try:
            res = PROBES[name]()
            if not COMPILE_ONLY:
                torch.cuda.synchronize()
        except Exception as exc:
            failed.append(name)
            msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
            print(f"FAIL {name:13s} {' | '.join(msg[-6:])[:2000]}")
            if opts.verbose:
                traceback.print_exc()
            continue
        if COMPILE_ONLY:
            status, err = "OK  ", ""
        else:
            ok = res.err is not None and res.err <= res.tol
            status = "PASS" if ok else "FAIL"
            err = f"max_abs_err={res.err:.3g} (tol {res.tol:.3g}) "
            if not ok:
                failed.append(name)
        print(f"{status} {name:13s} {err}{res.note}")
        for kname, k in res.kernels:
            print(f"       {kname}: {ptx_counts(k)}")
    print(f"{len(failed)} of {len(opts.probes or PROBES)} failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
