"""The 2x-rule check the value-head-dim lab scripts (fwd_value_head_dim.py, bwd_qk_tail.py) run before timing."""

from __future__ import annotations

import sys
import traceback

import torch

import flash_attn_ck as fa


def passes_the_2x_rule(backend, d: int, d_v: int, causal) -> bool:
    """The 2x rule (tests/cases.py's check, forward and backward) on a small GQA call of (d, d_v) with ragged lengths
    under `backend`; a failed assertion or a kernel that fails to compile is printed and counts as a failure."""
    sys.path.insert(0, "tests")
    from cases import check_case
    from oracle import Config
    try:
        with fa.use_backend(backend):
            check_case(Config(batch=2, seqlen_q=333, seqlen_k=333, heads_q=8, heads_k=2, head_dim=d, head_dim_v=d_v,
                              causal=bool(causal), dtype=torch.bfloat16), backend="triton", device="cuda")
        return True
    except Exception:
        traceback.print_exc()
        return False


def tflops_cell(name: str, flops: float, backend, timed_call) -> str:
    """"NAME TF/s" of the call `timed_call()` returns, built and timed under `backend` (do_bench: 25 warm-up, 100 ms),
    or "NAME ERROR <type>" where it raises (a tile that does not fit: said, the others timed)."""
    import triton
    try:
        with fa.use_backend(backend):
            ms = triton.testing.do_bench(timed_call(), warmup=25, rep=100)
        return f"{name} {flops / ms / 1e9:.0f}"
    except Exception as e:
        return f"{name} ERROR {type(e).__name__}"
