"""Compile the Triton backend's kernels for sm_90 on a machine without a GPU (ptxas from the triton
wheel), and print registers / stack frame (spills) / shared memory / wgmma and TMA instruction counts
per kernel variant. Catches front-end errors before spending device time.

Each variant is a launch spec (flash_attn_ck/backends/triton/launch.py) built from meta tensors by
the same functions backend.py launches through, so the signatures follow the kernels by
construction; a variant is a `launch.Features` value (`variants`, which scripts/ptx_compare.py
compares between two trees, compiled as launched).

    python scripts/triton_compile_check.py [--quick] [--dump DIR]
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
import torch

from flash_attn_ck.backends.triton import config, launch
from flash_attn_ck.backends.triton.launch import Features

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
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
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
# The backward's modes: (LOOP_GROUP, DQ_ATOMIC, DETERMINISTIC). The accumulator epilogue (not LOOP_GROUP) runs for
# GQA calls, so its variants have two query heads per kv head.
BWD_MODES = ((True, False, True), (False, False, True), (False, True, False))


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
                for loop, atomic, det in BWD_MODES:
                    t = _Tensors(block_d, varlen, group=1 if loop else 2, seqlen=SEQLENS.get(tag, 256))
                    features = feats._replace(
                        VARLEN=varlen, LOOP_GROUP=loop, DQ_ATOMIC=atomic, DETERMINISTIC=det, USE_TMA=not varlen,
                        TMA_LOADS=not varlen and cfg.bwd_tma == "all", DP_FIRST=cfg.bwd_dp_first,
                        EVEN_K=cfg.bwd_even_k and not varlen)
                    yield block_d, tag, varlen, f"bwd loop={loop} dq_atomic={atomic} det={det}", launch.bwd_main(
                        t.q, t.k, t.v, t.q, t.lse, t.lse, t.acc if atomic else t.q, t.k, t.v, t.acc, t.acc,
                        t.sems, t.seq, t.batch, t.sizes, t.scores, features, cfg.bwd_kv, cfg.bwd_dq, block_d, (1, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dump", metavar="DIR", help="write each variant's PTX into DIR (to diff two trees)")
    args = ap.parse_args()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for block_d, tag, varlen, role, spec in variants([64, 128] if args.quick else [32, 64, 128, 256]):
        label = f"d{block_d} {tag:7s} varlen={varlen!s:5s} {role:38s}"
        try:
            r = compile_one(spec)
            if args.dump:
                Path(args.dump, "_".join(label.split()) + ".ptx").write_text(r["asm"]["ptx"])
            ptx = r["asm"]["ptx"]
            tma = ptx.count("cp.async.bulk.tensor") + ptx.count("cp.reduce.async.bulk")
            wgmma = ptx.count("wgmma.mma_async")
            print(f"{label} regs={r['regs']} stack={r['stack']} "
                  f"smem={r['shared']} wgmma={wgmma} tma={tma} ({r['secs']:.1f}s)", flush=True)
        except Exception as e:
            print(f"d{block_d} {tag} varlen={varlen} {role}: FAILED {type(e).__name__}: {str(e)[:400]}")
    t = _Tensors(128, False)
    pre = compile_one(launch.bwd_preprocess(t.q, t.q, t.lse, (t.acc, t.acc, t.acc, t.sems),
                                            t.batch, t.sizes, False, 128))
    post = compile_one(launch.cast_rows(t.acc, t.q, (0, 0, 0), (0, 0, 0), 1, 1, 1, 128, 128))
    zero = compile_one(launch.zero_flat(t.acc, t.sems))
    print(f"preprocess regs={pre['regs']} stack={pre['stack']} smem={pre['shared']} "
          f"postprocess regs={post['regs']} stack={post['stack']} smem={post['shared']} "
          f"zero regs={zero['regs']} stack={zero['stack']} smem={zero['shared']}")


class _Tensors:
    """Meta tensors (no memory) of a bf16 call with `group` query heads per kv head: compiled unspecialised, only
    their dtypes reach the signatures (every int argument is an i32); as launched (compile_one), their sizes and
    strides are specialised too."""

    def __init__(self, d: int, varlen: bool, batch: int = 2, seqlen: int = 256, heads: int = 4, group: int = 1):
        def make(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device="meta")
        rows = (batch * seqlen,) if varlen else (batch, seqlen)
        self.q = make(*rows, heads, d)
        self.k, self.v = (make(*rows, heads // group, d) for _ in range(2))
        self.lse = make(heads, batch * seqlen, dtype=torch.float32) if varlen else make(batch, heads, seqlen,
                                                                                        dtype=torch.float32)
        self.acc = make(*rows, heads, d, dtype=torch.float32)
        self.sems = make(4, batch, heads, dtype=torch.int32)
        cu = make(batch + 1, dtype=torch.int32)
        self.seq = launch.SequenceArgs(cu, cu, make(heads, dtype=torch.float32), make(2, dtype=torch.int64))
        self.batch = batch
        self.sizes = launch.Sizes(heads, group, seqlen, seqlen, d)
        self.scores = launch.ScoreArgs(0.1, 0.0, 0.0, 0, 0)


if __name__ == "__main__":
    main()
