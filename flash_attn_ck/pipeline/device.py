"""Every kernel of a call runs on the GPU that holds its tensors, not on the current device: launches (Triton's,
HIP's) and the streams they take follow `torch.cuda.current_device()`, which a multi-GPU job need not have set to
the tensors' GPU."""

from __future__ import annotations

import functools

import torch


def on_the_tensors_device(step):
    """`step(first, ...)`, a pipeline entry whose first argument is a tensor of the call, run with that tensor's GPU
    as the current device (as it was where it already is: no guard and no device switch on the common path)."""
    @functools.wraps(step)
    def run(first, *args, **kwargs):
        device = first.device
        if device.type != "cuda" or device.index == torch.cuda.current_device():
            return step(first, *args, **kwargs)
        with torch.cuda.device(device):
            return step(first, *args, **kwargs)
    return run
