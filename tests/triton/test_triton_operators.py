"""The Triton backend's kernel choice, from its operator lists (backends/triton/operators.py), on CPU: a call runs the
first operator of its role with no reasons, the kernel choice names it and every operator before it with its reasons,
each operator's declarations (features, fp32 results, tile table, architectures, default head dims and lengths)
decide its refusals in words, and the last operator of each role runs every call the backend accepts. Every test
walks the lists, so a new operator is tested by being listed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from gluon_compile import pretend_capability

from flash_attn_ck.backends.triton import config, operators
from flash_attn_ck.backends.triton.backend import TritonBackend
from flash_attn_ck.core.mask import API_MASK_KINDS, MaskInfo, MaskKind
from flash_attn_ck.core.problem import AttentionProblem

ALL = [op for ops in operators.OPERATORS.values() for op in ops]
# A declared feature flag, what a call that uses it changes, and the words of its refusal (backends/base.py).
FEATURES = [("supports_alibi", dict(has_alibi=True), "ALiBi is not supported"),
            ("supports_softcap", dict(softcap=5.0), "softcap is not supported"),
            ("supports_dropout", dict(dropout_p=0.1), "dropout is not supported"),
            ("supports_deterministic", dict(deterministic=True), "deterministic mode is not supported")]
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (64, 16)),
         "window_causal": (True, (64, 0))}


def problem(seqlen=8192, head_dim=128, heads=(16, 16), dtype=torch.bfloat16, mask="none", **features):
    causal, window = MASKS[mask]
    info = MaskInfo.from_flash_args(causal, window, seqlen, seqlen)
    return AttentionProblem(2, seqlen, seqlen, *heads, head_dim, dtype, torch.device("cuda"), info,
                            head_dim ** -0.5, **features)


problems = st.builds(
    problem, seqlen=st.integers(1, 9000), head_dim=st.sampled_from([8, 32, 64, 72, 96, 128, 160, 192, 256]),
    heads=st.sampled_from([(8, 8), (16, 4), (8, 1)]), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    mask=st.sampled_from(sorted(MASKS)), has_alibi=st.booleans(), softcap=st.sampled_from([0.0, 5.0]),
    dropout_p=st.sampled_from([0.0, 0.1]), deterministic=st.booleans())
backends = st.builds(TritonBackend, dq_mode=st.sampled_from(["auto", "pass", "atomic"]),
                     ws=st.sampled_from([None, True, False]), fwd_ws=st.sampled_from([None, True, False]))


@settings(max_examples=80, deadline=None)
@given(p=problems, backend=backends, capability=st.sampled_from([(9, 0), (8, 0), (10, 0)]),
       fp32=st.booleans())
def test_a_call_runs_the_first_operator_with_no_reasons(p, backend, capability, fp32):
    """Property: per role the operator that runs is the first of its list with no reasons, the last one refuses no
    call the backend accepts, and the kernel choice names the operator, then every one before it with its reasons."""
    if fp32:
        p = replace(p, out_dtype=torch.float32)
    with pretend_capability(capability):
        for role, ops in operators.OPERATORS.items():
            reasons = [backend.reasons(p, op) for op in ops]
            assert reasons[-1] == [], (ops[-1].name, reasons[-1])
            chosen = backend.operator(p, role)
            assert chosen is ops[[not r for r in reasons].index(True)]
            choice = backend.kernel_choice(p, role)
            assert choice.startswith(chosen.describe(backend, p))
            for op, reason in zip(ops[:ops.index(chosen)], reasons):
                assert f"; {op.name} not used: {', '.join(reason)}" in choice, (op.name, choice)


@pytest.mark.parametrize("operator", ALL, ids=lambda op: op.name)
@pytest.mark.parametrize("flag,features,sentence", FEATURES, ids=[f[0] for f in FEATURES])
def test_each_declared_feature_decides_a_refusal(operator, flag, features, sentence):
    """A feature an operator declares it lacks is refused in base.py's words, forced or not; one it runs is not."""
    with pretend_capability():
        for backend in (TritonBackend(), TritonBackend(ws=True, fwd_ws=True, dq_mode="atomic")):
            reasons = backend.reasons(problem(**features), operator)
            assert (sentence in reasons) is (not getattr(operator, flag)), (operator.name, reasons)


