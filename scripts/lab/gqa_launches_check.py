"""Warp-specialised backward when a call needs several launches (GQA whose fp32 dQ accumulator exceeds
config.BWD_WS_DQ_ACCUM_BYTES): max |error| of dq, dk, dv against an fp32 reference (SDPA, efficient kernel),
deterministic and not, beside the one-launch kernel; and whether two deterministic runs are bit-identical.

    python scripts/lab/gqa_launches_check.py [--shapes b:h:h_k:s[:accum_mib],...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import flash_attn_ck as fa
from flash_attn_ck.backends.triton import TritonBackend, config, operators


def grads(q, k, v, dout, **options):
    out = fa.flash_attn_func(q, k, v, causal=True, **options)
    return torch.autograd.grad(out, (q, k, v), dout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2:32:8:8192,1:32:8:8192,2:8:2:2048:4,1:8:2:2048:4,2:16:16:4096")
    args = ap.parse_args()
    default_accum = config.BWD_WS_DQ_ACCUM_BYTES
    for shape in args.shapes.split(","):
        b, h, h_k, s, *accum = map(int, shape.split(":"))
        config.BWD_WS_DQ_ACCUM_BYTES = accum[0] * 2 ** 20 if accum else default_accum
        torch.manual_seed(0)
        q = torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, s, h_k, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        qf, kf, vf = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            ref_out = F.scaled_dot_product_attention(qf, kf.repeat_interleave(h // h_k, 1),
                                                     vf.repeat_interleave(h // h_k, 1), is_causal=True)
        ref = [g.transpose(1, 2) for g in torch.autograd.grad(ref_out, (qf, kf, vf), dout.float().transpose(1, 2))]
        launches = -(-h_k // operators.BwdWs.kv_heads_per_launch(TritonBackend(), _problem(q, k, v)))
        rows = {"ws": dict(backend=TritonBackend()), "ws det": dict(backend=TritonBackend(), deterministic=True),
                "one-launch": dict(backend=TritonBackend(ws=False))}
        for name, options in rows.items():
            got = grads(q, k, v, dout, **options)
            errors = " ".join(f"{n}={(g.float() - r).abs().max().item():.3e}" for n, g, r in zip("qkv", got, ref))
            line = f"b{b} h{h}/{h_k} s{s} launches={launches} {name:10s} max|d{{q,k,v}} - ref| {errors}"
            if options.get("deterministic"):
                again = grads(q, k, v, dout, **options)
                line += f" bit-identical={all(torch.equal(a, c) for a, c in zip(got, again))}"
            print(line, flush=True)
    config.BWD_WS_DQ_ACCUM_BYTES = default_accum


def _problem(q, k, v):
    from flash_attn_ck.core.inputs import describe_call
    from flash_attn_ck.core.options import AttentionOptions
    return describe_call(q, k, v, AttentionOptions(causal=True))


if __name__ == "__main__":
    main()
