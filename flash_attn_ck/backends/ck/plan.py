"""CK's `fmha_bwd` workspace contract: the key tile `kN0`, the `dq_accum` splits, expanded dK/dV.

flash-attention's CK frontend (`mha_bwd.cpp`) allocates these buffers around CK's kernels; the CK
backend runs on them and the reference backend, which implements CK's contract in PyTorch, too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.plan import BufferSpec, WorkspacePlan
from ...core.problem import AttentionProblem


@dataclass(frozen=True)
class CkBwdTile:
    """Key-tile rows of CK's `dq_dk_dv` kernel: 128 for d <= 128, else 64 (CK's fmha_bwd tile table,
    as used by flash-attention's `mha_bwd.cpp` to size deterministic `dq_accum`)."""
    kN0: int

    @classmethod
    def for_head_dim(cls, head_dim_padded: int) -> CkBwdTile:
        return cls(128 if head_dim_padded <= 128 else 64)


def dq_accum_splits(problem: AttentionProblem, kn0: int | None = None) -> int:
    """One fp32 split when dQ is added with atomics; one per key tile in deterministic mode. `kn0`:
    the tile of the instance that will run (the CK library's `fack_bwd_tile`); None: CK's gfx942 table."""
    if not problem.deterministic:
        return 1
    kn0 = kn0 or CkBwdTile.for_head_dim(problem.head_dim_padded).kN0
    return max(1, -(-problem.seqlen_k // kn0))


def ck_backward_plan(problem: AttentionProblem, backend: str, kn0: int | None = None) -> WorkspacePlan:
    """`mha_bwd`'s buffers: softmax_d, dq_accum, and expanded dK/dV for MQA/GQA. `kn0`: the key tile of
    the dq_dk_dv instance that will run (None: CK's gfx942 table, as the reference backend uses)."""
    p, d = problem, problem.head_dim_padded
    buffers = [
        BufferSpec("softmax_d", p.lse_shape, p.accum_dtype, False, "D = rowsum(dO * O), strided like lse"),
        BufferSpec("dq_accum", (dq_accum_splits(p, kn0), *p.q_rows_shape, p.heads_q, d), p.accum_dtype, True,
                   "fp32 dQ, one split per key tile when deterministic"),
    ]
    if p.is_gqa:
        for name in ("dk_expanded", "dv_expanded"):
            buffers.append(BufferSpec(name, (*p.k_rows_shape, p.heads_q, d), p.results_dtype, False,
                                      f"{name[:2]} per query head, summed over groups of {p.group_size}"))
    return WorkspacePlan(backend, tuple(buffers), reduce_expanded_kv=p.is_gqa)
