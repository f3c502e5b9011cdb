"""The main job: forward + backward on the best available backend, checked and timed.

    python -m flash_attn_ck [--backend NAME] [--batch B --seqlen S --heads H --heads-k HK --head-dim D]
                            [--causal] [--window L R] [--dtype bf16|fp16] [--deterministic] [--dropout P]

It compares out/dq/dk/dv with torch's scaled_dot_product_attention run in fp32 (an independent
implementation), under the workspace cap it then times, judges it by the 2x rule (docs/semantics.md: PASS, or FAIL
and exit status 1), times forward and backward (median), and prints the backward's workspace plan (buffers, chunks
under the workspace cap, peak) and a one-line plan for every other backend.

--heads-k defaults to --heads (multi-head attention); give fewer for GQA/MQA (it must divide --heads).
Sizes are positive (an empty call has nothing to time or compare). A bad argument, or an error the
library raises on purpose (ArgumentError, NoBackendError, WorkspaceError), is one line on stderr,
`python -m flash_attn_ck: error: ...`, and exit status 2, as argparse reports usage errors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import NoReturn

import torch
import torch.nn.functional as F

from . import backward_workspace, flash_attn_bwd, flash_attn_fwd
from .backends.registry import BACKEND_NAMES
from .core.checks import MAX_HEAD_DIM, MAX_INT64, MAX_WINDOW_SIDE, WORKSPACE_EXPECTED
from .core.errors import ArgumentError, NoBackendError, WorkspaceError
from .core.inputs import describe_call
from .core.options import AttentionOptions
from .pipeline.select import select_backend

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PROG = "python -m flash_attn_ck"


class _Parser(argparse.ArgumentParser):
    """argparse, with its error as one line (no usage block): `prog: error: argument --x: expected ...`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _integer(low: int, high: int | None = None, expected: str = ""):
    """An argparse type: an integer in [low, high]; the error says what was expected."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value
    return parse


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {text!r}")
    return value


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:      # an unknown name; a device this machine lacks
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise argparse.ArgumentTypeError(f"expected a device this machine has (cpu, cuda, cuda:1, ...), got "
                                         f"{text!r}: {reason}") from None
    return device


_POSITIVE = _integer(1, expected="a positive integer")


def parse_args(argv=None):
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, choices=BACKEND_NAMES,
                        help="triton, ck or reference (default: best available)")
    parser.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=_POSITIVE, default=2)
    parser.add_argument("--seqlen", type=_POSITIVE, default=1024,
                        help="query length (and key length unless --seqlen-k)")
    parser.add_argument("--seqlen-k", type=_POSITIVE, default=None)
    parser.add_argument("--heads", type=_POSITIVE, default=8)
    parser.add_argument("--heads-k", type=_POSITIVE, default=None,
                        help="key/value heads, a divisor of --heads (default: --heads; fewer: GQA/MQA)")
    parser.add_argument("--head-dim", type=_integer(1, MAX_HEAD_DIM, f"an integer in 1..{MAX_HEAD_DIM}"), default=64)
    parser.add_argument("--causal", action="store_true")
    window_side = _integer(-1, MAX_WINDOW_SIDE, f"-1 (unbounded) or an integer in 0..{MAX_WINDOW_SIDE}")
    parser.add_argument("--window", type=window_side, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--dropout", type=_probability, default=0.0, help="dropout is timed but not compared")
    parser.add_argument("--max-workspace-bytes", type=_integer(-1, MAX_INT64, WORKSPACE_EXPECTED),
                        default=None,
                        help="cap on the backward workspace (default: $FLASH_ATTN_CK_MAX_WORKSPACE_BYTES or 4 GiB)")
    parser.add_argument("--repeats", type=_POSITIVE, default=3, help="timed calls per direction (median)")
    args = parser.parse_args(argv)
    if args.heads_k is None:
        args.heads_k = args.heads
    elif args.heads % args.heads_k:
        parser.error(f"argument --heads-k: expected a divisor of --heads ({args.heads}), got {args.heads_k}")
    args.seqlen_k = args.seqlen if args.seqlen_k is None else args.seqlen_k
    return args


def sdpa_reference(q, k, v, dout, causal, window, dtype):
    """torch SDPA in `dtype` with an explicit bottom-right mask; returns out, dq, dk, dv."""
    q, k, v = (t.detach().to(dtype).transpose(1, 2).requires_grad_() for t in (q, k, v))
    s_q, s_k = q.shape[2], k.shape[2]
    rows = torch.arange(s_q, device=q.device)[:, None] + s_k - s_q
    cols = torch.arange(s_k, device=q.device)[None, :]
    left, right = window
    right = 0 if causal else right
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if 0 <= left < s_k:
        keep &= cols >= rows - left
    if 0 <= right < s_k:
        keep &= cols <= rows + right
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout.to(dtype).transpose(1, 2))
    return [t.transpose(1, 2) for t in (out.detach(), q.grad, k.grad, v.grad)]


def two_x_rule(ours: torch.Tensor, ref: torch.Tensor, same: torch.Tensor, roundings: int) -> tuple[float, ...]:
    """(max|ours - ref|, max|same - ref|, the bound the first must not exceed): max(2 x the second, `roundings`
    half-units of ours' dtype at max|ref|) + atol + ACCUMULATION_SLACK, atol = twice the rounding of ref in ours'
    dtype."""
    ref = ref.float()
    err = (ours.float() - ref).abs().max().item()
    base = (same.float() - ref).abs().max().item()
    atol = 2 * ((ref + 0.3 - 0.3).to(ours.dtype).float() - ref).abs().max().item()
    floor = roundings * torch.finfo(ours.dtype).eps / 2 * ref.abs().max().item()
    return err, base, max(2 * base, floor) + atol + ACCUMULATION_SLACK


# The fp32 accumulation's rounding where the same-precision reference and the atol are exactly 0: a row that attends
# one key has dS = P (dP - D) = 0, but D = rowsum(dO * O) and dP = dO . v sum one set of products in two orders
# (docs/semantics.md §Correctness: the 2x rule; tests/oracle.py allows the same).
ACCUMULATION_SLACK = 1e-6


def timed(fn, device, repeats):
    """Median wall time in seconds (device-synchronised), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ArgumentError, NoBackendError, WorkspaceError) as error:     # raised on purpose, naming the fix
        message = " ".join(str(error).split())
        _Parser(prog=PROG).error(message)


