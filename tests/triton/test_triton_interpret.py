"""CPU tests: the Triton kernels' logic under TRITON_INTERPRET=1 on tiny shapes, through the public
API (backend="triton") against the float64 oracle of tests/oracle.py under the 2x rule (docs/semantics.md).

TRITON_INTERPRET must be set before triton is imported, so the cases run in a subprocess. What the
interpreter covers (docs/triton.md): forward, pre-process, the key-tile kernel in both GQA modes
(loop over the group on chip; fp32 accumulators with tl.atomic_add, ordered by semaphores when
deterministic), the dQ pass, the atomic-dQ mode, the post-process, and the TMA tensor-descriptor
*store* epilogue. All cases run fp16: the triton 3.6 interpreter's bf16 `tl.dot` returns garbage
(seen with NumPy 2.4), so bf16 is left to the GPU tests. Not covered: the TMA bulk reduce-add
(`descriptor.atomic_add` has no interpreter implementation in triton 3.6) and its completion wait
(inline PTX), which only the GPU tests reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from flash_attn_ck.backends.triton import TritonBackend
from flash_attn_ck.core.mask import API_MASK_KINDS, MaskKind
from folders import PYTHONPATH as TEST_PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]

# Each case: oracle Config fields, plus backend options (gqa_epilogue, dq_mode, use_tma; dp_first:
# the interpreter tiles with config.Configs.bwd_dp_first set).
CASES = {
    "mha_dense": dict(cfg=dict(heads_q=2, heads_k=2)),
    # s_k a multiple of the key tiles: the kernels compile without the mask branch (EVEN_K).
    "even_keys": dict(cfg=dict(seqlen_q=40, seqlen_k=48)),
    "gqa_loop_causal": dict(cfg=dict(causal=True)),
    "gqa_accumulate_det": dict(cfg=dict(causal=True, deterministic=True), opts=dict(gqa_epilogue="accumulate")),
    "gqa_accumulate": dict(cfg=dict(window=(6, 2)), opts=dict(gqa_epilogue="accumulate")),
    "window_sq_gt_sk": dict(cfg=dict(seqlen_q=40, seqlen_k=9, window=(4, 0), heads_q=2, heads_k=2)),
    "sq1": dict(cfg=dict(seqlen_q=1, seqlen_k=20, causal=True)),
    "alibi_softcap": dict(cfg=dict(alibi=True, softcap=5.0, causal=True)),
    # A cap far above the scores (below fp16's largest: the same-precision reference computes in fp16): tanh's
    # argument ~1e-5, where 1 - 2 / (e^2x + 1) cancels.
    "softcap_large": dict(cfg=dict(softcap=2e4, causal=True)),
    "dropout": dict(cfg=dict(dropout_p=0.25)),
    "dq_atomic": dict(cfg=dict(causal=True), opts=dict(dq_mode="atomic")),
    "varlen_zero_lengths": dict(cfg=dict(seqlens=[[5, 9], [0, 7], [17, 3], [4, 0]], causal=True),
                                opts=dict(gqa_epilogue="accumulate")),
    "varlen_det_loop": dict(cfg=dict(seqlens=[[6, 11], [0, 0], [19, 19]], deterministic=True, head_dim=24)),
    "tma_store": dict(cfg=dict(heads_q=4, heads_k=1, head_dim=32), opts=dict(use_tma=True)),
    # config.Configs.bwd_dp_first (the d256 rows' product order) in both backward roles, with the
    # features that touch dp (dropout) and ds (softcap).
    "dp_first": dict(cfg=dict(causal=True, softcap=5.0, dropout_p=0.25), opts=dict(dp_first=True)),
    # v with a head dim of its own (head_dim_v, BLOCK_DV): narrower and not a multiple of 8, wider, in every mode of
    # the backward (the accumulator epilogue asked for runs the group loop: its rows have one width), with TMA
    # stores, varlen with empty sequences; and padded head dims that are equal (the one-head-dim kernels).
    "d_v_narrower_gqa_causal": dict(cfg=dict(head_dim=40, head_dim_v=21, causal=True)),
    "d_v_wider_dropout_softcap": dict(cfg=dict(head_dim=16, head_dim_v=72, dropout_p=0.25, softcap=5.0),
                                      opts=dict(dp_first=True)),
    "d_v_accumulate_asked": dict(cfg=dict(head_dim=24, head_dim_v=40, deterministic=True),
                                 opts=dict(gqa_epilogue="accumulate")),
    "d_v_dq_atomic_varlen": dict(cfg=dict(seqlens=[[5, 9], [0, 7], [17, 3], [4, 0]], head_dim=32, head_dim_v=13,
                                          window=(6, 2)), opts=dict(dq_mode="atomic")),
    "d_v_tma_store": dict(cfg=dict(heads_q=4, heads_k=1, head_dim=32, head_dim_v=64), opts=dict(use_tma=True)),
    "d_v_same_padded_width": dict(cfg=dict(head_dim=20, head_dim_v=19, alibi=True)),
}

_INTERPRETER_PATCH = r"""
import numpy as np
import triton.runtime.interpreter as interp

