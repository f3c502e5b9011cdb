"""cProfile of repeated eager calls: where the host microseconds of one call go, function by function.

On a GPU the Triton backend runs for real; on the CPU the backend's host code runs without launches
(host_cost.null_backend). Prints, per call kind, the top functions by own time and by cumulative time,
per call (µs), and writes the pstats dumps to --out.

    python scripts/lab/host_profile.py [--shape 1:128:16:128] [--calls 300] [--varlen] [--out /tmp/prof]

On a GPU the autograd engine runs a backward on its own device thread, which cProfile (enabled on the calling
thread) does not see: `--same-thread` runs the engine on the calling thread
(`torch.autograd.set_multithreading_enabled(False)`), so the Function's backward shows in the tables. Before the
profiles the script prints the unprofiled µs per call of each kind, with the engine's thread and without.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host_cost import inputs, null_backend

import flash_attn_ck as fa


def table(profile: cProfile.Profile, calls: int, sort: str, top: int) -> str:
    """The top functions by `sort` ("tottime" or "cumulative"), µs per call of the loop (read from the stats
    themselves: pstats prints milliseconds, too coarse for a per-call table)."""
    stats = pstats.Stats(profile).stats    # (file, line, name) -> (primitive, all calls, own s, cum s, callers)
    column = 2 if sort == "tottime" else 3
    rows = sorted(stats.items(), key=lambda item: item[1][column], reverse=True)[:top]
    lines = [f"{n:>10d} {own * 1e6 / calls:8.2f} {cum * 1e6 / calls:8.2f}  {pstats.func_std_string(where)}"
             for where, (_, n, own, cum, _) in rows]
    return f"{'ncalls':>10s} {'own µs':>8s} {'cum µs':>8s}  function (per call of the loop)\n" + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1:128:16:128", help="b:s:h:d")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--out", default="/tmp/host-profile")
    ap.add_argument("--same-thread", action="store_true",
                    help="run the autograd engine on the calling thread, so the profile sees the backward")
    args = ap.parse_args()
    b, s, h, d = map(int, args.shape.split(":"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backend = "triton" if cuda else null_backend("triton")
    q, k, v, offsets = inputs(b, s, h, d, args.varlen, device, torch.bfloat16)
    extra = dict(cu_seqlens_q=offsets["cu"], cu_seqlens_k=offsets["cu"], max_seqlen_q=s, max_seqlen_k=s) \
        if args.varlen else {}

    def forward():
        if args.varlen:
            return fa.flash_attn_varlen_func(q, k, v, causal=args.causal, backend=backend, **extra)
        return fa.flash_attn_func(q, k, v, causal=args.causal, backend=backend)

    dout = torch.randn_like(forward())

    def fwd_nograd():
        with torch.no_grad():
            forward()

    def fwd_bwd():
        torch.autograd.grad(forward(), (q, k, v), dout)

    def fwd_grad():
        forward()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kinds = (("fwd_nograd", fwd_nograd), ("fwd_grad", fwd_grad), ("fwd_bwd", fwd_bwd))
    with fa.use_backend(backend) if not cuda else _nothing():
        for name, call in kinds:
            for threaded in (True, False):
                with torch.autograd.set_multithreading_enabled(threaded):
                    print(f"{name:12s} engine {'on its thread' if threaded else 'on the caller':14s} "
                          f"{per_call_us(call, args.calls, cuda):8.1f} us per call (fastest of 5)")
    with fa.use_backend(backend) if not cuda else _nothing(), \
            torch.autograd.set_multithreading_enabled(not args.same_thread):
        for name, call in kinds:
            for _ in range(20):
                call()
            if cuda:
                torch.cuda.synchronize()
            profile = cProfile.Profile(time.perf_counter_ns, 1e-9)
            profile.enable()
            for _ in range(args.calls):
                call()
            profile.disable()
            if cuda:
                torch.cuda.synchronize()
            profile.dump_stats(out / f"{name}.pstats")
            for sort in ("tottime", "cumulative"):
                print(f"\n==== {name}, {args.shape}{' varlen' if args.varlen else ''}, sorted by {sort} ====")
                print(table(profile, args.calls, sort, args.top))


def per_call_us(call, calls: int, cuda: bool) -> float:
    """Host µs per call of `calls` back-to-back calls, the fastest of 5 rounds."""
    rounds = []
    for _ in range(6):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        rounds.append((time.perf_counter() - start) * 1e6 / calls)
    return min(rounds[1:])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
