"""Host µs per call on the CPU with kernels that do nothing: the three call kinds (forward without grad, forward
recording autograd, forward + autograd.grad) and the low-level flash_attn_bwd, dense and varlen, and the layers
inside them.

The reference backend without arithmetic (`host_cost.null_backend("reference")`, passed as `backend=` and installed
with `use_backend`), b1 s16 h2 d16 fp32 causal, one intra-op thread: every µs is host path. On a shared host the
rows are timed in rounds of 100 calls, every row once per round (so a busy interval slows all rows alike), and
each row keeps its fastest round. To compare two trees, run this once per tree, alternating, a few times, and
keep each row's minimum:

    PYTHONPATH=<tree> python scripts/lab/host_calls_cpu.py [--rounds 60]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host_cost import inputs, null_backend

import flash_attn_ck as fa
from flash_attn_ck import ops
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.pipeline.backward import attention_backward
from flash_attn_ck.pipeline.forward import attention_forward

B, S, H, D = 1, 16, 2, 16


def rows_of(varlen: bool, backend) -> dict[str, tuple[bool, object]]:
    """Row name -> (under no_grad, the call)."""
    q, k, v, offsets = inputs(B, S, H, D, varlen, torch.device("cpu"), torch.float32)
    extra = (
        dict(cu_seqlens_q=offsets["cu"], cu_seqlens_k=offsets["cu"], max_seqlen_q=S, max_seqlen_k=S) if varlen else {}
    )

    def forward():
        if varlen:
            return fa.flash_attn_varlen_func(q, k, v, offsets["cu"], offsets["cu"], S, S, causal=True, backend=backend)
        return fa.flash_attn_func(q, k, v, causal=True, backend=backend)

    dout = torch.randn_like(forward())
    options = AttentionOptions(causal=True, backend=backend, **extra)
    recorded_out = ops.attention(q, k, v, options)[0]
    with torch.no_grad():
        out, lse, _, _, prepared = attention_forward(q, k, v, options)
    return {
        "flash_attn_func, no grad": (True, forward),
        "flash_attn_func, recording autograd": (False, forward),
        "forward + autograd.grad": (False, lambda: torch.autograd.grad(forward(), (q, k, v), dout)),
        "flash_attn_bwd (low-level, validating)": (
            True,
            lambda: fa.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, backend=backend, **extra),
        ),
        "  AttentionOptions(...)": (True, lambda: AttentionOptions(causal=True, backend=backend, **extra)),
        "  ops.attention, no grad": (True, lambda: ops.attention(q, k, v, options)),
        "  attention_forward (its PreparedCall)": (
            True,
            lambda: attention_forward(q, k, v, options, None, None, prepared),
        ),
        "  ops.attention, recording (the Function)": (False, lambda: ops.attention(q, k, v, options)),
        "  autograd.grad (the Function's backward)": (
            False,
            lambda: torch.autograd.grad(recorded_out, (q, k, v), dout, retain_graph=True),
        ),
        "  attention_backward (its PreparedCall)": (
            True,
            lambda: attention_backward(dout, q, k, v, out, lse, None, None, None, options, None, prepared=prepared),
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--calls", type=int, default=100, help="calls per round")
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend = null_backend("reference")
    best: dict[tuple[str, str], float] = {}
    with fa.use_backend(backend):
        rows = {
            (name, layout): row
            for layout in ("dense", "varlen")
            for name, row in rows_of(layout == "varlen", backend).items()
        }
        for _ in range(args.rounds):
            for key, (no_grad, call) in rows.items():
                with torch.no_grad() if no_grad else contextlib.nullcontext():
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        call()
                    us = (time.perf_counter() - start) / args.calls * 1e6
                best[key] = min(best.get(key, us), us)
    print(f"flash_attn_ck from {Path(fa.__file__).parent}")
    print(f"{'µs per call (CPU, null kernels)':44s} {'dense':>7s} {'varlen':>7s}")
    for name in dict.fromkeys(name for name, _ in rows):
        print(f"{name:44s} {best[(name, 'dense')]:7.1f} {best[(name, 'varlen')]:7.1f}")


if __name__ == "__main__":
    main()