# triton 3.6's interpreter turns a scalar into a shape-(1,) array and calls int() on it, which
# NumPy >= 2.3 refuses; index with the single element instead.
_patch_tensor = interp._patch_lang_tensor
def _patched(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
interp._patch_lang_tensor = _patched
"""

_RUNNER = _INTERPRETER_PATCH + r"""
import json, sys
import torch
import flash_attn_ck.api  # noqa: F401
from flash_attn_ck import use_backend
from flash_attn_ck.backends.triton import TritonBackend, config
from dataclasses import replace
from oracle import Config
from cases import check_case

case = json.loads(sys.argv[1])
cfg = case["cfg"]
cfg["dtype"] = getattr(torch, cfg.get("dtype", "float16"))
if "seqlens" in cfg:
    cfg["seqlens"] = [tuple(s) for s in cfg["seqlens"]]
if "window" in cfg:
    cfg["window"] = tuple(cfg["window"])
TritonBackend.device_types = frozenset({"cuda", "cpu"})   # the interpreter runs on CPU tensors
opts = case.get("opts", {})
if opts.pop("dp_first", False):
    opts["configs"] = replace(config.INTERPRETER, bwd_dp_first=True)
with use_backend(TritonBackend(**opts)):
    check_case(Config(**cfg), backend="triton")
print("PASS")
"""

# A mask kind below the public API (which makes only flash-attn's kinds), on both shapes of cases.py, with and
# without ALiBi (a top-left mask keeps the bias's bottom-right distance).
_MASK_KIND_RUNNER = _INTERPRETER_PATCH + r"""
import sys
import torch
import flash_attn_ck.api  # noqa: F401
from flash_attn_ck.backends.triton import TritonBackend
from flash_attn_ck.core.mask import MaskKind
from cases import MASK_KIND_SHAPES, check_mask_kind

TritonBackend.device_types = frozenset({"cuda", "cpu"})   # the interpreter runs on CPU tensors
for seqlens in MASK_KIND_SHAPES.values():
    for alibi in (False, True):
        check_mask_kind(TritonBackend(), MaskKind[sys.argv[1]], seqlens, dtype=torch.float16, alibi=alibi)
print("PASS")
"""


# fp32 results (out_dtype, what context parallelism asks for): the kernels convert on store, so out, dq, dk, dv round to
# the default call's bit for bit (GQA loop: dK/dV summed on chip; accumulate: fp32 accumulators; atomic dQ; TMA
# stores; varlen), and are not themselves rounded to fp16.
_FP32_RUNNER = _INTERPRETER_PATCH + r"""
import json, sys
import torch
from flash_attn_ck.api import flash_attn_bwd, flash_attn_fwd
from flash_attn_ck.backends.triton import TritonBackend

TritonBackend.device_types = frozenset({"cuda", "cpu"})   # the interpreter runs on CPU tensors
case = json.loads(sys.argv[1])
h, h_k, d = case["heads"]
g = torch.Generator().manual_seed(0)
shape_q, shape_k = ((30, h, d), (37, h_k, d)) if case.get("varlen") else ((2, 15, h, d), (2, 19, h_k, d))
q, dout = (torch.randn(shape_q, generator=g).half() for _ in range(2))
k, v = (torch.randn(shape_k, generator=g).half() for _ in range(2))
options = dict(causal=case.get("causal", False), backend=TritonBackend(**case.get("opts", {})))
if case.get("varlen"):
    options.update(cu_seqlens_q=torch.tensor([0, 12, 12, 30], dtype=torch.int32), max_seqlen_q=18,
                   cu_seqlens_k=torch.tensor([0, 9, 20, 37], dtype=torch.int32), max_seqlen_k=17)
out, lse, _ = flash_attn_fwd(q, k, v, **options)
out32, lse32, _ = flash_attn_fwd(q, k, v, out_dtype=torch.float32, **options)
grads = flash_attn_bwd(dout, q, k, v, out, lse, **options)[:3]
grads32 = flash_attn_bwd(dout, q, k, v, out, lse, out_dtype=torch.float32, **options)[:3]
for name, rounded, full in zip(("out", "dq", "dk", "dv"), (out, *grads), (out32, *grads32)):
    assert full.dtype == torch.float32 and torch.equal(full.half(), rounded), name
    assert (full.double() - rounded.double()).abs().max() > 0, name + ": the fp32 result was rounded"
print("PASS")
"""

FP32_CASES = {
    "mha": dict(heads=(2, 2, 16)),
    "gqa_loop_causal": dict(heads=(4, 2, 24), causal=True),
    "gqa_accumulate": dict(heads=(4, 1, 16), opts=dict(gqa_epilogue="accumulate")),
    "dq_atomic": dict(heads=(2, 2, 16), causal=True, opts=dict(dq_mode="atomic")),
    "tma_store": dict(heads=(4, 1, 32), opts=dict(use_tma=True)),
    "varlen": dict(heads=(4, 2, 16), causal=True, varlen=True),
}


@pytest.mark.parametrize("name", sorted(FP32_CASES))
def test_interpreted_kernels_write_fp32_results(name):
    _interpret(_FP32_RUNNER, json.dumps(FP32_CASES[name]))


def _interpret(runner: str, argument: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=TEST_PYTHONPATH)
    env.pop("FLASH_ATTN_CK_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", runner, argument], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted_kernels(name):
    _interpret(_RUNNER, json.dumps(CASES[name]))


# The kinds TritonBackend declares beyond flash-attn's own (those run in CASES through the API).
@pytest.mark.parametrize("kind", [kind for kind in MaskKind if kind in TritonBackend.mask_kinds - API_MASK_KINDS],
                         ids=lambda kind: kind.name.lower())
def test_interpreted_mask_kinds(kind):
    _interpret(_MASK_KIND_RUNNER, kind.name)


# Offsets past 2**31 elements inside one sequence or head (a 512K-token sequence at h 32, d 128; a (b, h, s, d)
# layout's head stride): the kernels form them in int64. The tensors live in a sparse file (zeros that cost no
# memory); the interpreter's copy of each storage onto itself after a launch would touch all of it, so it is skipped.
_WIDE_OFFSETS_RUNNER = _INTERPRETER_PATCH + r"""
import os, sys, tempfile
import torch
import triton.runtime.interpreter as interp
from flash_attn_ck.api import flash_attn_bwd, flash_attn_fwd
from flash_attn_ck.backends.triton import TritonBackend

TritonBackend.device_types = frozenset({"cuda", "cpu"})   # the interpreter runs on CPU tensors
restore = interp.GridExecutor._restore_args_dev


def restore_but_self_copies(*args):
    copy = torch.UntypedStorage.copy_

    def copy_unless_itself(dst, src, *rest):
        return dst if dst.data_ptr() == src.data_ptr() else copy(dst, src, *rest)
    torch.UntypedStorage.copy_ = copy_unless_itself
    try:
        return restore(*args)
    finally:
        torch.UntypedStorage.copy_ = copy


interp.GridExecutor._restore_args_dev = restore_but_self_copies
axis = sys.argv[1]                      # "rows" or "heads": which stride is 2**26 (rows) or 2**30 (heads)
rows, heads, d = (40, 1, 16) if axis == "rows" else (8, 3, 16)
stride = 2 ** 26 if axis == "rows" else 2 ** 30
start = 2 ** 31                          # a wrapped offset stays inside the file: wrong values, not a crash
shape, strides = ((1, rows, heads, d), (rows * stride, stride, d, 1)) if axis == "rows" else \
    ((1, rows, heads, d), (heads * stride, d, stride, 1))
numel = start + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
with tempfile.NamedTemporaryFile() as f:
    f.truncate(numel * 2)
    q = torch.from_file(f.name, shared=True, size=numel, dtype=torch.float16).as_strided(shape, strides, start)
    g = torch.Generator().manual_seed(0)
    q.copy_(torch.randn(shape, generator=g).half())
    k, v, dout = (torch.randn(1, rows, 1, d, generator=g).half() for _ in range(3))
    dout = torch.randn(shape, generator=g).half()
    options = dict(backend=TritonBackend(use_tma=False))
    out, lse, _ = flash_attn_fwd(q, k, v, **options)
    want_out, want_lse, _ = flash_attn_fwd(q.contiguous(), k, v, **options)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse), (out - want_out).abs().amax((0, 2, 3))
    grads = flash_attn_bwd(dout, q, k, v, out, lse, **options)[:3]
    wants = flash_attn_bwd(dout, q.contiguous(), k, v, out, lse, **options)[:3]
    for name, got, want in zip(("dq", "dk", "dv"), grads, wants):
        assert torch.equal(got, want), name
print("PASS")
"""


@pytest.mark.parametrize("axis", ["rows", "heads"])
def test_offsets_past_two_to_the_31_elements_are_exact(axis):
    _interpret(_WIDE_OFFSETS_RUNNER, axis)
