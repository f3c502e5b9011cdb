"""Bounded backward workspace: chunked backwards against unchunked ones, and the planner's promises."""

from __future__ import annotations

import sys
import tracemalloc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_attn_ck as fa
from cases import check_case, make_inputs, varlen_meta
from flash_attn_ck.backends.reference import ReferenceBackend
from flash_attn_ck.backends.registry import backend_class
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.core.problem import AttentionParams
from flash_attn_ck.pipeline.chunking import WORKSPACE_ENV, Chunk, plan_chunks, workspace_cap
from oracle import Config

CASES = {
    "mha-causal": Config(batch=3, heads_q=4, heads_k=4, causal=True),
    "gqa-window-dropout": Config(batch=2, heads_q=6, heads_k=2, window=(6, 3), dropout_p=0.2),
    "mqa-deterministic": Config(batch=2, heads_q=4, heads_k=1, deterministic=True, seqlen_k=260),
    "gqa-alibi-softcap-d59": Config(batch=2, heads_q=4, heads_k=2, alibi=True, softcap=4.0, head_dim=59),
    # Deterministic dq_accum (11 splits) outgrows the fp32 partial sums: query-row chunks pay off.
    "mha-window-rows": Config(batch=2, heads_q=2, heads_k=2, seqlen_q=512, seqlen_k=1300, head_dim=16,
                              window=(200, 40), deterministic=True, dropout_p=0.1),
    "varlen-gqa-dropout": Config(seqlens=[(9, 14), (0, 5), (21, 21), (4, 0)], heads_q=8, heads_k=2, dropout_p=0.2,
                                 causal=True),
}


def backward_once(cfg: Config, seed=0):
    """(problem, run): one forward, and a function running its backward under a workspace cap."""
    q, k, v, dout, slopes = make_inputs(cfg, seed=seed)
    varlen = {}
    if cfg.seqlens is not None:
        cu_q, cu_k, max_q, max_k = varlen_meta(cfg)
        varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    options = dict(causal=cfg.causal, window_size=cfg.window, softcap=cfg.softcap, alibi_slopes=slopes,
                   dropout_p=cfg.dropout_p, deterministic=cfg.deterministic, **varlen)
    torch.manual_seed(seed)
    out, lse, rng_state = fa.flash_attn_fwd(q, k, v, **options)
    problem = describe_call(q, k, v, AttentionOptions(**options))

    def run(cap):
        return fa.flash_attn_bwd(dout, q, k, v, out, lse, rng_state=rng_state, max_workspace_bytes=cap, **options)
    return problem, run


def caps_by_stage(problem, cfg: Config):
    """A cap that forces whole-group/batch chunks, and one that forces split groups."""
    backend = ReferenceBackend()
    full = plan_chunks(problem, backend, None)
    params = None
    if problem.varlen:
        cu_q, cu_k, _, _ = varlen_meta(cfg)
        params = AttentionParams(None, None, None, cu_q, cu_k)
    whole, split = None, None
    for cap in range(full.peak_bytes - 1, 0, -max(1, full.peak_bytes // 64)):
        try:
            plan = plan_chunks(problem, backend, cap, params)
        except fa.WorkspaceError:
            break
        partial = any(c.partial(problem) for c in plan.chunks)
        if not partial and len(plan.chunks) > 1 and whole is None:
            whole = cap
        if partial and split is None:
            split = cap
    return whole, split


@pytest.mark.parametrize("name", CASES)
def test_chunked_backward(name):
    cfg = CASES[name]
    problem, run = backward_once(cfg)
    whole, split = caps_by_stage(problem, cfg)
    unchunked = run(-1)
    assert whole is not None, "the grid must exercise whole-group chunks"
    for a, b in zip(run(whole), unchunked):
        assert torch.equal(a, b), "whole KV-group / batch chunks must be bit-identical to the unchunked call"
    if split is not None:
        first = run(split)
        for a, b in zip(run(split), first):
            assert torch.equal(a, b), "split chunks must be deterministic run to run"
        assert torch.equal(first[0], unchunked[0]), "dQ rows are complete in every chunk"
        assert torch.equal(first[3], unchunked[3])


def test_row_chunks_are_exercised():
    problem, _ = backward_once(CASES["mha-window-rows"])
    _, split = caps_by_stage(problem, CASES["mha-window-rows"])
    plan = plan_chunks(problem, ReferenceBackend(), split)
    assert any(c.rows != (0, problem.seqlen_q) for c in plan.chunks)


@pytest.mark.parametrize("name", ["gqa-window-dropout", "mqa-deterministic", "mha-window-rows", "varlen-gqa-dropout"])
def test_split_chunks_meet_the_2x_rule(name, monkeypatch):
    cfg = CASES[name]
    problem, _ = backward_once(cfg)
    _, split = caps_by_stage(problem, cfg)
    assert split is not None
    monkeypatch.setenv(WORKSPACE_ENV, str(split))
    check_case(cfg)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 4), s_q=st.integers(1, 300), s_k=st.integers(1, 300), groups=st.sampled_from(
    [(8, 8), (8, 2), (8, 1), (6, 3)]), d=st.sampled_from([32, 59, 128, 256]), deterministic=st.booleans(),
    alibi=st.booleans(), cap_fraction=st.floats(0.001, 1.2))
