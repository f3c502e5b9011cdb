"""The learnable-sink cases both the CPU tests (tests/api/test_sinks.py) and the GPU ones
(tests/gpu/test_sinks_gpu.py) run: name -> Config fields over BASE, and the sink dtypes by name."""

from __future__ import annotations

import torch

CASES = {
    "mha": dict(heads_q=3, heads_k=3),
    "gqa": dict(),
    "mqa_causal": dict(heads_q=4, heads_k=1, causal=True),
    "causal_sq_gt_sk": dict(seqlen_q=47, seqlen_k=20, causal=True),      # rows without keys
    "window": dict(window=(9, 4)),
    "alibi_softcap": dict(alibi=True, softcap=5.0, causal=True),
    "varlen_empty": dict(seqlens=[(5, 9), (0, 7), (17, 3), (4, 0)], causal=True),
    "varlen_window": dict(seqlens=[(13, 21), (9, 9)], window=(6, 2)),
    "dropout": dict(dropout_p=0.25),
    "varlen_dropout": dict(seqlens=[(11, 17), (0, 5), (8, 8)], dropout_p=0.2),
}
SINK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BASE = dict(batch=2, seqlen_q=33, seqlen_k=47, heads_q=4, heads_k=2, head_dim=40)
