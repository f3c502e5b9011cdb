"""Workspace plans: every buffer a backward call allocates, by name, with its shape and bytes.

A backend describes what it needs as a `WorkspacePlan`; the pipeline allocates exactly that and
nothing else, so the plan printed by `describe()` is the memory the call uses beyond its inputs
and outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
    # pipeline must sum each group of h/h_k heads (the CK contract for MQA/GQA).
    reduce_expanded_kv: bool = False
    # Which kernel runs the backward and, when a faster one was passed over, why.
    kernel: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def allocate(self, device: torch.device, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        return {b.name: b.allocate(device) for b in self.buffers if not b.internal and b.name not in skip}

    def describe(self) -> str:
        lines = [f"workspace plan ({self.backend}): {format_bytes(self.total_bytes)} in {len(self.buffers)} buffers"]
        if self.kernel:
            lines.append(f"  kernel: {self.kernel}")
        for b in self.buffers:
            shape = "x".join(map(str, b.shape))
            dtype = str(b.dtype).removeprefix("torch.")
            init = "internal" if b.internal else "zeros" if b.zero_init else "empty"
            lines.append(f"  {b.name:<13} {dtype:<9} {shape:<24} {format_bytes(b.nbytes):>10}  {init}  {b.purpose}")
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
