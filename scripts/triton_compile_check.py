"""Compile the Triton backend's kernels for sm_90 on a machine without a GPU (ptxas from the triton
wheel), and print registers / stack frame (spills) / shared memory / wgmma and TMA instruction counts
per kernel variant. Catches front-end errors before spending device time.

Each variant is a launch spec (flash_attn_ck/backends/triton/launch.py) built from meta tensors by
the same functions backend.py launches through, so the signatures follow the kernels by
construction; a variant is a `launch.Features` value.

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


def compile_one(spec: launch.LaunchSpec):
    """Compile a launch spec for sm_90; its signature comes from the spec's own argument values."""
    sig, constexprs = spec.signature()
    src = ASTSource(spec.kernel, sig, constexprs)
    t = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    md = k.metadata
    regs, stack = resource_usage(k.asm["cubin"])
    return dict(regs=regs, stack=stack, shared=md.shared, secs=time.time() - t, asm=k.asm)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dump", metavar="DIR", help="write each variant's PTX into DIR (to diff two trees)")
    args = ap.parse_args()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    causal = Features(HAS_RIGHT=True)
    full = causal._replace(HAS_LEFT=True, HAS_ALIBI=True, HAS_SOFTCAP=True, HAS_DROPOUT=True)
    plain = Features()   # no window: dense calls compile the EVEN_K variants
    blocks = [64, 128] if args.quick else [32, 64, 128, 256]
    for block_d in blocks:
        cfg = config.SM90[(block_d, True)]
        for feats, tag in ((plain, "plain"), (causal, "causal"), (full, "all")):
            for varlen in (False, True):
                t = _Tensors(block_d, varlen)
                f, kv, dq = cfg.forward, cfg.bwd_kv, cfg.bwd_dq
                fwd_tma = cfg.fwd_tma and not varlen
                runs = [("fwd", launch.forward(
                    t.q, t.k, t.v, t.q, t.lse, t.seq, t.sizes, t.scores,
                    feats._replace(VARLEN=varlen, USE_TMA=fwd_tma, TMA_LOADS=fwd_tma, EVEN_K=not varlen),
                    f, block_d, (1, 1)))]
                for loop, atomic, det in ((True, False, True), (False, False, True), (False, True, False)):
                    features = feats._replace(
                        VARLEN=varlen, LOOP_GROUP=loop, DQ_ATOMIC=atomic, DETERMINISTIC=det, USE_TMA=not varlen,
                        TMA_LOADS=not varlen and cfg.bwd_tma == "all", DP_FIRST=cfg.bwd_dp_first,
                        EVEN_K=cfg.bwd_even_k and not varlen)
                    runs.append((f"bwd loop={loop} dq_atomic={atomic} det={det}", launch.bwd_main(
                        t.q, t.k, t.v, t.q, t.lse, t.lse, t.acc if atomic else t.q, t.k, t.v, t.acc, t.acc, t.sems,
                        t.seq, t.batch, t.sizes, t.scores, features, kv, dq, block_d, (1, 1))))
                for name, spec in runs:
                    label = f"d{block_d} {tag:6s} varlen={varlen!s:5s} {name:38s}"
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
                        print(f"d{block_d} {tag} varlen={varlen} {name}: FAILED {type(e).__name__}: {str(e)[:400]}")
    t = _Tensors(128, False)
    pre = compile_one(launch.bwd_preprocess(t.q, t.q, t.lse, t.seq.cu_seqlens_q, (t.acc, t.acc, t.acc, t.sems),
                                            t.batch, t.sizes, False, 128))
    post = compile_one(launch.cast_rows(t.acc, t.q, (0, 0, 0), (0, 0, 0), 1, 1, 1, 128, 128))
    print(f"preprocess regs={pre['regs']} stack={pre['stack']} smem={pre['shared']} "
          f"postprocess regs={post['regs']} stack={post['stack']} smem={post['shared']}")


class _Tensors:
    """Meta tensors (no memory) of a bf16 call: only their dtypes reach the signatures (every int
    argument compiles unspecialised, as i32)."""

    def __init__(self, d: int, varlen: bool, batch: int = 2, seqlen: int = 256, heads: int = 4):
        def make(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device="meta")
        rows = (batch * seqlen,) if varlen else (batch, seqlen)
        self.q, self.k, self.v = (make(*rows, heads, d) for _ in range(3))
        self.lse = make(heads, batch * seqlen, dtype=torch.float32) if varlen else make(batch, heads, seqlen,
                                                                                        dtype=torch.float32)
        self.acc = make(*rows, heads, d, dtype=torch.float32)
        self.sems = make(4, batch, heads, dtype=torch.int32)
        cu = make(batch + 1, dtype=torch.int32)
        self.seq = launch.SequenceArgs(cu, cu, make(heads, dtype=torch.float32), make(2, dtype=torch.int64), 0)
        self.batch = batch
        self.sizes = launch.Sizes(heads, 1, seqlen, seqlen, d)
        self.scores = launch.ScoreArgs(0.1, 0.0, 0.0, 0, 0)


if __name__ == "__main__":
    main()
