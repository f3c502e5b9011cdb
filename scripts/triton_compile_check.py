"""Compile every kernel of the Triton backend for sm_90a on a machine without a GPU (the ptxas and cuobjdump the
installed Triton uses), and print registers / stack frame (spills) / shared memory / wgmma and TMA instruction counts
per kernel variant; the last line is `N compiled, M failed` (exit status 1 when M > 0). Catches front-end, MLIR
pipeline and ptxas failures under any Triton release before spending device time (scripts/triton_matrix.sh runs it
under each supported release).

Families: the older Triton kernels (forward; the backward's one launch in each mode, GQA group loop included, at
every feature set and at one query row, where ints equal to 1 become constants; and with v's own head dim d_v),
compiled as a launch of their arguments specialises them; the warp-specialised Gluon kernels (fwd_ws, bwd_ws,
bwd_ws_split) at every tile of their tables over each mask kind, varlen, the varlen schedule and the deterministic
mode; the small kernels (D and zeroing, casts, zero fill, the outside-rows fill, the varlen schedule builder). Each
variant is a launch spec (flash_attn_ck/backends/triton/runtime/launch.py) built by the functions backend.py launches
through, so the signatures follow the kernels by construction.

    python scripts/triton_compile_check.py [--quick] [--only NAME_PART] [--dump DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torch

from flash_attn_ck.backends.triton import config
from flash_attn_ck.backends.triton.runtime import launch
from flash_attn_ck.backends.triton.runtime.launch import Features

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(spec: launch.LaunchSpec, as_launched: bool = False):
    """Compile a launch spec for sm_90; its signature comes from the spec's own argument values. Every int compiles
    unspecialised (an i32) unless `as_launched`: then Triton's launcher specialises each argument as a launch of
    these values would (an int equal to 1 becomes a constant; ints and pointers divisible by 16 say so)."""
    t = time.time()
    src, options = _as_launched(spec) if as_launched else (
        ASTSource(spec.kernel, *spec.signature()), dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    k = triton.compile(src, target=TARGET, options=options)
    md = k.metadata
    regs, stack = resource_usage(k.asm["cubin"])
    return dict(regs=regs, stack=stack, shared=md.shared, secs=time.time() - t, asm=k.asm)


def _as_launched(spec: launch.LaunchSpec):
    """(source, options) of the spec as `JITFunction.run` builds them: its binder's specialisation of the spec's
    arguments, then its own packing of the signature, constants and attributes."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    kernel, backend = spec.kernel, make_backend(TARGET)
    kwargs = dict(num_warps=spec.num_warps, num_stages=spec.num_stages, debug=False, **spec.options)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*spec.args.values(), **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(kernel, signature, constexprs, attrs), options.__dict__


def resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack frame bytes) of a cubin, read by cuobjdump from the triton wheel: without a
    GPU the compiled kernel has no n_regs. Register spills live in the stack frame, so stack > 0 means
    spills (or local arrays)."""
    from triton import knobs
    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


# The variants' score and mask flags, by tag. "plain" has no window, so dense calls compile the EVEN_K variants;
# "topleft" a top-left sliding window with ALiBi (whose distance keeps the bottom-right diagonal).
FEATURE_SETS = {
    "plain": Features(),
    "causal": Features(HAS_RIGHT=True),
    "all": Features(HAS_RIGHT=True, HAS_LEFT=True, HAS_ALIBI=True, HAS_SOFTCAP=True, HAS_DROPOUT=True),
    "topleft": Features(TOP_LEFT=True, HAS_LEFT=True, HAS_RIGHT=True, HAS_ALIBI=True),
    "ones": Features(HAS_RIGHT=True, HAS_LEFT=True, HAS_ALIBI=True, HAS_SOFTCAP=True, HAS_DROPOUT=True),
}
# Sequence length of a tag's tensors (default 256): "ones" is "all" at s = 1, where strides of size-1 dimensions
# (lse's head stride) are 1 and a launch specialises them to the constant 1 (Triton 3.6 loses such a constant
# nested two tuple levels down in an argument handed to a helper: the kernels' stride groups are flat).
SEQLENS = {"ones": 1}
# The backward's modes: (LOOP_GROUP, DQ_ATOMIC, DETERMINISTIC, query heads per kv head). The accumulator epilogue (not
# LOOP_GROUP) runs for GQA calls, so its variants have two query heads per kv head; the group loop runs for MHA and GQA
# (at one query row its inner loop has one trip and the group loop is the innermost: the pipeliner must leave it).
BWD_MODES = ((True, False, True, 1), (False, False, True, 2), (False, True, False, 1), (True, False, True, 2))


def variants(block_ds):
    """(head block, feature tag, varlen, role, launch spec) of every variant at the head blocks `block_ds`: the
    forward and the backward's modes (the dQ pass is the query-tile role of the backward's launch where dQ is not
    atomic), with the sm_90 tiles and TMA choices of the causal table row."""
    for block_d in block_ds:
        cfg = config.SM90[(block_d, True)]
        for tag, feats in FEATURE_SETS.items():
            for varlen in (False, True):
                t = _Tensors(block_d, varlen, seqlen=SEQLENS.get(tag, 256))
                fwd_tma = cfg.fwd_tma and not varlen
                yield block_d, tag, varlen, "fwd", launch.forward(
                    t.q, t.k, t.v, t.q, t.lse, t.seq, t.sizes, t.scores,
                    feats._replace(VARLEN=varlen, USE_TMA=fwd_tma, TMA_LOADS=fwd_tma, EVEN_K=not varlen),
                    cfg.forward, block_d, (1, 1))
                for loop, atomic, det, group in BWD_MODES:
                    t = _Tensors(block_d, varlen, group=group, seqlen=SEQLENS.get(tag, 256))
                    features = feats._replace(
                        VARLEN=varlen, LOOP_GROUP=loop, DQ_ATOMIC=atomic, DETERMINISTIC=det, USE_TMA=not varlen,
                        TMA_LOADS=not varlen and cfg.bwd_tma == "all", DP_FIRST=cfg.bwd_dp_first,
                        EVEN_K=cfg.bwd_even_k and not varlen)
                    role = f"bwd loop={loop} dq_atomic={atomic} det={det}" + (" gqa" if loop and group > 1 else "")
                    yield block_d, tag, varlen, role, launch.bwd_main(
                        t.q, t.k, t.v, t.q, t.lse, t.lse, t.acc if atomic else t.q, t.k, t.v, t.acc, t.acc,
                        t.sems, t.seq, t.batch, t.sizes, t.scores, features, cfg.bwd_kv, cfg.bwd_dq, block_d, (1, 1))


# (d, d_v) of the value-head-dim variants: MLA's pair (v's block narrower) and a v wider than q/k.
VALUE_HEAD_DIMS = ((192, 128), (64, 128))
GLUON_VALUE_HEAD_DIMS = ((192, 128), (128, 64))   # the warp-specialised kernels take a narrower v (MLA's first)


def value_head_dim_variants(names: str = ""):
    """(name, launch spec) of the older kernels with v's own head dim (head_dim_v, BLOCK_DV) at VALUE_HEAD_DIMS: the
    forward and the backward's group-loop and atomic-dQ modes (the accumulator epilogue has one row width), causal and
    with every score feature, dense and varlen, with the sm_90 tiles of the wider head block."""
    for d, d_v in VALUE_HEAD_DIMS:
        block_d, block_dv = config.head_block(d), config.head_block(d_v)
        cfg = config.SM90[(max(block_d, block_dv), True)]
        for tag in ("causal", "all"):
            for varlen in (False, True):
                t = _Tensors(d, varlen, d_v=d_v)
                fwd_tma = cfg.fwd_tma and not varlen
                specs = [("", launch.forward(
                    t.q, t.k, t.v, t.out, t.lse, t.seq, t.sizes, t.scores,
                    FEATURE_SETS[tag]._replace(VARLEN=varlen, USE_TMA=fwd_tma, TMA_LOADS=fwd_tma, EVEN_K=not varlen,
                                               HEAD_DIM_V=d_v, BLOCK_DV=block_dv),
                    cfg.forward, block_d, (1, 1)))]
                for atomic in (False, True):
                    features = FEATURE_SETS[tag]._replace(
                        VARLEN=varlen, LOOP_GROUP=True, DQ_ATOMIC=atomic, DETERMINISTIC=not atomic,
                        USE_TMA=not varlen, TMA_LOADS=not varlen and cfg.bwd_tma == "all", DP_FIRST=cfg.bwd_dp_first,
                        EVEN_K=cfg.bwd_even_k and not varlen, HEAD_DIM_V=d_v, BLOCK_DV=block_dv)
                    specs.append((f" dq_atomic={atomic}", launch.bwd_main(
                        t.q, t.k, t.v, t.out, t.lse, t.lse, t.acc if atomic else t.q, t.k, t.v, None, None, None,
                        t.seq, t.batch, t.sizes, t.scores, features, cfg.bwd_kv, cfg.bwd_dq, block_d, (1, 1))))
                for role, spec in specs:
                    name = f"{spec.kernel.fn.__name__} d{d}/d_v{d_v} {tag} varlen={varlen}{role}"
                    if names in name:
                        yield name, spec


def gluon_variants(head_dims, names: str = ""):
    """(name, launch spec) of the warp-specialised kernels at each of `head_dims` that their tables hold, built by their
    own launch_spec functions (through tests/gluon_compile.py) from CPU tensors of each variant's layout: dense and
    causal calls, a top-left window with varlen and the deterministic mode, and the varlen schedule with every mask
    flag and, deterministic, with a causal mask (a deterministic call with a left window keeps the grid); then the
    variants with score terms (`term_variants`)."""
    from gluon_compile import bwd_spec, fwd_spec
    cases = [(d, causal, (False, False, causal), False, False, False)
             for d in head_dims for causal in (False, True)] + \
            [(d, True, (True, True, True), True, True, False) for d in head_dims] + \
            [(d, True, masks, True, det, True) for d in head_dims
             for masks, det in (((True, True, True), False), ((False, False, True), True))]
    for d, causal, masks, varlen, deterministic, schedule in cases:
        scheduled = f" schedule masks={''.join(f if on else '-' for f, on in zip('TLR', masks))}" if schedule else ""
        name = f"fwd_ws d{d} causal={causal} varlen={varlen}{scheduled}"
        if d in config.FWD_WS_SM90 and names in name and not (schedule and deterministic):  # the same forward
            yield name, fwd_spec(config.FWD_WS_SM90[d][causal], d, varlen, masks, schedule=schedule)
        if d in config.BWD_WS_SM90:
            spec = bwd_spec(config.BWD_WS_SM90[d], d, varlen, masks, deterministic, schedule=schedule)
            name = f"{spec.kernel.fn.__name__} d{d} causal={causal} varlen={varlen} det={deterministic}{scheduled}"
            if names in name:
                yield name, spec
    for d in head_dims:
        yield from term_variants(d, names)
    yield from narrower_value_variants(head_dims, names)


def narrower_value_variants(head_dims, names: str = ""):
    """(name, launch spec) of fwd_ws and the backward (bwd_ws, bwd_ws_split) with a v narrower than q/k (V, O, dO and
    dV tiles of v's head block) at the pairs of GLUON_VALUE_HEAD_DIMS whose q/k head block is in `head_dims`, causal,
    dense and varlen; then `qk_tail_variants`."""
    from gluon_compile import bwd_spec, fwd_spec
    for d, d_v in GLUON_VALUE_HEAD_DIMS:
        if config.head_block(d) in head_dims:
            for varlen in (False, True):
                name = f"fwd_ws d{d}/d_v{d_v} causal=True varlen={varlen}"
                if names in name:
                    yield name, fwd_spec(config.fwd_ws_tile(d, True), d, varlen, (False, False, True),
                                         head_dim_v=d_v)
                spec = bwd_spec(config.bwd_ws_tile(d, True, 1, False), d, varlen, (False, False, True),
                                head_dim_v=d_v)
                name = f"{spec.kernel.fn.__name__} d{d}/d_v{d_v} causal=True varlen={varlen}"
                if names in name:
                    yield name, spec
    yield from qk_tail_variants(head_dims, names)


def qk_tail_variants(head_dims, names: str = ""):
    """(name, launch spec) of the kernels with q/k as a 128-column block and a 64-column tail block (d192), causal:
    fwd_ws beside a v of 128 (config.fwd_ws_qk_tail, the d128 tile) where `head_dims` holds 128, dense and varlen;
    bwd_ws_split (config.bwd_ws_qk_tail) beside a v of 128 (dense; varlen deterministic) and of 192 (varlen) where it
    holds 256."""
    from gluon_compile import bwd_spec, fwd_spec
    if 128 in head_dims:
        for varlen in (False, True):
            name = f"fwd_ws d192/d_v128 q/k tail 64 causal=True varlen={varlen}"
            if names in name:
                yield name, fwd_spec(config.FWD_WS_SM90[128][True], 192, varlen, (False, False, True), head_dim_v=128,
                                     qk_tail=64)
    if 256 in head_dims:
        for d_v, varlen, det in ((128, False, False), (128, True, True), (192, True, False)):
            spec = bwd_spec(config.bwd_ws_tile(192, True), 192, varlen, (False, False, True), det, head_dim_v=d_v,
                            qk_tail=64)
            name = f"{spec.kernel.fn.__name__} d192/d_v{d_v} q/k tail 64 causal=True varlen={varlen} det={det}"
            if names in name:
                yield name, spec


def term_variants(d: int, names: str = ""):
    """(name, launch spec) of the warp-specialised kernels at head dim `d` with the score terms they take (the sink,
    the softcap, ALiBi, dropout: operators' takes_sink, supports_softcap, supports_alibi, supports_dropout), causal:
    fwd_ws with a softcap and a sink, with ALiBi, and with dropout (varlen); the backward with ALiBi, with a softcap,
    with both, with dropout, and with dropout and ALiBi (dense and varlen)."""
    from gluon_compile import bwd_spec, fwd_spec
    if d in config.FWD_WS_SM90:
        tile = config.FWD_WS_SM90[d][True]
        for tag, options in (("softcap sink", dict(softcap=30.0, sink=True)), ("alibi", dict(alibi=True)),
                             ("dropout", dict(dropout=True))):
            name = f"fwd_ws d{d} causal=True varlen=True {tag}"
            if names in name:
                yield name, fwd_spec(tile, d, True, (False, False, True), **options)
    if d in config.BWD_WS_SM90:
        tile = config.BWD_WS_SM90[d]
        terms = [("alibi", dict(alibi=True)), ("softcap", dict(softcap=30.0)),
                 ("softcap alibi", dict(softcap=30.0, alibi=True)), ("dropout", dict(dropout=True)),
                 ("dropout alibi", dict(dropout=True, alibi=True))]
        for tag, options in terms:
            for varlen in (False, True):
                spec = bwd_spec(tile, d, varlen, (False, False, True), **options)
                name = f"{spec.kernel.fn.__name__} d{d} causal=True varlen={varlen} {tag}"
                if names in name:
                    yield name, spec


def older_variants(head_blocks, names: str = ""):
    """(name, launch spec) of the older kernels (`variants`) at `head_blocks`, then the forward's with a learnable
    sink (`sink_variants`)."""
    for d, tag, varlen, role, spec in variants(head_blocks):
        name = f"{spec.kernel.fn.__name__} d{d} {tag} varlen={varlen}" + role.removeprefix("fwd").removeprefix("bwd")
        if names in name:
            yield name, spec
    yield from sink_variants(head_blocks, names)


def sink_variants(head_blocks, names: str = ""):
    """(name, launch spec) of the one-launch forward taking a learnable sink (its `Sink` argument) at `head_blocks`:
    causal and with every score feature, dense and varlen, with the sm_90 tiles of the causal table row."""
    for block_d in head_blocks:
        cfg = config.SM90[(block_d, True)]
        for tag in ("causal", "all"):
            for varlen in (False, True):
                t = _Tensors(block_d, varlen)
                fwd_tma = cfg.fwd_tma and not varlen
                spec = launch.forward(t.q, t.k, t.v, t.q, t.lse, t.seq, t.sizes, t.scores, FEATURE_SETS[tag]._replace(
                    VARLEN=varlen, USE_TMA=fwd_tma, TMA_LOADS=fwd_tma, EVEN_K=not varlen), cfg.forward, block_d,
                    (1, 1), t.sink)
                name = f"attn_fwd_kernel d{block_d} {tag} varlen={varlen} sink"
                if names in name:
                    yield name, spec


def small_variants(names: str = ""):
    """(name, launch spec) of the kernels around the attention kernels: D = rowsum(dO * O) with zeroing, the fp32 cast,
    the zero fill, the outside-rows fill and the varlen schedule builder."""
    from flash_attn_ck.backends.triton.runtime import varlen_schedule
    t = _Tensors(128, False)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    walk = varlen_schedule.TileWalk(128, 128, owns_keys=False)
    specs = {
        "bwd_preprocess": launch.bwd_preprocess(t.q, t.q, t.lse, (t.acc, t.acc, t.acc, t.sems), t.batch, t.sizes,
                                                False, 128),
        "cast_rows": launch.cast_rows(t.acc, t.q, (0, 0, 0), (0, 0, 0), 1, 1, 1, 128, 128),
        "zero_flat": launch.zero_flat(t.acc, t.sems),
        "fill_outside": launch.fill_outside(((cu, t.q.flatten(0, 1), 0, 0.0), (cu, t.lse.flatten(0, 1), 1,
                                                                                 float("inf")))),
        "varlen_schedule": varlen_schedule.launch_spec(cu, cu, walk, 512),
    }
    for name, spec in specs.items():
        if names in name:
            yield name, spec


def compile_any(spec) -> dict:
    """compile_one of an older or small kernel as launched; the Gluon kernels as their CPU tests compile them."""
    if spec.kernel.is_gluon():
        from gluon_compile import compile_spec
        t = time.time()
        kernel = compile_spec(spec)
        regs, stack = resource_usage(kernel.asm["cubin"])
        return dict(regs=regs, stack=stack, shared=kernel.metadata.shared, secs=time.time() - t, asm=kernel.asm)
    return compile_one(spec, as_launched=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="head blocks 64 and 128 only (every family still)")
    ap.add_argument("--only", default="", metavar="NAME_PART", help="only the variants whose names contain it")
    ap.add_argument("--dump", metavar="DIR", help="write each variant's PTX into DIR (to diff two trees)")
    args = ap.parse_args()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    head_blocks = [64, 128] if args.quick else [32, 64, 128, 256]
    gluon_dims = [64, 128] if args.quick else sorted(set(config.FWD_WS_SM90) | set(config.BWD_WS_SM90))
    print(f"triton {triton.__version__}, sm_90a, ptxas {_ptxas()}", flush=True)
    compiled = failed = 0
    for name, spec in (*older_variants(head_blocks, args.only), *value_head_dim_variants(args.only),
                       *gluon_variants(gluon_dims, args.only), *small_variants(args.only)):
        try:
            r = compile_any(spec)
        except Exception as e:
            failed += 1
            print(f"{name}: FAILED {type(e).__name__}: {_first_line(e)}", flush=True)
            continue
        compiled += 1
        ptx = r["asm"]["ptx"]
        if args.dump:
            Path(args.dump, "_".join(name.split()) + ".ptx").write_text(ptx)
        tma = ptx.count("cp.async.bulk.tensor") + ptx.count("cp.reduce.async.bulk")
        wgmma = ptx.count("wgmma.mma_async")
        print(f"{name}: regs={r['regs']} stack={r['stack']} smem={r['shared']} wgmma={wgmma} tma={tma} "
              f"({r['secs']:.1f}s)", flush=True)
    print(f"{compiled} compiled, {failed} failed")
    sys.exit(1 if failed else 0)


def _ptxas() -> str:
    from triton.backends.nvidia.compiler import get_ptxas
    return Path(get_ptxas(90).path).name


def _first_line(error: Exception) -> str:
    """The compiler's first error line of a failure, not its MLIR dump."""
    from flash_attn_ck.backends.triton.runtime.launch import _first_error
    return _first_error(error, "")[:300]


class _Tensors:
    """Meta tensors (no memory) of a bf16 call with `group` query heads per kv head: compiled unspecialised, only
    their dtypes reach the signatures (every int argument is an i32); as launched (compile_one), their sizes and
    strides are specialised too."""

    def __init__(self, d: int, varlen: bool, batch: int = 2, seqlen: int = 256, heads: int = 4, group: int = 1,
                 d_v: int | None = None):
        def make(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device="meta")
        rows = (batch * seqlen,) if varlen else (batch, seqlen)
        self.q = make(*rows, heads, d)
        self.k, self.v = make(*rows, heads // group, d), make(*rows, heads // group, d_v or d)
        self.out = make(*rows, heads, d_v or d)      # out and dO: v's head dim
        self.lse = make(heads, batch * seqlen, dtype=torch.float32) if varlen else make(batch, heads, seqlen,
                                                                                        dtype=torch.float32)
        self.acc = make(*rows, heads, d, dtype=torch.float32)
        self.sems = make(4, batch, heads, dtype=torch.int32)
        cu = make(batch + 1, dtype=torch.int32)
        self.seq = launch.SequenceArgs(cu, cu, make(heads, dtype=torch.float32), make(2, dtype=torch.int64))
        self.sink = make(heads, dtype=torch.float32)
        self.batch = batch
        self.sizes = launch.Sizes(heads, group, seqlen, seqlen, d)
        self.scores = launch.ScoreArgs(0.1, 0.0, 0.0, 0, 0)


if __name__ == "__main__":
    main()