@pytest.mark.parametrize("operator", ALL, ids=lambda op: op.name)
def test_fp32_results_are_refused_by_the_declaration(operator):
    with pretend_capability():
        forced = TritonBackend(ws=True, fwd_ws=True, dq_mode="atomic")
        reasons = forced.reasons(replace(problem(), out_dtype=torch.float32), operator)
    refusal = operator.fp32_outputs_refusal
    assert (f"out_dtype float32: {refusal}" in reasons) if refusal else not reasons, reasons


@pytest.mark.parametrize("operator", [op for op in ALL if op.tiles is not None], ids=lambda op: op.name)
def test_a_head_dim_outside_the_tile_table_is_refused(operator):
    """Every head block of the table runs when forced; one outside it is refused, naming the table's head dims."""
    forced = TritonBackend(ws=True, fwd_ws=True)
    with pretend_capability():
        for block in (32, 64, 128, 256):
            reasons = forced.reasons(problem(head_dim=block), operator)
            if block in operator.tiles:
                assert reasons == [], (block, reasons)
            else:
                assert reasons == [f"head dim {block}: the kernel has tiles for head dims (padded to a power of two) "
                                   f"{sorted(operator.tiles)}"]


@pytest.mark.parametrize("operator", [op for op in ALL if op.architectures is not None], ids=lambda op: op.name)
@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0), (12, 0)])
def test_an_architecture_outside_the_declared_ones_is_refused(operator, capability):
    with pretend_capability(capability):
        reasons = TritonBackend(ws=True, fwd_ws=True).reasons(problem(), operator)
    assert (operator.architecture_refusal in reasons) is (capability[0] not in operator.architectures)


@settings(max_examples=60, deadline=None)
@given(operator=st.sampled_from([op for op in ALL if op.default_head_dims is not None or op.min_seqlen]),
       head_dim=st.sampled_from([64, 72, 96, 128, 192, 256]), seqlen=st.integers(1, 9000))
def test_the_default_runs_an_operator_exactly_where_it_declares(operator, head_dim, seqlen):
    """Property: on a call the operator runs when forced, the default setting runs it exactly on its default head
    dims from its head block's shortest length; elsewhere it names the head dim or the length."""
    p = problem(head_dim=head_dim, seqlen=seqlen)
    forced = TritonBackend(ws=True, fwd_ws=True, dq_mode="atomic", use_tma=False)
    default = TritonBackend(use_tma=False)
    with pretend_capability():
        if forced.reasons(p, operator):
            return
        reasons = default.reasons(p, operator)
    d = p.head_dim_padded
    in_dims = operator.default_head_dims is None or d in operator.default_head_dims
    long_enough = seqlen >= operator.min_seqlen.get(config.head_block(d), 0)
    assert (reasons == []) is (in_dims and long_enough), reasons
    if not in_dims:
        assert reasons == [f"head dim {d}: {operator.slower_head_dim}"]
    elif not long_enough:
        assert reasons == [f"sequences shorter than {operator.min_seqlen[config.head_block(d)]}: {operator.shorter}"]


@pytest.mark.parametrize("operator", [op for op in ALL if op.option], ids=lambda op: op.name)
def test_the_setting_turns_an_operator_off(operator):
    off = {"ws": dict(ws=False), "fwd_ws": dict(fwd_ws=False), "dq_mode": dict(dq_mode="pass")}[operator.option]
    backend = TritonBackend(**off)
    with pretend_capability():
        assert backend.reasons(problem(), operator) == \
            [f"turned off (TritonBackend({operator.option}={getattr(backend, operator.option)!r}))"]


def test_the_backend_declares_the_mask_kinds_its_operators_run():
    """A mask kind is the backend's when some operator of each role runs it; a kind none runs is refused by the
    backend, in the kind's words."""
    for kind in MaskKind:
        runs = all(any(kind in op.mask_kinds for op in ops) for ops in operators.OPERATORS.values())
        assert (kind in TritonBackend.mask_kinds) is runs
    assert TritonBackend.mask_kinds >= API_MASK_KINDS and MaskKind.GENERIC not in TritonBackend.mask_kinds
