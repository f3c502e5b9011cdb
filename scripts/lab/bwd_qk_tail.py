"""Check and time bwd_ws_split with q/k as a 128-column block and a tail block (config.BWD_WS_QK_TAIL) against the
256-column head block it runs otherwise, on calls of a head dim in 129-192 (MLA's (192, 128), d192): the gradients of
flash_attn_func against the float64 oracle under the 2x rule (tests/cases.py's check, both settings), then backward
TFLOP/s (docs/semantics.md §FLOPs) of each setting beside the one-launch backward, all in this process.

    python3 scripts/lab/bwd_qk_tail.py [--pairs 192:128,192:192] [--shapes 16:16:2048,32:8:8192] [--causal 1]

b = 16384 / s. Prints PASS/FAIL per (pair, setting) and a TIME line per (pair, shape). Needs an sm_90 GPU.
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
    ap.add_argument("--pairs", default="192:128,192:192", help="d:d_v,...")
    ap.add_argument("--shapes", default="16:16:2048,32:8:2048,16:16:8192,32:8:8192", help="h:h_k:s,...")
    ap.add_argument("--causal", type=int, default=1)
    return ap.parse_args()


def backward_flops(batch, heads, seqlen, d, d_v, causal):
    return 2 * batch * heads * seqlen * seqlen * (3 * d + 2 * d_v) / (2 if causal else 1)


def backward_call(q, k, v, causal: bool):
    """A forward of flash_attn_func, and the call that runs its backward again and again."""
    out = fa.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def main():
    args = parse_args()
    failed = False
    for pair in args.pairs.split(","):
        d, d_v = map(int, pair.split(":"))
        for tail in (False, True):
            config.BWD_WS_QK_TAIL = tail
            ok = passes_the_2x_rule(TritonBackend(ws=True), d, d_v, args.causal)
            failed |= not ok
            print(f"{'PASS' if ok else 'FAIL'} d{d}/d_v{d_v} BWD_WS_QK_TAIL={tail}", flush=True)
        for shape in args.shapes.split(","):
            heads, heads_k, seqlen = map(int, shape.split(":"))
            batch = 16384 // seqlen
            q, k = (torch.randn(batch, seqlen, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for h in (heads, heads_k))
            v = torch.randn(batch, seqlen, heads_k, d_v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            flops = backward_flops(batch, heads, seqlen, d, d_v, args.causal)
            line = []
            for name, backend, tail in (("one-launch", TritonBackend(ws=False), False),
                                        ("block 256", TritonBackend(ws=True), False),
                                        ("128 + tail", TritonBackend(ws=True), True)):
                config.BWD_WS_QK_TAIL = tail
                line.append(tflops_cell(name, flops, backend, lambda: backward_call(q, k, v, bool(args.causal))))
            print(f"TIME d{d}/d_v{d_v} h{heads}/{heads_k} s{seqlen} causal={args.causal} bwd TF/s: " + ", ".join(line),
                  flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
