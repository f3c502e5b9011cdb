"""backends/triton/runtime/launch.py's compiled-kernel cache (CPU): a launch goes through Triton's JIT path exactly when
its key is new — Triton's own specialisation of each runtime argument, the constexprs, warps, stages — and
otherwise straight to the compiled kernel's launcher with the arguments as given; the cast kernel's zeroing."""

from __future__ import annotations

import types

import pytest
import torch

triton = pytest.importorskip("triton")

from test_triton_interpret import _INTERPRETER_PATCH  # noqa: E402

from flash_attn_ck.backends.triton.runtime import launch  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    _CUDA = CUDABackend(GPUTarget("cuda", 90, 32))
except Exception:      # no NVIDIA backend in this triton build
    _CUDA = None
needs_cuda_backend = pytest.mark.skipif(_CUDA is None, reason="triton has no NVIDIA backend here")


class _FakeKernel:
    """A JITFunction's surface: `params`, and `kernel[grid](...)` returning a compiled kernel with `run`."""

    def __init__(self, constexpr):
        self.params = [types.SimpleNamespace(is_constexpr=c, is_const=False, do_not_specialize=False,
                                             do_not_specialize_on_alignment=False) for c in constexpr]
        self.device_caches = {0: (None, None, None, _CUDA, None)}
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
    monkeypatch.setattr(launch, "_KERNELS", {})


@needs_cuda_backend
def test_a_new_key_compiles_through_triton_then_launches_directly(fake_driver):
    kernel = _FakeKernel([False, False, False, True])
    x = torch.zeros(32, dtype=torch.bfloat16)
    launch.launch_kernel(kernel, (3, 2), (x, 7, (5, 16), 64), 4, 2)
    assert len(kernel.jit_launches) == 1 and not kernel.direct
    y = torch.ones(32, dtype=torch.bfloat16)          # same specialisation, other tensor and values
    launch.launch_kernel(kernel, (5,), (y, 9, (3, 32), 64), 4, 2)
    assert len(kernel.jit_launches) == 1
    assert kernel.direct == [(5, 1, 1, 1234, "function", "metadata", None, None, None, y, 9, (3, 32), 64)]
    changed = [(x[1:], 7, (5, 16), 64),        # misaligned by one element
               (x.float(), 7, (5, 16), 64),    # dtype
               (x, 1, (5, 16), 64),            # an int == 1
               (x, 7, (5, 17), 64),            # a tuple element's divisibility by 16
               (x, 7, (5, 16), 128)]           # a constexpr
    for args in changed:
        launch.launch_kernel(kernel, (3, 2), args, 4, 2)
    launch.launch_kernel(kernel, (3, 2), (x, 7, (5, 16), 64), 8, 2)      # num_warps
    assert len(kernel.jit_launches) == 1 + len(changed) + 1 and len(kernel.direct) == 1


@needs_cuda_backend
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


_INTERPRETED = _INTERPRETER_PATCH + """
import json, torch
from flash_attn_ck.backends.triton.runtime import launch
torch.manual_seed(0)
src = torch.randn(2, 3, 5, 8)                     # (b, h, s, d) accumulator
dst = torch.empty(2, 5, 3, 8, dtype=torch.float16)
before = src.clone()
launch.cast_rows(src, dst, src.stride()[:3], launch.bhr(dst, False), 3, 2, 5, 8, 8).launch()
cast = bool(torch.equal(dst, before.half().transpose(1, 2)))
acc, sems = torch.randn(5000), torch.arange(1, 40, dtype=torch.int32)     # zero_flat: the first 3001 and 17 of them
launch.zero_flat(acc[:3001], sems[:17]).launch()
zeroed = bool((acc[:3001] == 0).all() and (sems[:17] == 0).all())
kept = bool((acc[3001:] != 0).all() and torch.equal(sems[17:], torch.arange(18, 40, dtype=torch.int32)))
print(json.dumps(dict(cast=cast, src_kept=bool(torch.equal(src, before)), zeroed=zeroed, rest_kept=kept)))
"""


def test_the_cast_writes_its_output_and_leaves_its_source():
    """Interpreted (TRITON_INTERPRET=1, so in a subprocess): the cast writes the whole (b, h, s, d) accumulator into a
    (b, s, h, d) output and never writes its source; zero_flat zeroes exactly its buffers, whatever their lengths
    (tests/gpu/test_triton.py runs both compiled on the GPU)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == dict(cast=True, src_kept=True, zeroed=True,
                                                                   rest_kept=True)
