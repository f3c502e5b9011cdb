"""One forward + backward of a bf16 shape through the public API, run twice (the first compiles), for Nsight
Compute to profile a kernel of the second run: `bash scripts/device.sh profile [KERNEL [SHAPE]]`.

    python3 scripts/profile_case.py --shape d:h:h_k:s:causal
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_attn_ck as fa


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="128:16:16:8192:0", help="d:h:h_k:s:causal, b = 16384 / s")
    args = ap.parse_args()
    d, h, h_k, s, causal = map(int, args.shape.split(":"))
    b = max(1, 16384 // s)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, h_k, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    for _ in range(2):
        out = fa.flash_attn_func(q, k, v, causal=bool(causal), backend="triton")
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    print("case done")


if __name__ == "__main__":
    main()
