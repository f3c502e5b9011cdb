"""Measure the backward's peak extra memory with and without a workspace cap, per backend (CUDA).

    python scripts/memory_cap.py [--seqlen 8192] [--heads 64 --heads-k 8 --head-dim 128] [--cap-gib 1]

For each backend and cap it runs one deterministic GQA backward and reports the plan's peak, the
measured `torch.cuda.max_memory_allocated` above the memory held before the call (inputs, out, lse),
and whether the measurement stayed under the cap. Prints a markdown table; `--json` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import flash_attn_ck as fa
from flash_attn_ck.core.plan import format_bytes


def measure(backend: str, cap, q, k, v, causal: bool):
    out, lse, _ = fa.flash_attn_fwd(q, k, v, causal=causal, deterministic=True, backend=backend)
    dout = torch.randn_like(out)
    plan = fa.backward_workspace(q, k, v, causal=causal, deterministic=True, max_workspace_bytes=cap,
                                 backends=(backend,))[backend]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    grads = fa.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True, backend=backend,
                              max_workspace_bytes=cap)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    extra = torch.cuda.max_memory_allocated() - before - grad_bytes   # beyond inputs and the results
    del grads
    return dict(backend=backend, cap=cap, chunks=len(plan.chunks), planned_peak=plan.peak_bytes,
                unchunked=plan.unchunked_bytes, measured_extra=extra, seconds=seconds,
                under_cap=cap < 0 or extra <= cap)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--heads-k", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cap-gib", type=float, default=1.0)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backends", default="triton,reference")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape_q = (args.batch, args.seqlen, args.heads, args.head_dim)
    shape_k = (args.batch, args.seqlen, args.heads_k, args.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16)
    cap = int(args.cap_gib * (1 << 30))
    rows = []
    for backend in args.backends.split(","):
        for limit in (-1, cap):
            rows.append(measure(backend, limit, q, k, v, args.causal))
            torch.cuda.empty_cache()
    print(f"\nDeterministic GQA backward, b={args.batch} s={args.seqlen} h={args.heads}/{args.heads_k} "
          f"d={args.head_dim} bf16{' causal' if args.causal else ''}, {torch.cuda.get_device_name()}")
    print("| backend | cap | chunks | planned peak | measured extra | under cap | time |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {'none' if r['cap'] < 0 else format_bytes(r['cap'])} | {r['chunks']} | "
              f"{format_bytes(r['planned_peak'])} | {format_bytes(r['measured_extra'])} | "
              f"{'yes' if r['under_cap'] else 'NO'} | {r['seconds']:.2f} s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
