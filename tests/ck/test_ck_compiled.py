"""The library built by scripts/ck_compile_check.sh (gfx942, Debian's HIP 5.2), loaded with ctypes.

No AMD GPU exists where this runs, so no kernel is launched: the tests check the exported C
functions, that the compiled structs have the sizes ctypes expects, and the glue's host-side
paths (argument checks, and CK's dispatcher answering "no instance" when it sees no device).
Skipped when the compile check has not run.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch
from test_ck_args import make_call

from flash_attn_ck.backends.ck import backend as ck
from flash_attn_ck.backends.ck.plan import ck_backward_plan

_DEFAULT_LIBRARY = Path(__file__).resolve().parents[2] / "build" / "ck_compile_check" / "libflash_attn_ck.so"
LIBRARY = Path(os.environ.get("FLASH_ATTN_CK_CHECK_LIBRARY", _DEFAULT_LIBRARY))
EXPORTED = ["fack_fwd", "fack_bwd", "fack_bwd_tile", "fack_last_error", "fack_last_hip_error", "fack_abi_version",
            "fack_attention_size", "fack_bwd_args_size", "fack_gpu_targets"]

pytestmark = pytest.mark.skipif(not LIBRARY.is_file(), reason=f"{LIBRARY} not built (scripts/ck_compile_check.sh)")


@pytest.fixture(scope="module")
def lib():
    library = ctypes.CDLL(str(LIBRARY))
    ck.declare_functions(library)
    return library


def test_exports_the_c_abi(lib):
    missing = [name for name in EXPORTED if not hasattr(lib, name)]
    assert not missing


def test_compiled_structs_match_ctypes(lib):
    assert ck.abi_mismatch(lib) is None
    assert lib.fack_gpu_targets() == b"gfx942"


def test_null_arguments_are_refused(lib):
    assert lib.fack_bwd(None, None) == 1
    assert lib.fack_last_error() == b"args is NULL"


def test_values_ck_cannot_index_are_refused(lib):
    c = make_call(d=128)
    c.args.attn.q.batch_stride = 2 ** 33
    assert lib.fack_bwd(ctypes.byref(c.args), None) == 1
    assert b"q.batch_stride = 8589934592 does not fit" in lib.fack_last_error()
    c.fwd.dtype = 5
    assert lib.fack_fwd(ctypes.byref(c.fwd), None) == 1
    assert b"dtype 5" in lib.fack_last_error()


def test_dispatch_without_a_device_reports_no_instance(lib):
    # The struct is valid; CK's dispatcher picks kernels by the current device's gfx name, and
    # there is none here, so it launches nothing and the glue says why.
    c = make_call(d=128, causal=True, deterministic=True)
    assert lib.fack_bwd(ctypes.byref(c.args), None) == 2
    message = lib.fack_last_error().decode()
    assert "fmha_bwd: no CK kernel instance" in message and "bottom-right mask" in message
    assert "deterministic" in message and "library targets gfx942" in message
    # The forward's device query fails first: a HIP error, not "no instance" (docs/ck.md, finding 7).
    assert lib.fack_fwd(ctypes.byref(c.fwd), None) == 3
    assert lib.fack_last_error().startswith(b"querying the current HIP device failed")
    assert lib.fack_last_hip_error() != 0


def test_tile_query_names_the_compiled_instances_tile(lib):
    # CK's own dispatcher over the compiled instances (fack_bwd_tile_api.cpp), asked for gfx942.
    kn0 = ctypes.c_int32(0)
    plain = make_call(d=128, dtype=torch.float16)
    assert lib.fack_bwd_tile(ctypes.byref(plain.args), b"gfx942", ctypes.byref(kn0)) == 0
    assert kn0.value == 128
    # The featureful instance: bf16, group mode, mask, ALiBi, dropout, deterministic, d = 72 (pd8).
    rich = make_call(d=72, dtype=torch.bfloat16, lengths=[(5, 9), (0, 4)], causal=True, alibi_shape="h",
                     dropout_p=0.1, deterministic=True)
    assert lib.fack_bwd_tile(ctypes.byref(ck.tile_query_args(rich.problem)), b"gfx942", ctypes.byref(kn0)) == 0
    assert kn0.value == 128
    # The plan sized with that tile and with CK's gfx942 table (what the reference backend uses) agree.
    assert ck_backward_plan(rich.problem, "ck", kn0=kn0.value) == ck_backward_plan(rich.problem, "ck")
    # An instance set without the call, or another architecture: no instance.
    assert lib.fack_bwd_tile(ctypes.byref(make_call(d=64).args), b"gfx942", ctypes.byref(kn0)) == 2
    assert lib.fack_bwd_tile(ctypes.byref(plain.args), b"gfx1100", ctypes.byref(kn0)) == 2
    assert b"no CK kernel instance" in lib.fack_last_error()
