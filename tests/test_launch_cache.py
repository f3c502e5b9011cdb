"""backends/triton/launch.py's compiled-kernel cache (CPU): its key is at least as fine as Triton's own
specialisation (two arguments it does not tell apart compile to the same variant), and a launch goes
through Triton's JIT path exactly when the key is new, else straight to the compiled kernel's launcher."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from flash_attn_ck.backends.triton import launch  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    _CUDA = CUDABackend(GPUTarget("cuda", 90, 32))
except Exception:      # no NVIDIA backend in this triton build
    _CUDA = None

_BUFFER = torch.empty(64, dtype=torch.uint8)
_INTS = [*range(-3, 41), 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -2 ** 31, -2 ** 31 - 1, -2 ** 31 - 16,
         2 ** 63 - 16, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 16, -2 ** 63]
_TENSORS = [_BUFFER[offset:offset + 16].view(dtype)
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)
            for offset in range(0, 33, torch.empty((), dtype=dtype).element_size())]
_SCALARS = [*_INTS, True, False, 0.0, 1.0, -2.5, *_TENSORS]


def _descriptors():
    """Host tensor descriptors (Gluon's with shared layouts, tl's) over several dtypes, blocks, shapes, offsets."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor
    buffer = torch.zeros(32768, dtype=torch.uint8)
    found = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base = buffer.view(dtype)
        for rows, cols, offset in ((64, 64, 0), (32, 64, 64), (48, 96, 0), (64, 32, 32)):
            t = base[offset:offset + rows * cols].view(rows, cols)
            for block in ([64, 64], [32, 64], [64, 32]):
                for swizzle in (64, 128):
                    layout = gl.NVMMASharedLayout(swizzle, torch.empty((), dtype=dtype).element_size() * 8, 2)
                    found.append(GluonDescriptor.from_tensor(t, block, layout))
                found.append(TensorDescriptor.from_tensor(t, block))
    return found


def _triton(value):
    return native_specialize_impl(_CUDA, value, False, True, True)


def _assert_finer(values):
    """Values with one key share one Triton specialisation."""
    seen = {}
    for value in values:
        spec = seen.setdefault(launch.specialisation(value), (value, _triton(value)))
        assert _triton(value) == spec[1], (value, spec[0])


@pytest.mark.skipif(_CUDA is None, reason="triton has no NVIDIA backend here")
def test_the_key_is_at_least_as_fine_as_tritons():
    _assert_finer(_SCALARS)
    _assert_finer(_descriptors())


@pytest.mark.skipif(_CUDA is None, reason="triton has no NVIDIA backend here")
@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_SCALARS), min_size=1, max_size=3).map(tuple), min_size=2, max_size=40))
def test_the_key_of_tuples_is_at_least_as_fine_as_tritons(values):
    _assert_finer(values)


def test_strings_and_unknown_objects_have_no_key():
    assert launch.specialisation("x") is None
    assert launch.specialisation((1, object())) is None


class _FakeKernel:
    """A JITFunction's surface: `params`, and `kernel[grid](...)` returning a compiled kernel with `run`."""

    def __init__(self, constexpr):
        self.params = [types.SimpleNamespace(is_constexpr=c) for c in constexpr]
        self.jit_launches = []
        self.direct = []
        kernel = self

        class Compiled:
            function, packed_metadata = "function", "metadata"

            @staticmethod
            def run(*args):
                kernel.direct.append(args)
        self.compiled = Compiled()

    def __getitem__(self, grid):
        def launch_(*args, num_warps, num_stages):
            self.jit_launches.append((grid, args, num_warps, num_stages))
            return self.compiled
        return launch_


@pytest.fixture
def fake_driver(monkeypatch):
    import triton.runtime as runtime
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    monkeypatch.setattr(runtime, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(launch, "_COMPILED", {})


def test_a_new_key_compiles_through_triton_then_launches_directly(fake_driver):
    kernel = _FakeKernel([False, False, False, True])
    x = torch.zeros(32, dtype=torch.bfloat16)
    launch.launch_kernel(kernel, (3, 2), (x, 7, (5, 16), 64), 4, 2)
    assert len(kernel.jit_launches) == 1 and not kernel.direct
    y = torch.ones(32, dtype=torch.bfloat16)          # same specialisation, other tensor and values
    launch.launch_kernel(kernel, (5,), (y, 9, (3, 32), 64), 4, 2)
    assert len(kernel.jit_launches) == 1
    assert kernel.direct == [(5, 1, 1, 1234, "function", "metadata", None, None, None,
                              y.data_ptr(), 9, (3, 32), 64)]
    changed = [(x[1:], 7, (5, 16), 64),        # misaligned by one element
               (x.float(), 7, (5, 16), 64),    # dtype
               (x, 1, (5, 16), 64),            # an int == 1
               (x, 7, (5, 17), 64),            # a tuple element's divisibility by 16
               (x, 7, (5, 16), 128)]           # a constexpr
    for args in changed:
        launch.launch_kernel(kernel, (3, 2), args, 4, 2)
    launch.launch_kernel(kernel, (3, 2), (x, 7, (5, 16), 64), 8, 2)      # num_warps
    assert len(kernel.jit_launches) == 1 + len(changed) + 1 and len(kernel.direct) == 1


def test_launch_hooks_take_tritons_path(fake_driver, monkeypatch):
    """A profiler's launch hook needs Triton's launch metadata: with one installed every launch goes through it."""
    from triton import knobs
    kernel = _FakeKernel([False, True])
    x = torch.zeros(8)
    launch.launch_kernel(kernel, (1,), (x, 4), 4, 1)
    knobs.runtime.launch_enter_hook.add(print)
    try:
        launch.launch_kernel(kernel, (1,), (x, 4), 4, 1)
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    assert len(kernel.jit_launches) == 2 and not kernel.direct
    launch.launch_kernel(kernel, (1,), (x, 4), 4, 1)
    assert len(kernel.direct) == 1


_INTERPRETED = """
import json, torch
from flash_attn_ck.backends.triton import launch
torch.manual_seed(0)
results = {}
for zero_src in (False, True):
    src = torch.randn(2, 3, 5, 8)                     # (b, h, s, d) accumulator
    dst = torch.empty(2, 5, 3, 8, dtype=torch.float16)
    before = src.clone()
    launch.cast_rows(src, dst, src.stride()[:3], launch.bhr(dst, False), 3, 2, 5, 8, 8, zero_src).launch()
    results[str(zero_src)] = dict(cast=bool(torch.equal(dst, before.half().transpose(1, 2))),
                                  src_zero=bool((src == 0).all()), src_kept=bool(torch.equal(src, before)))
print(json.dumps(results))
"""


def test_the_cast_zeroes_its_source_when_asked():
    """Interpreted (TRITON_INTERPRET=1, so in a subprocess): the cast zeroes its source as it reads it only when
    asked (the warp-specialised backward's accumulator between launches), writing the same output either way.
    (The pre-process's zeroing, which now also clears that accumulator before the first launch, does not run in
    the triton 3.6 interpreter: a loop bound from program ids; the GPU tests of both backward kernels cover it.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert results["False"] == dict(cast=True, src_zero=False, src_kept=True)
    assert results["True"] == dict(cast=True, src_zero=True, src_kept=False)
