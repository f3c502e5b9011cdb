"""Host (Python) cost of one call against its GPU time, for the small shapes where a backward takes
well under a millisecond and the launch path can dominate.

Per shape: the GPU span of one backward issued alone (CUDA events around one call after a sync; its
kernels, plus any launch gaps between them), the wall time per call when calls are issued back to
back (do_bench: bounded by the host when the host is the slower), and the host time of issuing
alone. `--breakdown`: host time of each layer; `--kernels`: GPU time of each kernel (torch.profiler);
`--profile`: cProfile, top entries by own time.

    python scripts/launch_overhead.py [--shapes d:h:h_k:s:causal,...] [--backend triton] [--kernels] [--profile]
        [--tma auto|on|off] [--dq-mode auto|pass|atomic] [--forward]

`--forward`: the same for the forward (a call of flash_attn_func without autograd).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_attn_ck as fa


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64:32:32:512:1,128:16:16:512:1,128:16:16:1024:1")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="host time of each layer of the backward alone")
    ap.add_argument("--kernels", action="store_true", help="GPU time of each kernel of the backward (torch.profiler)")
    ap.add_argument("--tma", choices=["auto", "on", "off"], default="auto",
                    help="triton: TritonBackend(use_tma=None/True/False), e.g. to compare TMA and pointer tiles")
    ap.add_argument("--dq-mode", default="auto", help="triton: TritonBackend(dq_mode=...)")
    ap.add_argument("--forward", action="store_true", help="time the forward instead of the backward")
    args = ap.parse_args()
    if args.backend == "triton":
        from flash_attn_ck.backends.triton import TritonBackend
        # every call below takes this configured instance as its backend=
        args.backend = TritonBackend(use_tma=dict(auto=None, on=True, off=False)[args.tma], dq_mode=args.dq_mode)
    for spec in args.shapes.split(","):
        measure_shape(args, *(int(x) for x in spec.split(":")))


def measure_shape(args, d: int, h: int, h_k: int, s: int, causal: int) -> None:
    """One row: GPU span, wall and host issue time per call, then what the flags ask for."""
    b = 16384 // s
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, s, h_k, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, causal=bool(causal), backend=args.backend)
    dout = torch.randn_like(out)

    def bwd():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    if args.forward:
        def bwd():   # the forward, timed in the backward's place
            with torch.no_grad():
                return fa.flash_attn_func(q, k, v, causal=bool(causal), backend=args.backend)
    bwd()
    wall = triton.testing.do_bench(bwd, warmup=25, rep=200, return_mode="median")
    span = median_span(bwd)
    host = host_ms(bwd)
    print(f"d{d} h{h}/{h_k} s{s} causal={causal}: GPU span of one call {span:.3f} ms, wall per call {wall:.3f} ms, "
          f"host issue {host:.3f} ms", flush=True)
    if args.breakdown:
        (forward_breakdown if args.forward else breakdown)(q, k, v, out, dout, bool(causal), args.backend)
    if args.kernels:
        kernel_times(bwd)
    if args.profile:
        python_profile(bwd)


def median_span(fn, calls: int = 20) -> float:
    """Median GPU time (ms) from one call's first to its last kernel, by CUDA events."""
    spans = []
    for _ in range(calls):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        spans.append(begin.elapsed_time(end))
    return sorted(spans)[len(spans) // 2]


def python_profile(fn, calls: int = 100) -> None:
    """cProfile of `calls` calls, the 18 functions with the most own time."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


def kernel_times(fn, calls: int = 20) -> None:
    """Mean GPU time per backward of each kernel it launches, from torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms = event.device_time_total / calls / 1e3
            total += ms
            print(f"    kernel {event.key[:60]:60s} {ms:.3f} ms x {event.count / calls:g} per call", flush=True)
    print(f"    all kernels {total:.3f} ms per call", flush=True)


def host_ms(fn, n=50) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = (time.perf_counter() - start) / n * 1e3
    torch.cuda.synchronize()
    return elapsed


def breakdown(q, k, v, out, dout, causal, backend_name):  # backend_name: a name or an instance
    """Host ms per call of: the autograd path, the torch.library op, the pipeline function, the
    backend's launches with a ready workspace."""
    from flash_attn_ck.core.inputs import describe_call
    from flash_attn_ck.core.options import AttentionOptions
    from flash_attn_ck.core.problem import AttentionParams
    from flash_attn_ck.pipeline.backward import attention_backward
    from flash_attn_ck.pipeline.chunking import backward_plan
    from flash_attn_ck.pipeline.select import select_backend
    with torch.no_grad():
        o, lse, _ = fa.flash_attn_fwd(q, k, v, causal=causal, backend=backend_name)
    options = AttentionOptions(causal=causal, backend=backend_name)
    problem = describe_call(q, k, v, options)
    backend = select_backend(problem, backend_name)
    workspace = backward_plan(backend, problem).allocate(q.device)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    params = AttentionParams(q, k, v, None, None, None, None)
    rows = {
        "autograd.grad": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "flash_attn_bwd (op)": lambda: fa.flash_attn_bwd(dout, q, k, v, o, lse, causal=causal, backend=backend_name),
        "attention_backward": lambda: attention_backward(dout, q, k, v, o, lse, None, None, None, options, None),
        "backend.backward": lambda: backend.backward(problem, params, o, lse, dout, dq, dk, dv, workspace),
    }
    for name, fn in rows.items():
        print(f"    host {name:22s} {host_ms(fn):.3f} ms", flush=True)


def forward_breakdown(q, k, v, out, dout, causal, backend_name):
    """Host ms per call of the forward's layers: the API function, the pipeline function, the backend's
    launch into ready outputs."""
    from flash_attn_ck.core.inputs import describe_call, kernel_params
    from flash_attn_ck.core.options import AttentionOptions
    from flash_attn_ck.pipeline.forward import attention_forward
    from flash_attn_ck.pipeline.select import select_backend
    options = AttentionOptions(causal=causal, backend=backend_name)
    problem = describe_call(q, k, v, options)
    backend = select_backend(problem, backend_name)
    params = kernel_params(problem, q, k, v, options, None)
    o = torch.empty_like(q)
    lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
    rows = {
        "flash_attn_func": lambda: fa.flash_attn_func(q, k, v, causal=causal, backend=backend_name),
        "attention_forward": lambda: attention_forward(q, k, v, options),
        "describe_call": lambda: describe_call(q, k, v, options),
        "backend.forward": lambda: backend.forward(problem, params, o, lse),
    }
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"    host {name:22s} {host_ms(fn):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
