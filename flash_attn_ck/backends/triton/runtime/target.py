"""The GPU that the Triton backend's choices read: whether Triton interprets the kernels (TRITON_INTERPRET=1) and a
CUDA device's compute capability. Tests pretend another GPU by patching these two names."""

from __future__ import annotations

import functools
import os

import torch

# Read once, like triton itself, which decides when the kernels' modules are imported.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device (a tensor's device: its index is set); read several times per call, so
    cached."""
    return torch.cuda.get_device_capability(device)


def architecture(device: torch.device) -> int | None:
    """The major compute capability the kernels compile for on `device`: None where they are interpreted or the
    device is not a CUDA GPU."""
    if INTERPRETING or device.type != "cuda":
        return None
    return capability(device)[0]
