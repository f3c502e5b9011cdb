"""Offline tile search for the Triton backward on sm_90 (feeds config.SM90; never on the call path).

For each head-dim block, times the full backward (bf16, b = 16384/s, h = 2048/d, s = 8192, not causal)
for each key-tile candidate with the current dQ tile (default dQ mode), then each dQ-pass candidate with
the best key tile (pass mode, which GQA and deterministic calls use), and the atomic-dQ mode; prints one
line per candidate and the winners.

    python scripts/triton_tune.py [--dims 64,128,256] [--seq 8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bwd import measure  # noqa: E402
from flash_attn_ck.backends.triton.config import SM90, Tile  # noqa: E402

KV = {64: [(64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
      128: [(64, 128, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3)],
      256: [(64, 64, 8, 1), (64, 64, 8, 2), (32, 64, 4, 2), (32, 128, 8, 1), (64, 128, 8, 1)]}
DQ = {64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
      128: [(64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
      256: [(128, 64, 8, 1), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 128, 8, 1)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--json", default="", help="write the winners here (bench_bwd.py --tuned reads it)")
    args = ap.parse_args()
    s = args.seq
    winners = {}
    for d in map(int, args.dims.split(",")):
        base = SM90[(d, False)]
        h, b = 2048 // d, 16384 // s

        def run(cfg, name="triton"):
            try:
                return measure(name, b, h, h, s, d, False, configs=cfg)["bwd_tflops"]
            except Exception as e:  # noqa: BLE001
                print(f"  failed: {type(e).__name__}: {str(e)[:120]}")
                return 0.0
        best_kv, best = base.bwd_kv, 0.0
        for cand in KV[d]:
            tf = run(dataclasses.replace(base, bwd_kv=Tile(*cand)))
            print(f"d{d} kv {cand} dq {tuple(dataclasses.astuple(base.bwd_dq))}: {tf:.0f} TF/s", flush=True)
            if tf > best:
                best_kv, best = Tile(*cand), tf
        best_dq = base.bwd_dq   # compared in the pass mode, which GQA and deterministic calls use
        best = run(dataclasses.replace(base, bwd_kv=best_kv), "triton-dq-pass")
        print(f"d{d} kv {dataclasses.astuple(best_kv)} dq {dataclasses.astuple(best_dq)} (dQ pass): {best:.0f} TF/s")
        for cand in DQ[d][1:]:
            tf = run(dataclasses.replace(base, bwd_kv=best_kv, bwd_dq=Tile(*cand)), "triton-dq-pass")
            print(f"d{d} kv {dataclasses.astuple(best_kv)} dq {cand}: {tf:.0f} TF/s", flush=True)
            if tf > best:
                best_dq, best = Tile(*cand), tf
        atomic = run(dataclasses.replace(base, bwd_kv=best_kv, bwd_dq=best_dq), "triton-atomic-dq")
        print(f"WINNER d{d}: kv {dataclasses.astuple(best_kv)} dq {dataclasses.astuple(best_dq)} {best:.0f} TF/s;"
              f" atomic-dQ mode with that kv tile: {atomic:.0f} TF/s", flush=True)
        winners[d] = dict(bwd_kv=dataclasses.astuple(best_kv), bwd_dq=dataclasses.astuple(best_dq), tflops=best,
                          atomic_dq_tflops=atomic)
    if args.json:
        Path(args.json).write_text(json.dumps(winners, indent=1))


if __name__ == "__main__":
    main()
