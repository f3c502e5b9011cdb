"""The backward's workspace plan: CK's buffers (the dq_accum split rule, expanded dK/dV for MQA/GQA, the
group sum, padding), and the chunk planner under a cap: fast for any shape, and the chunking an exhaustive
search in the planner's order picks (small dense shapes). Chunked backwards against whole ones:
tests/core/test_chunking.py; planning times: scripts/lab/plan_time.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_attn_ck as fa
from flash_attn_ck.backends.ck.backend import CkBackend
from flash_attn_ck.backends.ck.plan import CkBwdTile, ck_backward_plan, dq_accum_splits
from flash_attn_ck.backends.reference import ReferenceBackend
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.mask import MaskInfo
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.core.problem import AttentionProblem
from flash_attn_ck.pipeline.chunking import _grid, _Planner, _row_sizes, backward_plan, plan_chunks


def problem(s_q=8192, s_k=8192, h=32, h_k=32, d=128, deterministic=False, batch=1, **kw):
    return AttentionProblem(batch=batch, seqlen_q=s_q, seqlen_k=s_k, heads_q=h, heads_k=h_k, head_dim=d,
                            dtype=torch.bfloat16, device=torch.device("cpu"),
                            mask=MaskInfo.from_flash_args(False, (-1, -1), s_q, s_k), softmax_scale=d ** -0.5,
                            deterministic=deterministic, **kw)


@pytest.mark.parametrize("d,kn0", [(8, 128), (64, 128), (128, 128), (136, 64), (256, 64)])
def test_key_tile_follows_head_dim(d, kn0):
    assert CkBwdTile.for_head_dim(d).kN0 == kn0


@pytest.mark.parametrize("s_k,d,deterministic,splits", [
    (8192, 128, False, 1), (8192, 128, True, 64), (8193, 128, True, 65), (1, 128, True, 1),
    (1000, 256, True, 16), (0, 64, True, 1)])
def test_split_rule(s_k, d, deterministic, splits):
    assert dq_accum_splits(problem(s_k=s_k, d=d, deterministic=deterministic)) == splits


def test_spec_example_deterministic_dq_accum_is_8_6_gb():
    plan = ck_backward_plan(problem(deterministic=True), "reference")
    dq_accum = next(b for b in plan.buffers if b.name == "dq_accum")
    assert dq_accum.shape == (64, 1, 8192, 32, 128) and dq_accum.dtype == torch.float32 and dq_accum.zero_init
    assert dq_accum.nbytes == 64 * 8192 * 32 * 128 * 4 == 8_589_934_592


def test_gqa_plan_has_expanded_buffers_and_reduce_flag():
    mha = ck_backward_plan(problem(h=32, h_k=32), "ck")
    gqa = ck_backward_plan(problem(h=32, h_k=8), "ck")
    assert {b.name for b in mha.buffers} == {"softmax_d", "dq_accum"} and not mha.reduce_expanded_kv
    expanded = {b.name: b for b in gqa.buffers if b.name.endswith("_expanded")}
    assert set(expanded) == {"dk_expanded", "dv_expanded"} and gqa.reduce_expanded_kv
    assert expanded["dk_expanded"].shape == (1, 8192, 32, 128) and expanded["dk_expanded"].dtype == torch.bfloat16


def test_varlen_plan_layouts():
    plan = ck_backward_plan(problem(s_q=100, s_k=300, varlen=True, total_q=250, total_k=700, batch=3,
                                    h=4, h_k=2, deterministic=True), "ck")
    shapes = {b.name: b.shape for b in plan.buffers}
    assert shapes["softmax_d"] == (4, 250)
    assert shapes["dq_accum"] == (3, 250, 4, 128)      # splits from max_seqlen_k = 300
    assert shapes["dk_expanded"] == (700, 4, 128)


def test_padding_buffers_are_planned_for_odd_head_dims():
    plan = backward_plan(ReferenceBackend(), problem(s_q=4, s_k=4, h=2, h_k=2, d=59))
    padded = {b.name: b.shape for b in plan.buffers if b.name.endswith("_padded")}
    assert padded["q_padded"] == (1, 4, 2, 64) and len(padded) == 8


def test_describe_lists_every_buffer_with_bytes():
    text = ck_backward_plan(problem(h=32, h_k=8, deterministic=True), "ck").describe()
    for name in ("softmax_d", "dq_accum", "dk_expanded", "dv_expanded"):
        assert name in text
    assert "8.0 GiB" in text


def test_gqa_sum_of_expanded_buffers_equals_per_group_sum():
    """The pipeline's reduce step: dK equals the sum over each group's query-head contributions."""
    torch.manual_seed(0)
    q = torch.randn(1, 6, 6, 16, dtype=torch.float64)
    k = torch.randn(1, 9, 2, 16, dtype=torch.float64)
    v = torch.randn(1, 9, 2, 16, dtype=torch.float64)
    out, lse, _ = fa.flash_attn_fwd(q, k, v)
    dout = torch.randn_like(out)
    _, dk, dv, _ = fa.flash_attn_bwd(dout, q, k, v, out, lse)
    # Expanding K/V to MHA gives per-query-head gradients; summing groups of 3 must match.
    k_exp, v_exp = k.repeat_interleave(3, 2), v.repeat_interleave(3, 2)
    out_exp, lse_exp, _ = fa.flash_attn_fwd(q, k_exp, v_exp)
    _, dk_exp, dv_exp, _ = fa.flash_attn_bwd(dout, q, k_exp, v_exp, out_exp, lse_exp)
    assert torch.allclose(dk, dk_exp.unflatten(2, (2, 3)).sum(3), atol=1e-12)
    assert torch.allclose(dv, dv_exp.unflatten(2, (2, 3)).sum(3), atol=1e-12)


# ---- the chunk planner under a workspace cap ------------------------------------------------------

def meta_problem(b, s, h, h_k, d=128, deterministic=True, causal=True):
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
    p = meta_problem(b, s, *heads, d, deterministic)
    backend = CkBackend() if ck else ReferenceBackend()
    cap = int(plan_chunks(p, backend, None).peak_bytes * fraction)
    expected = _exhaustive(p, backend, cap)
    try:
        plan = plan_chunks(p, backend, cap)
    except fa.WorkspaceError:
        assert expected is None
        return
    assert plan.peak_bytes <= cap and plan.chunks == expected and _covers_once(plan, p)


# Long-context shapes: b up to 8, s up to 32768, h=32/8 and 64/1, d=128, deterministic, causal, caps down to 1 MiB.
GRID = [(b, s, h, h_k, cap) for b in (1, 2, 8) for s in (1024, 8192, 32768) for h, h_k in ((32, 8), (64, 1))
        for cap in (1 << 20, 4 << 20, 64 << 20, 1 << 30)]


@pytest.mark.parametrize("b, s, h, h_k, cap", GRID)
def test_planning_finishes_on_large_shapes(b, s, h, h_k, cap):
    p = meta_problem(b, s, h, h_k)
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
