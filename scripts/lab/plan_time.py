"""Time the backward's chunk planning (pipeline/chunking.py) over a grid of shapes and caps, on meta
tensors (no compute). Prints one row per case: backend, shape, cap, chunks, time. The result is in
README.md (§A cap on the backward workspace); tests/core/test_workspace_plan.py checks the plans themselves.

    PYTHONPATH=. python3 scripts/lab/plan_time.py
"""

from __future__ import annotations

import time

import torch

from flash_attn_ck.backends.ck.backend import CkBackend
from flash_attn_ck.backends.reference import ReferenceBackend
from flash_attn_ck.core.errors import WorkspaceError
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.core.plan import format_bytes
from flash_attn_ck.pipeline.chunking import _plan_chunks


def main() -> None:
    print("| backend | b | s | h/h_k | cap | chunks | time (ms) |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for b in (1, 2, 8, 64):
        for s in (1024, 8192, 131072):
            for h, h_k in ((32, 8), (64, 1), (128, 128)):
                q = torch.empty(b, s, h, 128, dtype=torch.bfloat16, device="meta")
                k = torch.empty(b, s, h_k, 128, dtype=torch.bfloat16, device="meta")
                problem = describe_call(q, k, k, AttentionOptions(causal=True, deterministic=True))
                for cap in (1 << 20, 4 << 20, 1 << 30):
                    for backend in (ReferenceBackend(), CkBackend()):
                        start = time.perf_counter()
                        try:
                            chunks = len(_plan_chunks(problem, backend, cap, None).chunks)
                        except WorkspaceError:
                            chunks = "WorkspaceError"
                        ms = (time.perf_counter() - start) * 1e3
                        worst = max(worst, ms)
                        print(f"| {backend.name} | {b} | {s} | {h}/{h_k} | {format_bytes(cap)} | {chunks} | {ms:.1f} |")
    print(f"\nslowest: {worst:.1f} ms")


if __name__ == "__main__":
    main()
