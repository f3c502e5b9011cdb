"""Compile the Triton backend's kernels for sm_90 on a machine without a GPU (ptxas from the triton
wheel), and print registers / shared memory / spills per kernel variant. Catches front-end errors
before spending device time.

    python scripts/triton_compile_check.py [--quick]
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flash_attn_ck.backends.triton import config  # noqa: E402
from flash_attn_ck.backends.triton.bwd_main import attn_bwd_kernel  # noqa: E402
from flash_attn_ck.backends.triton.bwd_postprocess import cast_rows_kernel  # noqa: E402
from flash_attn_ck.backends.triton.bwd_preprocess import bwd_preprocess_kernel  # noqa: E402
from flash_attn_ck.backends.triton.forward import attn_fwd_kernel  # noqa: E402

FLOATS = {"scale", "softcap", "dropout_p"}
POINTER_TYPES = {"Lse": "*fp32", "Delta": "*fp32", "dKacc": "*fp32", "dVacc": "*fp32",
                 "Sems": "*i32", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "slopes": "*fp32",
                 "rng_state": "*i64", "Src": "*fp32", "zero_a": "*fp32", "zero_b": "*fp32", "zero_c": "*fp32",
                 "zero_sem": "*i32"}
POINTERS = {"Q", "K", "V", "Out", "dOut", "dQ", "dK", "dV", "Dst"} | set(POINTER_TYPES)


def compile_one(kernel, constexprs: dict, num_warps: int, num_stages: int, dtype: str = "bf16"):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in POINTERS:
            sig[n] = POINTER_TYPES.get(n, f"*{dtype}")
        elif n in FLOATS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    if constexprs.get("DQ_ATOMIC"):
        sig["dQ"] = "*fp32"   # the backward's dQ argument is the fp32 accumulator in the atomic mode
    src = ASTSource(kernel, sig, constexprs)
    t = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    md = k.metadata
    return dict(regs=k.n_regs if hasattr(k, "n_regs") else None, spills=getattr(k, "n_spills", None),
                shared=md.shared, secs=time.time() - t, asm=k.asm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    features = dict(TOP_LEFT=False, HAS_LEFT=False, HAS_RIGHT=True, HAS_ALIBI=False, HAS_SOFTCAP=False,
                    HAS_DROPOUT=False)
    full = dict(features, HAS_LEFT=True, HAS_ALIBI=True, HAS_SOFTCAP=True, HAS_DROPOUT=True)
    plain = dict(features, HAS_RIGHT=False)   # no window: dense calls compile the EVEN_K variants
    blocks = [64, 128] if args.quick else [32, 64, 128, 256]
    for block_d in blocks:
        cfg = config.SM90[(block_d, True)]
        for feats, tag in ((plain, "plain"), (features, "causal"), (full, "all")):
            for varlen in (False, True):
                f, kv, dq = cfg.forward, cfg.bwd_kv, cfg.bwd_dq
                runs = [("fwd", attn_fwd_kernel, dict(BLOCK_M=f.block_m, BLOCK_N=f.block_n, BLOCK_D=block_d,
                                                      VARLEN=varlen, USE_TMA=cfg.fwd_tma and not varlen,
                                                      EVEN_K=not varlen, **feats), f)]
                for loop, atomic, det in ((True, False, True), (False, False, True), (False, True, False)):
                    runs.append((f"bwd loop={loop} dq_atomic={atomic} det={det}", attn_bwd_kernel,
                                 dict(BLOCK_M=kv.block_m, BLOCK_N=kv.block_n, DQ_BLOCK_M=dq.block_m,
                                      DQ_BLOCK_N=dq.block_n, BLOCK_D=block_d, VARLEN=varlen, LOOP_GROUP=loop,
                                      DQ_ATOMIC=atomic, DETERMINISTIC=det, USE_TMA=not varlen,
                                      TMA_LOADS=not varlen and cfg.bwd_tma == "all",
                                      DP_FIRST=cfg.bwd_dp_first, EVEN_K=cfg.bwd_even_k and not varlen,
                                      **feats), kv))
                for name, kernel, cx, tile in runs:
                    try:
                        r = compile_one(kernel, cx, tile.num_warps, tile.num_stages)
                        tma = r["asm"]["ptx"].count("cp.async.bulk.tensor") + r["asm"]["ptx"].count("cp.reduce.async.bulk")
                        wgmma = r["asm"]["ptx"].count("wgmma.mma_async")
                        print(f"d{block_d} {tag:6s} varlen={varlen!s:5s} {name:38s} regs={r['regs']} spills={r['spills']} "
                              f"smem={r['shared']} wgmma={wgmma} tma={tma} ({r['secs']:.1f}s)", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"d{block_d} {tag} varlen={varlen} {name}: FAILED {type(e).__name__}: {str(e)[:400]}")
    pre = compile_one(bwd_preprocess_kernel, dict(BLOCK_M=64, BLOCK_D=128, VARLEN=False, ZERO_BLOCK=1024, ZERO_A=True,
                                                  ZERO_B=True, ZERO_C=True, ZERO_SEM=True), 4, 1)
    post = compile_one(cast_rows_kernel, dict(BLOCK_R=64, BLOCK_D=128), 4, 1)
    print(f"preprocess regs={pre['regs']} postprocess regs={post['regs']}")


if __name__ == "__main__":
    main()
