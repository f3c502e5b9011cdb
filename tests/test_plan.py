"""Workspace plans: the dq_accum split rule, expanded dK/dV for MQA/GQA, the group sum, padding."""

from __future__ import annotations

import pytest
import torch

import flash_attn_ck as fa
from flash_attn_ck.backends.ck.plan import CkBwdTile, ck_backward_plan, dq_accum_splits
from flash_attn_ck.backends.reference import ReferenceBackend
from flash_attn_ck.core.mask import MaskInfo
from flash_attn_ck.core.problem import AttentionProblem
from flash_attn_ck.pipeline.chunking import backward_plan


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
