"""What the autograd engine's device thread costs a backward written in Python.

On a CUDA tensor, `torch.autograd.grad` hands the graph to the engine's thread for that device and waits; a
Python backward then runs on that thread. This times one forward + `autograd.grad` per call, with the engine on
its thread and on the calling thread (`torch.autograd.set_multithreading_enabled(False)`), for: a Python
Function whose backward does nothing but return, the same with a fixed amount of pure-Python work in its
backward (is Python slower on that thread?), SDPA's flash kernels (a C++ backward), and ours; for ours also the
time spent inside its backward (`ops._Attention.backward`, timed around the call on whichever thread runs it), so
the hand-off can be told apart from the backward's own Python.

    python scripts/lab/engine_thread.py [--calls 300] [--work-us 50]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flash_attn_ck as fa


def spin(us: float) -> None:
    """Pure-Python work: a fixed number of iterations, calibrated on the calling thread."""
    for _ in range(int(us * SPIN_PER_US)):
        pass


SPIN_PER_US = 1.0


class Trivial(torch.autograd.Function):
    work_us = 0.0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        spin(Trivial.work_us)
        return grad


class InsideBackward:
    """Sums the wall time spent inside flash_attn_ck's autograd backward while installed."""

    def __init__(self, profile: cProfile.Profile | None = None):
        from flash_attn_ck import ops
        self.function, self.total, self.calls = ops._Attention, 0.0, 0
        self.original = ops._Attention.backward
        self.profile = profile

    def __enter__(self):
        original = self.original

        def timed(ctx, *grads):
            start = time.perf_counter()
            if self.profile is not None:
                self.profile.enable()
            try:
                return original(ctx, *grads)
            finally:
                if self.profile is not None:
                    self.profile.disable()
                self.total += time.perf_counter() - start
                self.calls += 1
        self.function.backward = staticmethod(timed)
        return self

    def __exit__(self, *exc):
        self.function.backward = self.original
        return False


def per_call_us(call, calls: int) -> float:
    """Host µs per call, the fastest of 5 rounds of `calls` back-to-back calls."""
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) * 1e6 / calls)
    return best


def main() -> None:
    global SPIN_PER_US
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--work-us", type=float, default=50.0)
    ap.add_argument("--profile-body", action="store_true",
                    help="also cProfile the backward body on each thread (top functions by own time)")
    args = ap.parse_args()
    start = time.perf_counter()
    spin(1e6)
    SPIN_PER_US = 1e6 / ((time.perf_counter() - start) * 1e6)
    q, k, v = (torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))

    def trivial(work_us):
        def call():
            Trivial.work_us = work_us
            torch.autograd.grad(Trivial.apply(q), (q,), dout)
        return call

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt), (qt, kt, vt), dout.transpose(1, 2))

    def ours():
        torch.autograd.grad(fa.flash_attn_func(q, k, v), (q, k, v), dout)

    cases = {"python Function, empty backward": trivial(0.0),
             f"python Function, {args.work_us:.0f} us of Python in backward": trivial(args.work_us),
             "sdpa flash (C++ backward)": sdpa, "flash_attn_ck": ours}
    print(f"python {sys.version.split()[0]}, switch interval {sys.getswitchinterval() * 1e3:.1f} ms, "
          f"torch {torch.__version__}")
    for name, call in cases.items():
        times = {}
        for threaded in (True, False):
            with torch.autograd.set_multithreading_enabled(threaded):
                for _ in range(20):
                    call()
                times[threaded] = per_call_us(call, args.calls)
        print(f"{name:48s} engine thread {times[True]:7.1f} us   calling thread {times[False]:7.1f} us   "
              f"difference {times[True] - times[False]:6.1f} us", flush=True)
    for threaded in (True, False):
        with torch.autograd.set_multithreading_enabled(threaded), InsideBackward() as inside:
            per_call_us(ours, args.calls)
        print(f"flash_attn_ck's backward body on {'the engine thread' if threaded else 'the calling thread':18s} "
              f"{inside.total * 1e6 / inside.calls:7.1f} us per call (mean of {inside.calls})")
    if args.profile_body:
        for threaded in (True, False):
            profile = cProfile.Profile(time.perf_counter_ns, 1e-9)
            with torch.autograd.set_multithreading_enabled(threaded), InsideBackward(profile) as inside:
                per_call_us(ours, args.calls)
            stats = pstats.Stats(profile).stats
            rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:18]
            print(f"-- backward body on {'the engine thread' if threaded else 'the calling thread'}, profiled: "
                  f"{inside.total * 1e6 / inside.calls:.1f} us per call; own / cumulative us per call:")
            for where, (_, n, own, cum, _) in rows:
                print(f"{n / inside.calls:6.1f}x {own * 1e6 / inside.calls:8.2f} {cum * 1e6 / inside.calls:8.2f}  "
                      f"{pstats.func_std_string(where)}")


if __name__ == "__main__":
    main()
