"""Workspace plans: every buffer a backward call allocates, by name, with its shape and bytes.

A backend describes what it needs as a `WorkspacePlan`; the frontend allocates exactly that and
nothing else, so the plan printed by `describe()` is the memory the call uses beyond its inputs
and outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .problem import AttentionProblem


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    zero_init: bool
    purpose: str
    # Memory the backend allocates itself while it runs (counted in the plan, not allocated here).
    internal: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, device: torch.device) -> torch.Tensor:
        make = torch.zeros if self.zero_init else torch.empty
        return make(self.shape, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class WorkspacePlan:
    backend: str
    buffers: tuple[BufferSpec, ...]
    # True when the backend writes dK/dV per query head into `dk_expanded`/`dv_expanded` and the
    # frontend must sum each group of h/h_k heads (the CK contract for MQA/GQA).
    reduce_expanded_kv: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def allocate(self, device: torch.device, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        return {b.name: b.allocate(device) for b in self.buffers if not b.internal and b.name not in skip}

    def describe(self) -> str:
        lines = [f"workspace plan ({self.backend}): {format_bytes(self.total_bytes)} in {len(self.buffers)} buffers"]
        for b in self.buffers:
            shape = "x".join(map(str, b.shape))
            dtype = str(b.dtype).removeprefix("torch.")
            init = "internal" if b.internal else "zeros" if b.zero_init else "empty"
            lines.append(f"  {b.name:<13} {dtype:<9} {shape:<24} {format_bytes(b.nbytes):>10}  {init}  {b.purpose}")
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ---- the CK fmha_bwd contract (docs/semantics.md §The CK fmha_bwd workspace contract) ------------

@dataclass(frozen=True)
class CkBwdTile:
    """Key-tile rows of CK's `dq_dk_dv` kernel: 128 for d <= 128, else 64 (CK's fmha_bwd tile table,
    as used by flash-attention's `mha_bwd.cpp` to size deterministic `dq_accum`)."""
    kN0: int

    @classmethod
    def for_head_dim(cls, head_dim_padded: int) -> "CkBwdTile":
        return cls(128 if head_dim_padded <= 128 else 64)


def dq_accum_splits(problem: AttentionProblem) -> int:
    """One fp32 split when dQ is added with atomics; one per key tile in deterministic mode."""
    if not problem.deterministic:
        return 1
    return max(1, -(-problem.seqlen_k // CkBwdTile.for_head_dim(problem.head_dim_padded).kN0))


def ck_backward_plan(problem: AttentionProblem, backend: str) -> WorkspacePlan:
    """The buffers of flash-attention's CK `mha_bwd`: softmax_d, dq_accum, and expanded dK/dV for MQA/GQA."""
    p, d = problem, problem.head_dim_padded
    rows_q = (p.total_q,) if p.varlen else (p.batch, p.seqlen_q)
    rows_k = (p.total_k,) if p.varlen else (p.batch, p.seqlen_k)
    lse_shape = (p.heads_q, p.total_q) if p.varlen else (p.batch, p.heads_q, p.seqlen_q)
    buffers = [
        BufferSpec("softmax_d", lse_shape, p.accum_dtype, False, "D = rowsum(dO * O), strided like lse"),
        BufferSpec("dq_accum", (dq_accum_splits(p), *rows_q, p.heads_q, d), p.accum_dtype, True,
                   "fp32 dQ, one split per key tile when deterministic"),
    ]
    if p.is_gqa:
        for name in ("dk_expanded", "dv_expanded"):
            buffers.append(BufferSpec(name, (*rows_k, p.heads_q, d), p.dtype, False,
                                      f"{name[:2]} per query head, summed over groups of {p.group_size}"))
    return WorkspacePlan(backend, tuple(buffers), reduce_expanded_kv=p.is_gqa)
