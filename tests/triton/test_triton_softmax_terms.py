"""CPU tests of the terms both Triton kernel families compute alike (softmax_terms.py): a learnable sink taken into
the forwards' softmax (docs/semantics.md §Learnable sinks), the softcap and ALiBi on the warp-specialised kernels.
Which operator takes each (Backend.forward_takes_sink and the operators' `takes_sink`; the Gluon operators'
supports_softcap and supports_alibi), what each launches for such a call without a GPU (scripts/launch_compare.py's
recorder: the kernel's Sink, softcap and alibi arguments, and whether the pipeline's fold still passes over out), and
that fwd_ws's, bwd_ws's and bwd_ws_split's variants compile to sm_90a with the terms in them. The one-launch kernels'
numbers run under the interpreter (tests/api/test_sinks.py), the Gluon kernels' on a GPU (tests/gpu/test_sinks_gpu.py,
tests/gpu/test_triton.py)."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from gluon_compile import (
    SM90_SHARED_BYTES,
    bwd_spec,
    compile_sm90,
    compile_spec,
    fwd_spec,
    hardware_tanh_kernel,
    pretend_capability,
    ptxas_report,
    sass_loops,
    spill_allowance,
)

from flash_attn_ck.backends.triton import config, operators
from flash_attn_ck.backends.triton.backend import TritonBackend
from flash_attn_ck.core.mask import MaskInfo
from flash_attn_ck.core.problem import AttentionProblem

ROOT = Path(__file__).resolve().parents[2]


def _problem(seqlen: int, head_dim: int, **features) -> AttentionProblem:
    mask = MaskInfo.from_flash_args(True, (-1, -1), seqlen, seqlen)
    return AttentionProblem(2, seqlen, seqlen, 8, 2, head_dim, torch.bfloat16, torch.device("cuda"), mask,
                            head_dim ** -0.5, has_sink=True, **features)


@pytest.fixture
def stand_in_tables(monkeypatch):
    """Measured tables of our own choosing (config's change with each measurement; the rules that read them do not):
    fwd_ws takes the softcap at head block 256 and dropout at 64, bwd_ws dropout at 64 and 128, bwd_ws_split
    neither, ALiBi under Triton 3.6 only."""
    monkeypatch.setattr(operators.FwdWs, "softcap_head_blocks", frozenset({256}))
    monkeypatch.setattr(operators.FwdWs, "dropout_head_blocks", frozenset({64}))
    monkeypatch.setattr(operators.BwdWs, "dropout_head_blocks", frozenset({64, 128}))
    monkeypatch.setattr(operators.BwdWsSplit, "softcap_head_blocks", frozenset())
    monkeypatch.setattr(operators.BwdWsSplit, "dropout_head_blocks", frozenset())
    monkeypatch.setattr(config, "WS_ALIBI_TRITON_RELEASES", frozenset({(3, 6)}))


@pytest.mark.parametrize("seqlen,head_dim,features,operator", [
    (4096, 128, {}, operators.FwdWs),                  # the warp-specialised forward's calls
    (64, 128, {}, operators.Forward),                  # too short for it
    (4096, 128, dict(softcap=30.0), operators.Forward),  # a head block without its softcap (stand_in_tables)
    (4096, 256, dict(softcap=30.0), operators.FwdWs),
    (4096, 80, dict(head_dim_v=64), operators.Forward),
])
def test_the_forward_takes_the_sink_where_its_operator_says(stand_in_tables, seqlen, head_dim, features, operator):
    backend, p = TritonBackend(), _problem(seqlen, head_dim, **features)
    with pretend_capability():
        assert backend.operator(p, "forward") is operator
        assert backend.forward_takes_sink(p) is operator.takes_sink
    assert operators.Forward.takes_sink and operators.FwdWs.takes_sink


_RECORD = r"""
import json, sys
sys.path.insert(0, "scripts")
from flash_attn_ck.backends.triton import operators
on = sys.argv[1] == "on"
operators.FwdWs.takes_sink = operators.FwdWs.supports_softcap = operators.BwdWs.supports_softcap = on
operators.FwdWs.supports_alibi = operators.BwdWs.supports_alibi = operators.BwdWsSplit.supports_alibi = on
import launch_compare
print(json.dumps(launch_compare.record(*sys.argv[2:])))
"""


def _records(fwd_ws_takes_them: bool, *names: str) -> dict:
    """launch_compare's records of the grid's calls `names`, with fwd_ws taking sinks, softcap and ALiBi, and the
    warp-specialised backward softcap (bwd_ws) and ALiBi, or not."""
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


# What each warp-specialised kernel gets for a score term (launch_compare's runtime arguments, by path): the call's
# cap; the call's (h,) slopes and their batch stride, 0.
TERM_ARGUMENTS = {"softcap": {"softcap": 30.0}, "alibi": {"alibi[0]": {"tensor": "alibi_slopes"}, "alibi[1]": 0}}


@pytest.mark.parametrize("on", [False, True], ids=["one-launch", "ws"])
@pytest.mark.parametrize("term", sorted(TERM_ARGUMENTS))
def test_a_score_term_call_runs_on_the_ws_kernels_only_where_it_is_declared(term, on):
    """A softcap or ALiBi call on the warp-specialised setting (launch_compare's d128-ws-softcap, d128-ws-alibi):
    its forward on fwd_ws and its backward on bwd_ws, each given the term as its kernel argument, where the operators'
    supports_softcap / supports_alibi say so, else on the one-launch kernels, which take it among their score
    arguments."""
    call = f"d128-ws-{term}"
    for run in _records(on, call)[call]:
        kernels = [launch["kernel"] for launch in run["launches"]]
        if not on:
            assert "attn_fwd_kernel" in kernels and "attn_bwd_kernel" in kernels, kernels
            assert not any(kernel.endswith("_ws_kernel") for kernel in kernels), kernels
            continue
        assert "attn_fwd_ws_kernel" in kernels and "attn_bwd_ws_kernel" in kernels, kernels
        for launch in run["launches"]:
            if launch["kernel"] in ("attn_fwd_ws_kernel", "attn_bwd_ws_kernel"):
                given = {path: value for path, value in launch["runtime"] if path.startswith(term)}
                for path, expected in TERM_ARGUMENTS[term].items():
                    if isinstance(expected, dict):
                        assert {key: given[path][key] for key in expected} == expected, (launch["kernel"], given)
                    else:
                        assert float(given[path]) == expected, (launch["kernel"], given)


@pytest.mark.parametrize("feature,declared,refusal", [
    (dict(softcap=20.0), "supports_softcap", "softcap is not supported"),
    (dict(has_alibi=True), "supports_alibi", "ALiBi is not supported")], ids=["softcap", "alibi"])
@pytest.mark.parametrize("operator", [operators.FwdWs, operators.BwdWs, operators.BwdWsSplit],
                         ids=lambda op: op.name)
def test_the_ws_kernels_name_a_feature_among_their_reasons_while_off(operator, feature, declared, refusal):
    head_dim = 256 if operator is operators.BwdWsSplit else 128
    backend, p = TritonBackend(), _problem(4096, head_dim, **feature)
    with pretend_capability():
        reasons = backend.reasons(p, operator)
        assert (refusal in reasons) is not getattr(operator, declared), reasons


# (operator, head dim, the call's term, Triton release) -> whether the defaults leave the call to the one-launch kernel,
# and the words of that reason, under stand_in_tables.
MEASURED_RULES = [
    (operators.FwdWs, 128, dict(softcap=20.0), "3.6.0", "softcap at head dim 128: not measured faster"),
    (operators.FwdWs, 64, dict(softcap=20.0), "3.9.0", "softcap at head dim 64: not measured faster"),
    (operators.FwdWs, 256, dict(softcap=20.0), "3.6.0", None),
    (operators.FwdWs, 192, dict(softcap=20.0), "3.9.0", None),
    (operators.BwdWs, 128, dict(softcap=20.0), "3.9.0", None),
    (operators.BwdWs, 64, dict(softcap=20.0), "3.6.0", None),
    (operators.BwdWsSplit, 256, dict(softcap=20.0), "3.6.0", "softcap at head dim 256: not measured faster"),
    (operators.FwdWs, 128, dict(has_alibi=True), "3.6.0", None),
    (operators.BwdWs, 128, dict(has_alibi=True), "3.6.1", None),
    (operators.BwdWsSplit, 256, dict(has_alibi=True), "3.6.0", None),
    (operators.FwdWs, 128, dict(has_alibi=True), "3.9.0", "ALiBi under Triton 3.9.0: not measured faster"),
    (operators.BwdWs, 64, dict(has_alibi=True), "3.7.1", "ALiBi under Triton 3.7.1: not measured faster"),
    (operators.BwdWsSplit, 256, dict(has_alibi=True), "3.8.0", "ALiBi under Triton 3.8.0: not measured faster"),
    (operators.FwdWs, 128, dict(dropout_p=0.1), "3.6.0", "dropout at head dim 128: not measured faster"),
    (operators.FwdWs, 256, dict(dropout_p=0.1), "3.9.0", "dropout at head dim 256: not measured faster"),
    (operators.FwdWs, 64, dict(dropout_p=0.1), "3.6.0", None),
    (operators.BwdWs, 64, dict(dropout_p=0.1), "3.6.0", None),
    (operators.BwdWs, 128, dict(dropout_p=0.1), "3.9.0", None),
    (operators.BwdWsSplit, 256, dict(dropout_p=0.1), "3.6.0", "dropout at head dim 256: not measured faster"),
]


@pytest.mark.parametrize("operator,head_dim,feature,version,reason", MEASURED_RULES,
                         ids=[f"{op.name}-d{d}-{next(iter(f))}-{v}" for op, d, f, v, _ in MEASURED_RULES])
def test_the_defaults_leave_a_score_term_to_the_one_launch_kernels_only_where_those_measured_faster(
        monkeypatch, stand_in_tables, operator, head_dim, feature, version, reason):
    """Under the default settings the warp-specialised kernel refuses a term it takes where the one-launch kernel
    measured faster, naming the term and where (the head dim, the Triton release), and takes it elsewhere; with its
    setting forced on it takes it everywhere. The backend's choice follows."""
    from flash_attn_ck.backends.triton.runtime import triton_versions
    monkeypatch.setattr(triton_versions, "installed", lambda: version)
    with pretend_capability():
        default = TritonBackend().reasons(_problem(4096, head_dim, **feature), operator)
        forced = TritonBackend(**{operator.option: True}).reasons(_problem(4096, head_dim, **feature), operator)
        chosen = TritonBackend().operator(_problem(4096, head_dim, **feature), operator.role)
    terms = ("softcap at", "ALiBi under", "dropout at")
    found = [r for r in default if r.startswith(terms)]
    if reason is None:
        assert found == [] and chosen is operator, (default, chosen)
    else:
        assert len(found) == 1 and found[0].startswith(reason), default
        assert f"TritonBackend({operator.option}=True) runs it" in found[0]
        assert not chosen.name.endswith(("_ws", "_ws_split")), chosen
    assert not [r for r in forced if r.startswith(terms)], forced


def test_hardware_tanh_is_one_mufu_op_per_value():
    """gluon_common.hardware_tanh compiles to the GPU's tanh (tests/gpu/test_triton.py measures its error)."""
    kernel = compile_sm90(hardware_tanh_kernel(), {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {"BLOCK": 512}, 4)
    assert re.findall(r"tanh\.approx\.f32", kernel.asm["ptx"]) and "ex2" not in kernel.asm["ptx"]


def _loop_mufu(kernel) -> collections.Counter:
    """The MUFU (special-function unit) ops of the kernel's busiest wgmma loop in SASS, by op: the key-tile loop of
    the forward's consumers, the query-tile loop of the backward's MMA warps."""
    loops = [collections.Counter(found.group(0) for text in body if (found := re.search(r"MUFU\.\w+", text)))
             for body in sass_loops(kernel.asm["cubin"])]
    return max(loops, key=lambda counts: sum(counts.values()))


def _assert_one_tanh_per_score(without: collections.Counter, capped: collections.Counter):
    """The capped loop takes one MUFU.TANH per score (as many as the per-score exp2s of the loop without, which the
    forward's has one or two more of, its rows' rescale), keeps the softmax's exp2s, and adds no other MUFU op but a
    scalar reciprocal: two MUFU ops a score, where one_launch's accurate_tanh makes three."""
    exp2 = without["MUFU.EX2"]
    assert exp2 - 2 <= capped["MUFU.TANH"] <= exp2, (without, capped)
    assert capped["MUFU.EX2"] == exp2, (without, capped)
    assert sum(capped.values()) - capped["MUFU.TANH"] - exp2 <= 1, (without, capped)


@pytest.mark.parametrize("head_dim", sorted(config.FWD_WS_SM90))
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_fwd_ws_compiles_the_softcap_into_its_softmax_step(head_dim, varlen):
    """The softcap variant computes the hardware tanh per score beside the softmax's exp2 and spills no more than the
    variant without it (under the ptxas the tiles were tuned with; gluon_compile.spill_allowance); with a sink too."""
    tile = config.fwd_ws_tile(head_dim, causal=True)
    kernels = {cap: compile_spec(fwd_spec(tile, head_dim, varlen, (False, False, True), softcap=cap, sink=bool(cap)))
               for cap in (0.0, 30.0)}
    _assert_one_tanh_per_score(_loop_mufu(kernels[0.0]), _loop_mufu(kernels[30.0]))
    spills = {cap: ptxas_report(kernel.asm["ptx"])["spill_stores"] for cap, kernel in kernels.items()}
    assert spills[30.0] <= spill_allowance(spills[0.0]), spills


# (kernel, head dim) of the warp-specialised kernels that take dropout: fwd_ws's tiles, bwd_ws's and bwd_ws_split's.
DROPOUT_KERNELS = [("fwd_ws", d) for d in sorted(config.FWD_WS_SM90)] + \
    [("bwd_ws_split" if tile.split_d else "bwd_ws", d) for d, tile in sorted(config.BWD_WS_SM90.items())]


@pytest.mark.parametrize("kernel,head_dim", DROPOUT_KERNELS, ids=[f"{k}-d{d}" for k, d in DROPOUT_KERNELS])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_the_ws_kernels_draw_one_philox_per_four_scores(kernel, head_dim, varlen):
    """The dropout variant of fwd_ws, bwd_ws and bwd_ws_split draws Philox-4x32-10 (two 32-bit high multiplies a
    round, ten rounds, the first round's multiply of the head's counter word shared by all) once per four scores: 19 /
    4 `mul.hi.u32` per score, between 3 and 5 per exp2 of its PTX (which has a few more exp2s than scores: the
    forward's rescale); one draw per score would be 19. The variant without dropout has none; the variant with fits
    an sm_90 CTA's shared memory (bwd_ws_split's holds the whole P^T beside the dropped one)."""
    def ptx(drop: bool) -> str:
        if kernel == "fwd_ws":
            spec = fwd_spec(config.fwd_ws_tile(head_dim, causal=True), head_dim, varlen, (False, False, True),
                            dropout=drop)
        else:
            spec = bwd_spec(config.bwd_ws_tile(head_dim, True, 1, False), head_dim, varlen, (False, False, True),
                            dropout=drop)
        compiled = compile_spec(spec)
        assert compiled.metadata.shared <= SM90_SHARED_BYTES, compiled.metadata.shared
        return compiled.asm["ptx"]
    texts = {drop: ptx(drop) for drop in (False, True)}
    multiplies = {drop: len(re.findall(r"mul\.hi\.u32", text)) for drop, text in texts.items()}
    exp2 = len(re.findall(r"ex2\.approx", texts[True]))
    assert multiplies[False] == 0 and 3 * exp2 <= multiplies[True] <= 5 * exp2, (multiplies, exp2)


@pytest.mark.parametrize("head_dim", sorted(config.BWD_WS_SM90))
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_the_ws_backward_compiles_the_softcap_into_its_scores(head_dim, varlen):
    """The softcap variant of bwd_ws and bwd_ws_split computes the hardware tanh per score beside P^T's exp2. bwd_ws
    keeps the tanh tile for dS; bwd_ws_split hands the scores' slope from its scores warpgroup to its dP one through
    a shared tile of its own (its shared memory grows by one block_n x block_m tile of the input dtype), spilling at
    most a few registers more."""
    tile = config.bwd_ws_tile(head_dim, True, 1, False)
    kernels = {cap: compile_spec(bwd_spec(tile, head_dim, varlen, (False, False, True), softcap=cap))
               for cap in (0.0, 30.0)}
    _assert_one_tanh_per_score(_loop_mufu(kernels[0.0]), _loop_mufu(kernels[30.0]))
    grown = kernels[30.0].metadata.shared - kernels[0.0].metadata.shared
    slope_tile = tile.block_n * tile.block_m * 2 if tile.split_d else 0
    assert slope_tile <= grown < slope_tile + 1024, grown     # and its alignment (swizzled tiles: 1024 bytes)
    if tile.split_d:
        spills = {cap: ptxas_report(kernel.asm["ptx"])["spill_stores"] for cap, kernel in kernels.items()}
        assert spills[30.0] <= spill_allowance(spills[0.0] + 32), spills


@pytest.mark.parametrize("head_dim", sorted(set(config.FWD_WS_SM90) | set(config.BWD_WS_SM90)))
def test_the_ws_kernels_compile_alibi_into_their_scores(head_dim):
    """fwd_ws, bwd_ws and bwd_ws_split with ALiBi load the head's slope (a global load the variant without has not)
    and compile for sm_90a, varlen included."""
    def loads(spec):
        return len(re.findall(r"ld\.global", compile_spec(spec).asm["ptx"]))
    for alibi_spec in (fwd_spec, bwd_spec):
        table = config.FWD_WS_SM90 if alibi_spec is fwd_spec else config.BWD_WS_SM90
        if head_dim not in table:
            continue
        tile = table[head_dim][True] if alibi_spec is fwd_spec else table[head_dim]
        without, with_alibi = (loads(alibi_spec(tile, head_dim, True, (False, False, True), alibi=alibi))
                               for alibi in (False, True))
        assert with_alibi > without, (alibi_spec.__name__, without, with_alibi)
