"""CPU tests of the terms both Triton kernel families compute alike (softmax_terms.py) in the forwards: a learnable
sink taken into the softmax (docs/semantics.md §Learnable sinks) and fwd_ws's softcap. Which operator takes each
(Backend.forward_takes_sink and the operators' `takes_sink`; FwdWs.supports_softcap), what each launches for such a
call without a GPU (scripts/launch_compare.py's recorder: the kernel's Sink and softcap arguments, and whether the
pipeline's fold still passes over out), and that fwd_ws's variants compile to sm_90a with the terms in them. The
one-launch kernel's numbers run under the interpreter (tests/api/test_sinks.py), fwd_ws's on a GPU
(tests/gpu/test_sinks_gpu.py, tests/gpu/test_triton.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from gluon_compile import compile_spec, fwd_spec, pretend_capability, ptxas_report

from flash_attn_ck.backends.triton import config, operators
from flash_attn_ck.backends.triton.backend import TritonBackend
from flash_attn_ck.core.mask import MaskInfo
from flash_attn_ck.core.problem import AttentionProblem

ROOT = Path(__file__).resolve().parents[2]


def _problem(seqlen: int, head_dim: int, **features) -> AttentionProblem:
    mask = MaskInfo.from_flash_args(True, (-1, -1), seqlen, seqlen)
    return AttentionProblem(2, seqlen, seqlen, 8, 2, head_dim, torch.bfloat16, torch.device("cuda"), mask,
                            head_dim ** -0.5, has_sink=True, **features)


@pytest.mark.parametrize("seqlen,head_dim,features,operator", [
    (4096, 128, {}, operators.FwdWs),                  # the warp-specialised forward's calls
    (64, 128, {}, operators.Forward),                  # too short for it
    (4096, 128, dict(softcap=30.0), operators.Forward),
    (4096, 80, dict(head_dim_v=64), operators.Forward),
])
def test_the_forward_takes_the_sink_where_its_operator_says(seqlen, head_dim, features, operator):
    backend, p = TritonBackend(), _problem(seqlen, head_dim, **features)
    with pretend_capability():
        assert backend.operator(p, "forward") is operator
        assert backend.forward_takes_sink(p) is operator.takes_sink
    assert operators.Forward.takes_sink and operators.FwdWs.takes_sink is config.FWD_WS_TAKES_SINK


_RECORD = r"""
import json, sys
sys.path.insert(0, "scripts")
from flash_attn_ck.backends.triton import operators
operators.FwdWs.takes_sink = operators.FwdWs.supports_softcap = sys.argv[1] == "on"
import launch_compare
print(json.dumps(launch_compare.record(*sys.argv[2:])))
"""


def _records(fwd_ws_takes_them: bool, *names: str) -> dict:
    """launch_compare's records of the grid's calls `names`, with fwd_ws taking sinks and softcap or not."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FLASH_ATTN_CK_BACKEND", None)
    run = subprocess.run([sys.executable, "-c", _RECORD, "on" if fwd_ws_takes_them else "off", *names], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("fwd_ws_takes_sink", [False, True], ids=["fwd_ws-folded", "fwd_ws-in-kernel"])
def test_a_sink_call_launches_the_sink_or_folds_it_never_both(fwd_ws_takes_sink):
    """Each forward kernel gets the call's sink as its Sink argument and out is written by the kernel alone, or gets
    None and the fold rescales out once (`mul_`): on the one-launch forward always the first, on fwd_ws as
    FwdWs.takes_sink says; in both calls of a signature (the second replays the first)."""
    records = _records(fwd_ws_takes_sink, "d128-ws-sink", "d64-one_launch-sink")
    for name, runs in records.items():
        for run in runs:
            forward = run["launches"][0]
            assert forward["kernel"] == ("attn_fwd_ws_kernel" if "-ws-" in name else "attn_fwd_kernel"), name
            in_kernel = fwd_ws_takes_sink or "one_launch" in name
            sinks = [value for path, value in forward["runtime"] if path == "Sink"]
            if in_kernel:
                assert [s["tensor"] for s in sinks] == ["learnable_sink"] and sinks[0]["dtype"] == "float32", name
                assert run["buffers"]["out"]["written"] == [], name
            else:
                assert sinks == [] and forward["constexprs"]["SINK"] is None, name
                assert run["buffers"]["out"]["written"] == ["mul_.Tensor"], name


@pytest.mark.parametrize("head_dim", sorted(config.FWD_WS_SM90))
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_fwd_ws_compiles_the_sink_into_its_epilogue(head_dim, varlen):
    """The sink variant loads the head's logit (global loads the variant without has none of) and adds its exp2
    terms; the variant without a sink has neither."""
    tile = config.fwd_ws_tile(head_dim, causal=True)
    ptx = {sink: compile_spec(fwd_spec(tile, head_dim, varlen, (False, False, True), sink=sink)).asm["ptx"]
           for sink in (False, True)}
    loads = {sink: len(re.findall(r"ld\.global", text)) for sink, text in ptx.items()}
    exp2 = {sink: len(re.findall(r"ex2\.approx", text)) for sink, text in ptx.items()}
    assert loads[True] > loads[False] and exp2[True] > exp2[False], (loads, exp2)


@pytest.mark.parametrize("fwd_ws_softcap", [False, True], ids=["one-launch", "fwd_ws"])
def test_a_softcap_call_runs_on_fwd_ws_only_where_it_is_declared(fwd_ws_softcap):
    """A softcap call on the warp-specialised setting: its forward on fwd_ws with the call's cap as the kernel's
    `softcap` where FwdWs.supports_softcap says so, else on the one-launch forward; its backward on the one-launch
    kernels either way (the Gluon backward takes no softcap)."""
    for run in _records(fwd_ws_softcap, "d128-ws-softcap")["d128-ws-softcap"]:
        forward, backward = run["launches"][0], run["launches"][-1]
        if fwd_ws_softcap:
            assert forward["kernel"] == "attn_fwd_ws_kernel"
            assert [float(value) for path, value in forward["runtime"] if path == "softcap"] == [30.0]
        else:
            assert forward["kernel"] == "attn_fwd_kernel"
        assert backward["kernel"] == "attn_bwd_kernel"


def test_fwd_ws_names_the_softcap_among_its_reasons_while_off():
    backend, p = TritonBackend(), _problem(4096, 128, softcap=20.0)
    with pretend_capability():
        reasons = backend.reasons(p, operators.FwdWs)
        assert ("softcap is not supported" in reasons) is not operators.FwdWs.supports_softcap


@pytest.mark.parametrize("head_dim", sorted(config.FWD_WS_SM90))
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_fwd_ws_compiles_the_softcap_into_its_softmax_step(head_dim, varlen):
    """The softcap variant computes tanh per score (its exp2 and reciprocal, beside the softmax's exp2) and spills no
    more than the variant without it; with a sink too."""
    tile = config.fwd_ws_tile(head_dim, causal=True)
    ptx = {cap: compile_spec(fwd_spec(tile, head_dim, varlen, (False, False, True), softcap=cap,
                                      sink=bool(cap))).asm["ptx"] for cap in (0.0, 30.0)}
    exp2 = {cap: len(re.findall(r"ex2\.approx", text)) for cap, text in ptx.items()}
    assert exp2[30.0] >= 2 * exp2[0.0] - 16, exp2
    assert ptxas_report(ptx[30.0])["spill_stores"] <= ptxas_report(ptx[0.0])["spill_stores"]
