"""Deterministic causal backward: the warp-specialised kernel's head-major grid beside the key-major one
(config.WsTile.key_major), d128, MHA and GQA at s8192 (docs/workloads.md §Deterministic). Per case: backward
ms and TF/s (median of --repeats, CUDA events), whether two runs are bit-identical, and the largest difference
from the non-deterministic backward.

    python scripts/lab/det_grid.py [--shapes b:h:h_k:s,...] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import flash_attn_ck as fa
from flash_attn_ck.backends.triton import TritonBackend, config


def backward_ms(q, k, v, dout, backend, deterministic, repeats):
    out = fa.flash_attn_func(q, k, v, causal=True, deterministic=deterministic, backend=backend)
    times, grads = [], None
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:]), grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2:16:16:8192,2:32:8:8192,4:16:16:4096")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    head_major = config.BWD_WS_SM90[128]
    tiles = {"head-major": replace(head_major, key_major=False),
             "key-major": replace(head_major, key_major=True)}
    for shape in args.shapes.split(","):
        b, h, h_k, s = map(int, shape.split(":"))
        torch.manual_seed(0)
        q = torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, s, h_k, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        flops = 2.5 * 4 * b * h * s * s * 128 / 2
        _, free = backward_ms(q, k, v, dout, "triton", False, 1)
        for name, tile in tiles.items():
            backend = TritonBackend(ws_tile=tile)
            ms, grads = backward_ms(q, k, v, dout, backend, True, args.repeats)
            _, again = backward_ms(q, k, v, dout, backend, True, 1)
            same = all(torch.equal(a, c) for a, c in zip(grads, again))
            diff = max((a.float() - c.float()).abs().max().item() for a, c in zip(grads, free))
            print(f"b{b} h{h}/{h_k} s{s} {name:10s} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TF/s "
                  f"bit-identical={same} max|d - nondet|={diff:.3e}", flush=True)


if __name__ == "__main__":
    main()