def test_planned_peak_respects_the_cap(b, s_q, s_k, groups, d, deterministic, alibi, cap_fraction):
    q = torch.empty(b, s_q, groups[0], d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(b, s_k, groups[1], d, dtype=torch.bfloat16, device="meta")
    slopes = torch.empty(groups[0], device="meta") if alibi else None
    problem = describe_call(q, k, k, AttentionOptions(causal=True, alibi_slopes=slopes, deterministic=deterministic))
    backend = ReferenceBackend()
    unchunked = plan_chunks(problem, backend, None)
    cap = int(unchunked.peak_bytes * cap_fraction)
    try:
        plan = plan_chunks(problem, backend, cap)
    except fa.WorkspaceError as error:
        assert "needs at least" in str(error) and "over the cap" in str(error)
        return
    assert plan.peak_bytes <= cap
    # The chunks tile the call exactly once.
    covered = torch.zeros(b, groups[0], s_q, dtype=torch.int32)
    for c in plan.chunks:
        heads = [g * problem.group_size + a for g in range(*c.kv_heads) for a in range(*c.group_heads)]
        covered[c.batch[0]:c.batch[1], heads, c.rows[0]:c.rows[1]] += 1
    assert torch.equal(covered, torch.ones_like(covered))


def test_impossible_cap_says_how_much_is_needed():
    cfg = Config(batch=1, heads_q=2, heads_k=1)
    _, run = backward_once(cfg)
    with pytest.raises(fa.WorkspaceError, match=r"needs at least [\d.]+ (B|KiB) .* over the cap of 100 B"):
        run(100)


def test_cap_from_environment(monkeypatch):
    monkeypatch.setenv(WORKSPACE_ENV, "12345")
    assert workspace_cap(None) == 12345
    monkeypatch.setenv(WORKSPACE_ENV, "-1")
    assert workspace_cap(None) is None
    for bad in ("lots", "-5", "1.5"):      # only -1 means "no cap"; every error names the variable
        monkeypatch.setenv(WORKSPACE_ENV, bad)
        with pytest.raises(fa.ArgumentError, match=WORKSPACE_ENV):
            workspace_cap(None)
    monkeypatch.setenv(WORKSPACE_ENV, "")      # empty: unset
    assert workspace_cap(None) == 4 << 30
    monkeypatch.delenv(WORKSPACE_ENV)
    assert workspace_cap(None) == 4 << 30 and workspace_cap(77) == 77


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.integers(), st.sampled_from([-2, -1, 0, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70, -2 ** 63])))
def test_cap_from_environment_and_argument_agree(value):
    """One rule for `max_workspace_bytes` and the variable: a backward given either runs alike (same gradients,
    or the same WorkspaceError), or both are refused by name; never a raw error from the op's schema."""
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    out, lse, _ = fa.flash_attn_fwd(q, q, q, backend="reference")
    outcomes = []
    for given_as in ("argument", "environment"):
        with pytest.MonkeyPatch.context() as env:
            env.setenv(WORKSPACE_ENV, str(value))
            try:
                cap = value if given_as == "argument" else None
                outcomes.append(fa.flash_attn_bwd(q, q, q, q, out, lse, backend="reference", max_workspace_bytes=cap))
            except fa.WorkspaceError:
                outcomes.append("over the cap")
            except fa.ArgumentError as error:
                assert str(error).startswith("max_workspace_bytes" if given_as == "argument" else WORKSPACE_ENV)
                outcomes.append("refused")
    if isinstance(outcomes[0], str) or isinstance(outcomes[1], str):
        assert outcomes[0] == outcomes[1], (value, outcomes)
    else:
        assert all(torch.equal(a, b) for a, b in zip(*outcomes))


