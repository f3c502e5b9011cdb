"""What the CPU tests of the warp-specialised kernels (test_triton_ws.py, test_triton_fwd_ws.py) share: compiling
a Gluon kernel for sm_90a on a machine without a GPU (ptxas from the triton wheel), reading what ptxas reports,
and pretending the problem's device is an sm_90 part for the dispatch rules."""

from __future__ import annotations

import contextlib
import inspect
import re
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import torch
import triton


@contextlib.contextmanager
def pretend_capability(capability=(9, 0)):
    """Within the block the Triton backend takes every CUDA device for one of `capability` (its rules read only
    that) and runs no interpreter. A context manager, not a fixture: hypothesis examples run it each."""
    from flash_attn_ck.backends.triton import backend
    with mock.patch.object(backend, "_capability", return_value=capability), \
            mock.patch.object(backend, "_INTERPRETING", False):
        yield


SM90_SHARED_BYTES = 227 * 1024   # the most shared memory one CTA may use on an H100/H200 (sm_90)


def descriptor_type(rows: int, head_dim: int, dtype: torch.dtype, parts: int = 1) -> str:
    """The mangled signature type of a host TMA descriptor with (rows, 1, head dim padded / parts) boxes."""
    from triton.runtime.jit import mangle_type

    from flash_attn_ck.backends.triton import gluon_common
    return mangle_type(gluon_common.descriptor(torch.empty(512, 4, head_dim, dtype=dtype), True, rows, parts))


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, num_warps: int, **options):
    """triton.compile of a Gluon kernel for sm_90a; parameters missing from `types` and `constexprs` are i32;
    `options`: further compile options (maxnreg)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in inspect.signature(kernel.fn).parameters}
    return triton.compile(GluonASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, **options))


def ptxas_report(ptx: str) -> dict[str, int]:
    """ptxas -v of the PTX for sm_90a: registers at launch (warp-specialised partitions then move them with
    setmaxnreg) and the bytes of spill stores and loads."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        text = subprocess.run([str(tool), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp, "k.cubin"))],
                              capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    return dict(registers=int(regs.group(1)), spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)))
