"""Where the backward's GPU time goes on training shapes (docs/workloads.md): for bench_workloads rows, the backward
time of each variant (the default backend, TritonBackend(ws=True), cuDNN where it runs the shape) and the GPU time
per kernel of one backward under torch.profiler; then the cost of filling and casting a 128 MiB fp32 accumulator
(the warp-specialised backward's per-launch dQ buffer) with torch and with the package's own kernels.

    PYTHONPATH=$PWD python scripts/lab/bwd_time_split.py --out $OUT/split.json [--only short,packed,...]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_bwd
import bench_workloads as bw
import triton
from launch_overhead import host_ms

import flash_attn_ck as fa
from flash_attn_ck.backends.triton import TritonBackend

VARIANTS = {"default": {}, "ws": dict(ws=True), "ws_old_fwd": dict(ws=True, fwd_ws=False)}


def kernel_split(run, reps: int = 3) -> dict[str, tuple[float, int]]:
    """GPU ms and launches per kernel name of one run() (the mean of `reps` profiled runs)."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    split = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:70]
            split[name][0] += event.time_range.elapsed_us() / 1e3 / reps
            split[name][1] += 1
    return {name: (round(ms, 4), n // reps) for name, (ms, n) in sorted(split.items(), key=lambda kv: -kv[1][0])}


def measure_row(w: bw.Workload, variants: list[str]) -> dict:
    leaves, varlen = bw.inputs(w, torch.device("cuda"))
    row = dict(name=w.name, bwd_tflop=w.flops("bwd") / 1e12)
    for name in variants:
        try:
            if name in VARIANTS:
                with fa.use_backend(TritonBackend(**VARIANTS[name])):
                    fwd = bench_bwd.make_runner(
                        "triton", *leaves, w.causal, window=w.window, deterministic=w.deterministic, varlen=varlen
                    )
                    timed = bench_bwd.time_passes(fwd, leaves)
                    out = fwd()
                    dout = torch.randn_like(out)
                    backward = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
                    split = kernel_split(backward)
                    timed["bwd_host_ms"] = host_ms(backward, 20)
            else:
                fwd = bench_bwd.make_runner(
                    name, *leaves, w.causal, window=w.window, deterministic=w.deterministic, varlen=varlen
                )
                timed = bench_bwd.time_passes(fwd, leaves)
                split = None
        except Exception as e:  # a variant that cannot run the row is a result
            row[name] = dict(error=f"{type(e).__name__}: {str(e)[:160]}")
            continue
        row[name] = dict(
            bwd_ms=timed["bwd_ms"],
            bwd_tflops=w.flops("bwd") / timed["bwd_ms"] / 1e9,
            fwd_ms=timed["fwd_ms"],
            kernels=split,
        )
        row[name]["bwd_host_ms"] = timed.get("bwd_host_ms")
        host = f", host {timed['bwd_host_ms']:.3f} ms" if "bwd_host_ms" in timed else ""
        print(f"  {name:8s} bwd {timed['bwd_ms']:.3f} ms {row[name]['bwd_tflops']:.0f} TF/s{host}", flush=True)
        for kernel, (ms, n) in list((split or {}).items())[:8]:
            print(f"      {ms:8.4f} ms x{n:<3d} {kernel}", flush=True)
    torch.cuda.empty_cache()
    return row


def fill_and_cast() -> dict:
    """128 MiB fp32 accumulator (32768 x 8 x 128): torch's zero_ of it whole and of a head-narrowed view of a twice as
    wide buffer, and the package's cast to bf16."""
    from flash_attn_ck.backends.triton import backend as tb
    from flash_attn_ck.backends.triton.runtime import launch

    acc = torch.empty(32768, 8, 128, device="cuda", dtype=torch.float32)
    wide = torch.empty(32768, 16, 128, device="cuda", dtype=torch.float32)
    dst = torch.empty(32768, 8, 128, device="cuda", dtype=torch.bfloat16)
    result = {
        "zero_ contiguous": triton.testing.do_bench(acc.zero_, return_mode="median"),
        "zero_ narrowed": triton.testing.do_bench(wide.narrow(1, 0, 8).zero_, return_mode="median"),
        "fill_(0) contiguous": triton.testing.do_bench(lambda: acc.fill_(0.0), return_mode="median"),
        "cast to bf16": triton.testing.do_bench(
            lambda: tb._cast(acc, dst, launch.bhr(acc, True), launch.bhr(dst, True), 8, 1, 32768, 128),
            return_mode="median",
        ),
    }
    split = kernel_split(acc.zero_)
    result["zero_ kernel"] = next(iter(split))
    for k, v in result.items():
        print(f"  {k}: {v}", flush=True)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="split.json")
    ap.add_argument("--only", default="short,packed,window,det,fill")
    args = ap.parse_args()
    only = args.only.split(",")
    rows = {w.name: w for w in bw.workloads(bw.FULL, 0)}
    chosen = []
    if "short" in only:
        chosen += [
            (w, ["default", "ws", "sdpa_cudnn"]) for w in rows.values() if w.family == "short" and w.head_dim == 128
        ]
    if "gqa" in only:
        chosen += [
            (w, ["default", "ws", "ws_old_fwd"])
            for w in rows.values()
            if w.family == "short" and w.heads != w.kv_heads and w.lengths[0] <= 1024
        ]
    if "packed" in only:
        chosen += [
            (rows["packed 32k tokens, 38 docs (longest 8192), GQA 32/8"], ["default"]),
            (rows["packed 32k tokens, 38 docs (longest 8192), MHA 16 heads"], ["default"]),
        ]
    if "window" in only:
        chosen += [(rows["window 1024, s8192 b2, GQA 32/8"], ["default"])]
    if "det" in only:
        chosen += [(rows["deterministic s8192 b2, MHA 16 heads"], ["default"])]
    report = dict(gpu=torch.cuda.get_device_name(), rows=[])
    for w, variants in chosen:
        print(w.name, flush=True)
        report["rows"].append(measure_row(w, variants))
        Path(args.out).write_text(json.dumps(report, indent=1))
    if "fill" in only:
        report["fill"] = fill_and_cast()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
