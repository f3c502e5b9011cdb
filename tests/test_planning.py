"""Issue 16 item 15: planning the backward's chunks is fast for any shape and cap, and fails fast.

The test asserts only that planning finishes and that its answer is right: the chunks tile the call once,
the peak fits the cap, and (small dense shapes) the chunking is the one an exhaustive search in the
planner's order picks. `scripts/plan_time.py` reports the times."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_attn_ck as fa
from flash_attn_ck.backends.ck.backend import CkBackend
from flash_attn_ck.backends.reference import ReferenceBackend
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.pipeline.chunking import _grid, _Planner, _row_sizes, plan_chunks


def _problem(b, s, h, h_k, d=128, deterministic=True, causal=True):
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(b, s, h_k, d, dtype=torch.bfloat16, device="meta")
    return describe_call(q, k, k, AttentionOptions(causal=causal, deterministic=deterministic))


def _exhaustive(problem, backend, cap):
    """The first fitting chunking in the planner's preference order, by trying every one."""
    p = problem
    planner = _Planner(p, backend, cap)
    whole = planner.cost(_grid(p, p.batch, p.heads_k, p.group_size, p.seqlen_q))
    if whole.peak_bytes <= cap:
        return whole.chunks
    sizes = sorted(itertools.product(range(1, p.batch + 1), range(1, p.heads_k + 1)),
                   key=lambda s: (s[0] * s[1], s[1]), reverse=True)
    candidates = [(nb, ng, p.group_size, p.seqlen_q) for nb, ng in sizes]
    candidates += [(1, 1, heads, rows) for rows in _row_sizes(p, backend) for heads in range(p.group_size, 0, -1)
                   if (rows, heads) != (p.seqlen_q, p.group_size)]
    for c in candidates:
        plan = planner.cost(_grid(p, *c))
        if plan.peak_bytes <= cap:
            return plan.chunks
    return None


def _covers_once(plan, p):
    count = torch.zeros(p.batch, p.heads_k, p.group_size, p.seqlen_q, dtype=torch.int32)
    for c in plan.chunks:
        count[c.batch[0]:c.batch[1], c.kv_heads[0]:c.kv_heads[1], c.group_heads[0]:c.group_heads[1],
              c.rows[0]:c.rows[1]] += 1
    return bool((count == 1).all())


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 4), s=st.integers(1, 200), heads=st.sampled_from([(4, 4), (4, 2), (8, 1), (6, 3)]),
       d=st.sampled_from([32, 128, 256]), deterministic=st.booleans(), fraction=st.floats(0.0005, 1.0),
       ck=st.booleans())
def test_plan_matches_exhaustive_search(b, s, heads, d, deterministic, fraction, ck):
    p = _problem(b, s, *heads, d, deterministic)
    backend = CkBackend() if ck else ReferenceBackend()
    cap = int(plan_chunks(p, backend, None).peak_bytes * fraction)
    expected = _exhaustive(p, backend, cap)
    try:
        plan = plan_chunks(p, backend, cap)
    except fa.WorkspaceError:
        assert expected is None
        return
    assert plan.peak_bytes <= cap and plan.chunks == expected and _covers_once(plan, p)


# The instances and larger: b=2/8, s=8192, h=32/8, d=128, deterministic, causal, caps down to 4 MiB.
GRID = [(b, s, h, h_k, cap) for b in (1, 2, 8) for s in (1024, 8192, 32768) for h, h_k in ((32, 8), (64, 1))
        for cap in (1 << 20, 4 << 20, 64 << 20, 1 << 30)]


@pytest.mark.parametrize("b, s, h, h_k, cap", GRID)
def test_planning_finishes_on_large_shapes(b, s, h, h_k, cap):
    p = _problem(b, s, h, h_k)
    for backend in (ReferenceBackend(), CkBackend()):
        try:
            plan = plan_chunks(p, backend, cap)
        except fa.WorkspaceError as error:
            assert "needs at least" in str(error) or "cannot" in str(error)
            continue
        assert plan.peak_bytes <= cap
        first, last = plan.chunks[0], plan.chunks[-1]
        assert first.batch[0] == first.kv_heads[0] == first.group_heads[0] == first.rows[0] == 0
        assert (last.batch[1], last.kv_heads[1], last.group_heads[1], last.rows[1]) == \
            (p.batch, p.heads_k, p.group_size, p.seqlen_q)