def run(args) -> int:
    """The main job on parsed arguments."""
    device, dtype = args.device, DTYPES[args.dtype]
    s_k = args.seqlen_k
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = rand(args.batch, args.seqlen, args.heads, args.head_dim)
    k = rand(args.batch, s_k, args.heads_k, args.head_dim)
    v = rand(args.batch, s_k, args.heads_k, args.head_dim)
    dout = rand(args.batch, args.seqlen, args.heads, args.head_dim)
    options = dict(causal=args.causal, window_size=tuple(args.window), deterministic=args.deterministic,
                   backend=args.backend)

    problem = describe_call(q, k, v, AttentionOptions(causal=args.causal, window_size=tuple(args.window),
                                                      dropout_p=args.dropout, deterministic=args.deterministic))
    backend = select_backend(problem, args.backend)
    print(f"flash_attn_ck main job: backend={backend.name} device={device} dtype={args.dtype} "
          f"b={args.batch} s_q={args.seqlen} s_k={s_k} h={args.heads}/{args.heads_k} d={args.head_dim} "
          f"mask={problem.mask.describe()} deterministic={args.deterministic} dropout={args.dropout}")

    # ---- correctness: the call that is timed (under the same workspace cap) against SDPA in fp32, judged by the
    # 2x rule with the same-precision SDPA's error as the yardstick --------------------------------------------------
    passed = True
    if args.dropout == 0.0:
        out, lse, _ = flash_attn_fwd(q, k, v, **options)
        dq, dk, dv, _ = flash_attn_bwd(dout, q, k, v, out, lse, max_workspace_bytes=args.max_workspace_bytes,
                                       **options)
        ref = sdpa_reference(q, k, v, dout, args.causal, args.window, torch.float32)
        same = sdpa_reference(q, k, v, dout, args.causal, args.window, dtype)
        group = args.heads // args.heads_k
        for name, ours, r, s in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref, same):
            roundings = 1 + group if name in ("dk", "dv") and group > 1 else 1
            err, base, bound = two_x_rule(ours, r, s, roundings)
            ratio = err / base if base else float("inf") if err else 0.0
            passed &= err <= bound
            print(f"  {name:<3} max|ours - fp32 SDPA| = {err:.3e}   same-precision SDPA: {base:.3e}   "
                  f"ratio {ratio:.2f}   bound {bound:.3e}")
        print(f"  {'PASS' if passed else 'FAIL'}: the 2x rule (docs/semantics.md): max|ours - ref| <= "
              f"max(2 x same-precision error, rounding floor) + atol + {ACCUMULATION_SLACK:g}, for out, dq, dk and dv")
    else:
        print("  not judged: dropout draws a keep pattern SDPA does not (the tests compare it with the reference "
              "backend's)")
    # ---- timing ---------------------------------------------------------------------------------
    fwd_time = timed(lambda: flash_attn_fwd(q, k, v, dropout_p=args.dropout, **options), device, args.repeats)
    out, lse, rng_state = flash_attn_fwd(q, k, v, dropout_p=args.dropout, **options)
    bwd_time = timed(lambda: flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=args.dropout, rng_state=rng_state,
                                            max_workspace_bytes=args.max_workspace_bytes, **options),
                     device, args.repeats)
    print(f"  forward  {fwd_time * 1e3:9.2f} ms  {problem.forward_flops() / fwd_time / 1e12:8.3f} TFLOP/s")
    if backend.forward_kernel(problem):
        print(f"  forward kernel: {backend.forward_kernel(problem)}")
    print(f"  backward {bwd_time * 1e3:9.2f} ms  {problem.backward_flops() / bwd_time / 1e12:8.3f} TFLOP/s"
          f"  (FLOPs = 2.5 x 4 b h s_q s_k d{', halved: causal' if problem.mask.is_causal else ''})")

    # ---- workspace: what the backward allocated, and what each other backend would ----------------
    plans = backward_workspace(q, k, v, causal=args.causal, window_size=tuple(args.window),
                               deterministic=args.deterministic, dropout_p=args.dropout,
                               max_workspace_bytes=args.max_workspace_bytes)
    print(plans.pop(backend.name).describe())
    for name, plan in plans.items():
        print(f"  {name}: " + (plan if isinstance(plan, str) else plan.describe().splitlines()[0]))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