def _coverage(chunks, batch, heads_k, group, seqlen_q):
    """How many chunks cover each (sequence, kv head, query head in group, query row)."""
    count = torch.zeros(batch, heads_k, group, seqlen_q, dtype=torch.int32)
    for c in chunks:
        count[c.batch[0]:c.batch[1], c.kv_heads[0]:c.kv_heads[1], c.group_heads[0]:c.group_heads[1],
              c.rows[0]:c.rows[1]] += 1
    return count


def test_report_covers_every_backend():
    """backward_workspace plans every backend under the cap: each plan's chunks cover the call exactly
    once and its peak fits; the CK plan carries CK's deterministic dQ splits (ceil(s_k / kN0) fp32
    copies, kN0 = 128 at d128) and so must chunk, but never by query rows; the Triton plan (dQ pass when
    deterministic) needs only softmax_d and runs in one piece."""
    b, s, h, h_k, d, cap = 1, 16384, 64, 8, 128, 2 << 30
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(b, s, h_k, d, dtype=torch.bfloat16, device="meta")
    report = fa.backward_workspace(q, k, k, deterministic=True, max_workspace_bytes=cap)
    assert set(report) == {"reference", "ck", "triton"}
    for name, plan in report.items():
        assert torch.equal(_coverage(plan.chunks, b, h_k, h // h_k, s), torch.ones(b, h_k, h // h_k, s,
                                                                                   dtype=torch.int32)), name
        assert plan.peak_bytes <= cap, name
    reference = report["reference"]
    assert reference.unchunked_bytes > 60 << 30 and len(reference.chunks) > 1
    assert "dq_accum" in reference.describe()

    ck = report["ck"]
    splits = -(-s // 128)
    dq_accum = {buf.name: buf for buf in ck.per_chunk.buffers}["dq_accum"]
    assert dq_accum.shape[0] == splits and dq_accum.dtype == torch.float32
    assert ck.unchunked_bytes >= splits * b * s * h * d * 4 and len(ck.chunks) > 1
    assert all(c.rows == (0, s) for c in ck.chunks)

    triton = report["triton"]
    assert len(triton.chunks) == 1 and triton.unchunked_bytes == triton.peak_bytes == b * h * s * 4
    assert [buf.name for buf in triton.shared] == ["softmax_d"] and not triton.per_chunk.buffers


def test_chunk_partial_flag():
    q = torch.empty(1, 10, 4, 8, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 10, 2, 8, device="meta", dtype=torch.bfloat16)
    problem = describe_call(q, k, k, AttentionOptions())
    assert not Chunk((0, 1), (0, 1), (0, 2), (0, 10)).partial(problem)
    assert Chunk((0, 1), (0, 1), (0, 1), (0, 10)).partial(problem)
    assert Chunk((0, 1), (0, 1), (0, 2), (0, 5)).partial(problem)


class _BallastReference(ReferenceBackend):
    """The reference backward with a large extra buffer: a backend whose default setup needs more workspace
    than its leaner one (as the Triton backend's warp-specialised kernel with its fp32 dQ accumulator)."""
    ballast = 64 << 20
    ran = 0

    def backward_plan(self, problem):
        from dataclasses import replace

        from flash_attn_ck.core.plan import BufferSpec
        plan = super().backward_plan(problem)
        return replace(plan, buffers=(*plan.buffers, BufferSpec("ballast", (self.ballast,), torch.uint8, False,
                                                                "stand-in for a faster kernel's workspace")))

    def backward(self, *args, **kwargs):
        type(self).ran += 1
        return super().backward(*args, **kwargs)

    def leaner(self):
        return ReferenceBackend()


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2 ** 16), cap_mib=st.integers(1, 63))
def test_a_cap_below_the_default_setup_runs_the_leaner_one(seed, cap_mib):
    """When not even the smallest chunk of a backend's default setup fits the cap, the leaner setup runs (and
    gives the same gradients) instead of an error; the plan says so."""
    cfg = Config(batch=2, heads_q=4, heads_k=2, causal=True)
    problem, run = backward_once(cfg, seed=seed)
    with fa.use_backend(ReferenceBackend()):
        expected = run(-1)
    fat = _BallastReference()
    plan = plan_chunks(problem, fat, cap_mib << 20)
    assert plan.runner is not fat and "leaner setup runs" in plan.describe()
    assert plan.peak_bytes <= cap_mib << 20
    assert plan_chunks(problem, fat, 65 << 20).runner is fat    # the default setup where it fits
    _BallastReference.ran = 0
    with fa.use_backend(fat):
        got = run(cap_mib << 20)
    assert _BallastReference.ran == 0
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


