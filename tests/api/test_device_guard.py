"""Every kernel of a call runs with its tensors' GPU current (pipeline/device.py), tested on the CPU with a stand-in
for torch.cuda's current device. The run on two GPUs is tests/gpu/test_triton.py's job where two are lent."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_attn_ck.pipeline.backward import attention_backward
from flash_attn_ck.pipeline.device import on_the_tensors_device
from flash_attn_ck.pipeline.forward import attention_forward


class _StandInCuda:
    """torch.cuda's current device and its `device` guard, on a machine of `count` GPUs that has none."""

    def __init__(self, monkeypatch, current: int):
        self.current, self.entered = current, []
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device", self.guard)

    @contextlib.contextmanager
    def guard(self, device):
        saved, self.current = self.current, device.index
        self.entered.append(device.index)
        try:
            yield
        finally:
            self.current = saved


@settings(max_examples=40, deadline=None)
@given(current=st.integers(0, 7), tensors_gpu=st.integers(0, 7), kind=st.sampled_from(["cuda", "cpu"]),
       fails=st.booleans())
def test_a_step_runs_with_its_tensors_gpu_current(current, tensors_gpu, kind, fails):
    """Property: inside the step the current device is the tensors' GPU; a guard is entered exactly when it was not
    current already (never for CPU tensors), and the previous device is current again afterwards, also when the step
    raises."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        cuda = _StandInCuda(monkeypatch, current)
        seen = []

        @on_the_tensors_device
        def step(first, value):
            seen.append(cuda.current)
            if fails:
                raise RuntimeError("the kernel failed")
            return value

        first = types.SimpleNamespace(device=torch.device(kind, tensors_gpu) if kind == "cuda" else torch.device(kind))
        with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
            assert step(first, 42) == 42
        on_gpu = kind == "cuda"
        assert seen == [tensors_gpu if on_gpu else current]
        assert cuda.entered == ([tensors_gpu] if on_gpu and tensors_gpu != current else [])
        assert cuda.current == current


def test_the_forward_and_backward_pipelines_are_guarded():
    """Both pipeline entries every path calls (the ops, their direct eager path, the integrations) run under it."""
    for entry in (attention_forward, attention_backward):
        assert entry.__wrapped__.__module__.startswith("flash_attn_ck.pipeline.")
        assert entry.__code__ is on_the_tensors_device(lambda first: None).__code__

