"""Check and time the warp-specialised forward on calls whose v is narrower than q/k (MLA's (192, 128)), per tile:
out and lse of flash_attn_func against the float64 oracle under the 2x rule (tests/cases.py's check), then forward
TFLOP/s (docs/semantics.md §FLOPs) of each fwd_ws tile beside the one-launch forward and the (d, d) call with v
padded with zeros to q/k's head dim (what fwd_ws ran before it took v's own head dim), all in this process;
--qk-tail: with config.FWD_WS_QK_TAIL on (q/k as a 128-column block and a tail block where it applies).

    python3 scripts/lab/fwd_value_head_dim.py [--pairs 192:128,128:64] [--tiles 128x64x2x1x0,...]
        [--shapes 16:16:2048,32:8:8192] [--causal 1] [--qk-tail]

Tiles: config.FwdWsTile.parse's 'BMxBNxSTAGESxOVERLAPxPINGPONG[...]'; the first is the table's when none is given.
b = 16384 / s. Prints PASS/FAIL per pair and tile, a TIME line per (pair, shape). Needs an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
from value_head_dim_check import passes_the_2x_rule, tflops_cell

import flash_attn_ck as fa
from flash_attn_ck.backends.triton import TritonBackend, config


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", default="192:128,128:64", help="d:d_v,...")
    ap.add_argument("--tiles", default="", help="fwd_ws tiles to time beside the table's (comma-separated)")
    ap.add_argument("--shapes", default="16:16:2048,32:8:2048,16:16:8192,32:8:8192", help="h:h_k:s,...")
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--qk-tail", action="store_true", help="config.FWD_WS_QK_TAIL on")
    return ap.parse_args()


def forward_flops(batch, heads, seqlen, d, d_v, causal):
    return 2 * batch * heads * seqlen * seqlen * (d + d_v) / (2 if causal else 1)


def main():
    args = parse_args()
    config.FWD_WS_QK_TAIL = args.qk_tail
    failed = False
    for pair in args.pairs.split(","):
        d, d_v = map(int, pair.split(":"))
        tiles = [config.fwd_ws_tile(d, bool(args.causal), d_v)]
        tiles += [config.FwdWsTile.parse(t) for t in args.tiles.split(",") if t]
        for tile in tiles:
            ok = passes_the_2x_rule(TritonBackend(fwd_ws=True, ws=False, fwd_ws_tile=tile), d, d_v, args.causal)
            failed |= not ok
            print(f"{'PASS' if ok else 'FAIL'} d{d}/d_v{d_v} tile {tile}", flush=True)
        for shape in args.shapes.split(","):
            heads, heads_k, seqlen = map(int, shape.split(":"))
            batch = 16384 // seqlen
            q = torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(batch, seqlen, heads_k, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(batch, seqlen, heads_k, d_v, device="cuda", dtype=torch.bfloat16)
            padded = torch.nn.functional.pad(v, (0, d - d_v))
            flops = forward_flops(batch, heads, seqlen, d, d_v, args.causal)
            runs = {"one-launch": (TritonBackend(fwd_ws=False, ws=False), v),
                    "padded": (TritonBackend(fwd_ws=True, ws=False), padded)}
            runs.update({f"fwd_ws {tile}": (TritonBackend(fwd_ws=True, ws=False, fwd_ws_tile=tile), v)
                         for tile in tiles})
            line = [tflops_cell(name, flops, backend,
                                lambda value=value: lambda: fa.flash_attn_func(q, k, value, causal=bool(args.causal)))
                    for name, (backend, value) in runs.items()]
            print(f"TIME d{d}/d_v{d_v} h{heads}/{heads_k} s{seqlen} causal={args.causal} TF/s: " + ", ".join(line),
                  flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