class _OverBudget(Exception):
    pass


# Python events (calls, lines, returns) planning may take: its binary searches and the stage-2 search over
# halving row sizes x group-head slices cost O(G log s) chunk plans, some 2 * 10**5 events at G = 16, s = 2**24;
# a walk over the query rows costs at least two per row, over 4 * 10**6 from s = 2**21.
PLANNING_EVENTS = 10 ** 6


def _planning_work(problem, backend, cap) -> tuple[int, int]:
    """(Python events, peak bytes Python allocated) of planning `problem` from scratch: the events a trace
    function counts, stopping just past PLANNING_EVENTS, and tracemalloc's peak (which an O(s) structure built
    in C, without Python events, would show)."""
    events = 0

    def count(frame, event, arg):
        nonlocal events
        events += 1
        if events > PLANNING_EVENTS:
            raise _OverBudget
        return count
    previous = sys.gettrace()
    tracemalloc.start()
    sys.settrace(count)
    try:
        plan_chunks(problem, backend, cap)
    except (fa.WorkspaceError, _OverBudget):
        pass
    finally:
        sys.settrace(previous)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return events, peak


@settings(max_examples=30, deadline=None)
@given(log_s=st.integers(21, 24), heads=st.sampled_from([(32, 8), (8, 8), (16, 1)]), d=st.sampled_from([64, 256]),
       deterministic=st.booleans(), causal=st.booleans(), cap_fraction=st.sampled_from([None, 0.5, 0.01, 1e-4]),
       backend=st.sampled_from(["reference", "ck", "triton"]))
def test_planning_work_does_not_grow_with_the_sequence(log_s, heads, d, deterministic, causal, cap_fraction,
                                                       backend):
    """Planning a call of millions of tokens (meta tensors) never walks or builds its chunks or query-row ranges
    (row slices go down to one row): work is counted, not timed, as Python events (PLANNING_EVENTS) and the
    memory planning allocates, on every backend and under caps that force each chunking stage."""
    backend = backend_class(backend)()
    q = torch.empty(1, 2 ** log_s, heads[0], d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 2 ** log_s, heads[1], d, dtype=torch.bfloat16, device="meta")
    problem = describe_call(q, k, k, AttentionOptions(causal=causal, deterministic=deterministic))
    cap = None if cap_fraction is None else int(plan_chunks(problem, backend, None).peak_bytes * cap_fraction)
    events, peak = _planning_work(problem, backend, cap)
    assert events <= PLANNING_EVENTS and peak < 1 << 20, (events, peak)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), s_q=st.integers(0, 9), s_k=st.integers(0, 7), groups=st.sampled_from([(4, 2), (2, 2)]),
       cap_fraction=st.floats(0.05, 1.0), causal=st.booleans(), seed=st.integers(0, 100))
def test_a_capped_backward_equals_the_uncapped_one_with_empty_sides(b, s_q, s_k, groups, cap_fraction, causal, seed):
    """Any cap the planner accepts gives the uncapped gradients (fp64), also without keys or queries: the shared dK/dV
    partial sums are sized by batch entries, not by rows divided by s_k (0 rows of keys lost the batch dimension)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, groups[0], 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, s_k, groups[1], 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out, lse, _ = fa.flash_attn_fwd(q, k, v, causal=causal, backend="reference")
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    expected = fa.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, backend="reference")
    unchunked = plan_chunks(describe_call(q, k, v, AttentionOptions(causal=causal)), ReferenceBackend(), None)
    try:
        got = fa.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, backend="reference",
                                max_workspace_bytes=int(unchunked.peak_bytes * cap_fraction))
    except fa.WorkspaceError as error:
        assert "needs at least" in str(error)
        return
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=name)
