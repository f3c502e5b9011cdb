"""On a GPU: a warp-specialised kernel that fails to compile gives way to the one-launch kernels for the call that
met the failure and every later one, with one warning and results that match the oracle (the CPU tests,
tests/triton/test_triton_versions.py, hold the same rule with stand-ins for the kernels). Each case runs in a fresh
process: the failure is made by replacing a Gluon builtin the kernel calls, and Triton's in-process caches must not
hold the kernel compiled already."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

CASE = textwrap.dedent("""
    import sys, warnings
    import torch
    sys.path[:0] = [{root!r}, {tests!r}]
    from cases import check_case
    from oracle import Config
    from flash_attn_ck.backends.triton.gluon import {module}
    from flash_attn_ck.backends.triton.backend import TritonBackend
    from flash_attn_ck import use_backend

    def not_a_builtin(*args, **kwargs):      # a Gluon kernel cannot call a plain Python function
        pass
    {module}.{name} = not_a_builtin
    cfg = Config(batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=8, heads_k=2, head_dim=128, causal=True)
    with warnings.catch_warnings(record=True) as caught, use_backend(TritonBackend(ws=True, fwd_ws=True)):
        warnings.simplefilter("always")
        for seed in range(3):      # the call that meets the failure, then calls planned without the kernel
            check_case(cfg, backend="triton", device="cuda", seed=seed)
    ours = [str(w.message) for w in caught if "failed to compile" in str(w.message)]
    assert len(ours) == 1, ours
    print("OK", ours[0])
""")


@pytest.mark.parametrize("module,name", [("bwd_ws", "barrier"), ("fwd_ws", "tma_load")])
def test_a_gluon_kernel_that_fails_to_compile_gives_way_on_the_gpu(module, name):
    script = CASE.format(root=str(ROOT), tests=str(ROOT / "tests"), module=module, name=name)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tt.func" not in run.stderr and "PassManager" not in run.stderr     # no compiler dump reached the user
    kernel = "attn_bwd_ws_kernel" if module == "bwd_ws" else "attn_fwd_ws_kernel"
    assert f"{kernel} failed to compile with Triton" in run.stdout
