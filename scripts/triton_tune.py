"""Offline tile search for the Triton backward on sm_90 (feeds config.SM90; never on the call path).

Both backward roles (key tile, dQ-pass query tile) run in one launch, so a candidate is a pair of
tiles with one num_warps and one num_stages: (kv block_m, kv block_n, dq block_m, dq block_n, warps,
stages). For each head-dim block, times the full backward (bf16, b = 16384/s, h = 2048/d, s = 8192)
of each candidate in the dQ-pass mode (what GQA and deterministic calls use, and the default except
where config says otherwise), then the atomic-dQ mode with the winning key tile; prints one line per
candidate and the winners.

    python scripts/triton_tune.py [--dims 64,128,256] [--seq 8192] [--causal] [--short] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bwd import measure

from flash_attn_ck.backends.triton.config import SM90, Tile

# The first candidate of each list is the current config.SM90 row; FlexAttention's H100 defaults
# (64 x 128 key tile, 128 x 64 query tile, 8 warps, 3 stages) are among the others.
CANDIDATES = {
    64: [(32, 128, 128, 64, 4, 3), (64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 4, 3), (32, 128, 64, 64, 4, 3),
         (64, 64, 64, 64, 4, 3)],
    128: [(64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 8, 2), (64, 128, 64, 128, 8, 3), (64, 64, 64, 64, 4, 3),
          (32, 128, 128, 32, 8, 3)],
    256: [(64, 64, 128, 64, 8, 1), (64, 64, 64, 64, 8, 1), (64, 64, 64, 64, 8, 2), (32, 64, 64, 32, 4, 2),
          (64, 32, 32, 64, 4, 2)],
}
# Short sequences (`--short`): the kernel is bound by per-program latency (prologue loads, pipeline
# fill, epilogue) rather than by the tensor cores, so tiles that leave room for two CTAs per SM.
SHORT_CANDIDATES = {
    64: [(32, 128, 128, 64, 4, 3), (32, 64, 64, 32, 4, 2), (64, 64, 64, 64, 4, 2), (32, 64, 64, 64, 4, 3),
         (64, 64, 64, 64, 4, 3)],
    128: [(64, 128, 128, 64, 8, 3), (64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 4, 2), (64, 64, 64, 64, 8, 2),
          (32, 128, 128, 32, 4, 2)],
    256: [(64, 64, 128, 64, 8, 1), (32, 64, 64, 32, 4, 1), (64, 32, 32, 64, 4, 1), (32, 32, 32, 32, 4, 2),
          (64, 64, 64, 64, 8, 1)],
}


def configs_for(base, cand):
    kv_m, kv_n, dq_m, dq_n, warps, stages = cand
    return dataclasses.replace(base, bwd_kv=Tile(kv_m, kv_n, warps, stages), bwd_dq=Tile(dq_m, dq_n, warps, stages))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--short", action="store_true", help="search SHORT_CANDIDATES (use with --seq 512 or 1024)")
    ap.add_argument("--json", default="", help="write the winners here (bench_bwd.py --tuned reads it)")
    args = ap.parse_args()
    s = args.seq
    winners = {}
    for d in map(int, args.dims.split(",")):
        base = SM90[(d, args.causal)]
        h, b = 2048 // d, 16384 // s

        def run(cfg, name):
            try:
                return measure(name, b, h, h, s, d, args.causal, configs=cfg)["bwd_tflops"]
            except Exception as e:
                print(f"  failed: {type(e).__name__}: {str(e)[:160]}")
                return 0.0
        candidates = (SHORT_CANDIDATES if args.short else CANDIDATES)[d]
        best_cand, best = candidates[0], 0.0
        for cand in candidates:
            tf = run(configs_for(base, cand), "triton-dq-pass")
            print(f"d{d} s{s} causal={args.causal} {cand}: {tf:.0f} TF/s", flush=True)
            if tf > best:
                best_cand, best = cand, tf
        atomic = run(configs_for(base, best_cand), "triton-atomic-dq")
        print(f"WINNER d{d} s{s} causal={args.causal}: {best_cand} {best:.0f} TF/s (dQ pass); atomic-dQ mode with it: "
              f"{atomic:.0f} TF/s", flush=True)
        cfg = configs_for(base, best_cand)
        winners[d] = dict(bwd_kv=dataclasses.astuple(cfg.bwd_kv), bwd_dq=dataclasses.astuple(cfg.bwd_dq), tflops=best,
                          atomic_dq_tflops=atomic)
    if args.json:
        Path(args.json).write_text(json.dumps(winners, indent=1))


if __name__ == "__main__":
    main()
