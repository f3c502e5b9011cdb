"""A value head dim of its own: q, k with head dim d, v (and out, dout, dv) with d_v, any d, d_v <= 256.

Against the float64 oracle on the reference backend and the emulated CK backend (tests/ck_emulator.py; hypothesis
over shapes, masks, GQA and varlen); CK's head-dim buckets as the backend's refusal; which Triton kernels run it
(the one-launch kernels themselves: tests/triton/test_triton_interpret.py); bad input (d_v > 256, out's or dout's head
dim not v's) refused naming the argument before anything is written; the ops' fakes, torch.compile (fullgraph),
chunked backwards and the workspace plan with d_v != d."""

from __future__ import annotations

import pytest
import torch
from ck_emulator import FULL_BWD_HEAD_DIMS, FULL_FWD_HEAD_DIMS
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ck_emulated import emulated
from test_edge_cases import SETTINGS

import flash_attn_ck as fa
from cases import check_case, make_inputs
from flash_attn_ck.core.errors import ArgumentError
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.mask import MaskInfo
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.core.problem import AttentionProblem
from flash_attn_ck.ops import _FWD, _flatten
from flash_attn_ck.pipeline.select import select_backend
from oracle import Config

BASE = dict(batch=2, seqlen_q=37, seqlen_k=53, heads_q=4, heads_k=2)
# (d, d_v) and features: the MLA pair, d_v wider than d, and head dims that are not multiples of 8 (padded apart).
CASES = {
    "mla_192_128_causal": dict(head_dim=192, head_dim_v=128, causal=True),
    "d_v_wider_gqa": dict(head_dim=32, head_dim_v=96, heads_q=6, heads_k=2),
    "d_v_13_window": dict(head_dim=40, head_dim_v=13, window=(9, 4)),
    "d_27_d_v_64_alibi": dict(head_dim=27, head_dim_v=64, alibi=True, causal=True),
    "softcap_mqa": dict(head_dim=64, head_dim_v=24, softcap=5.0, heads_q=4, heads_k=1),
    "dropout_deterministic": dict(head_dim=48, head_dim_v=80, dropout_p=0.2, deterministic=True),
    "sink": dict(head_dim=16, head_dim_v=40, sink_dtype=torch.float32),
    "d_v_256": dict(head_dim=8, head_dim_v=256, seqlen_q=9, seqlen_k=11),
    "varlen_empty_sequences": dict(head_dim=72, head_dim_v=20,
                                   seqlens=[(12, 30), (0, 17), (21, 0), (0, 0), (40, 41)], causal=True),
    "varlen_d_v_not_multiple_of_8": dict(head_dim=64, head_dim_v=59, seqlens=[(5, 9), (17, 3), (30, 30)],
                                         deterministic=True),
}
# What the emulation does not run: softcap (CK refuses it) and dropout patterns other than the reference's.
CK_CASES = sorted(name for name in CASES if "softcap" not in name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_the_float64_oracle(name):
    out, (dq, dk, dv) = check_case(Config(**{**BASE, **CASES[name]}))
    cfg = Config(**{**BASE, **CASES[name]})
    assert out.shape[-1] == dv.shape[-1] == cfg.value_head_dim and dq.shape[-1] == dk.shape[-1] == cfg.head_dim


@pytest.mark.parametrize("name", CK_CASES)
def test_emulated_ck_matches_the_float64_oracle(name):
    backend = emulated()
    check_case(Config(**{**BASE, **CASES[name]}), backend=backend)
    assert [kind for kind, _ in backend.library.launches[-3:]] == ["dot_do_o", "dq_dk_dv", "convert_dq"]


HEAD_DIMS = st.integers(1, 256)


@st.composite
def shapes(draw):
    """Random (d, d_v), heads (MHA/GQA/MQA), lengths (dense, or varlen with empty sequences) and a mask."""
    heads_k = draw(st.integers(1, 3))
    config = dict(head_dim=draw(HEAD_DIMS), head_dim_v=draw(HEAD_DIMS), heads_k=heads_k,
                  heads_q=heads_k * draw(st.integers(1, 3)), dtype=draw(st.sampled_from([torch.bfloat16,
                                                                                       torch.float16])))
    mask = draw(st.sampled_from(["none", "causal", "window"]))
    config.update(causal=mask == "causal", window=(draw(st.integers(0, 12)), draw(st.integers(0, 6)))
                  if mask == "window" else (-1, -1))
    if draw(st.booleans()):
        config["seqlens"] = draw(st.lists(st.tuples(st.integers(0, 24), st.integers(0, 24)), min_size=1, max_size=3))
    else:
        config.update(batch=draw(st.integers(1, 2)), seqlen_q=draw(st.integers(1, 24)),
                      seqlen_k=draw(st.integers(1, 24)))
    return Config(**config)


@settings(max_examples=25, **SETTINGS)
@given(cfg=shapes(), seed=st.integers(0, 2 ** 16))
def test_hypothesis_reference(cfg, seed):
    check_case(cfg, seed=seed)


@settings(max_examples=25, **SETTINGS)
@given(cfg=shapes(), seed=st.integers(0, 2 ** 16))
def test_hypothesis_emulated_ck(cfg, seed):
    check_case(cfg, backend=emulated(), seed=seed)


# ---- CK's head-dim buckets ----------------------------------------------------------------------------

def _problem(head_dim, head_dim_v, device="cpu", heads=(2, 2)):
    return AttentionProblem(batch=1, seqlen_q=8, seqlen_k=8, heads_q=heads[0], heads_k=heads[1], head_dim=head_dim,
                            head_dim_v=head_dim_v, dtype=torch.bfloat16, device=torch.device(device),
                            mask=MaskInfo.from_flash_args(False, (-1, -1), 8, 8), softmax_scale=0.1)


# The CI compile check's instance set (scripts/ck_generate.py --minimal): its generated fack_*_head_dims.
MINIMAL = (b"128x128,256x256", b"96x96,128x128")


@pytest.mark.parametrize(("head_dim", "head_dim_v", "missing"), [
    (192, 128, ["backward"]), (96, 96, []), (100, 60, []), (64, 200, ["backward"]), (130, 130, ["backward"])])
def test_ck_refuses_head_dims_its_instances_lack_in_words(head_dim, head_dim_v, missing):
    """The library reports its instances' (hdim_q, hdim_v) buckets; a call none holds is refused before any
    launch, naming the direction and the buckets, and the dispatcher runs another backend."""
    backend = emulated(head_dims=MINIMAL)
    reasons = type(backend).not_supported_reasons(_problem(head_dim, head_dim_v))
    listed = {"forward": "128x128, 256x256", "backward": "96x96, 128x128"}
    padded = f"d={-(-head_dim // 8) * 8}, d_v={-(-head_dim_v // 8) * 8}"
    assert [r for r in reasons if "no forward instance" in r or "no backward instance" in r] == \
        [f"head dims {padded} (padded): the CK library has no {direction} instance for them "
         f"(its {direction} buckets, hdim_q x hdim_v: {listed[direction]})" for direction in missing]


def test_the_full_instance_set_holds_every_pair():
    """scripts/ck_generate.py's full set: CK's gfx9 buckets hold every (d, d_v) <= 256, the MLA pair by its own
    d192/dv128 forward tile."""
    backend = emulated()
    for head_dim in range(8, 257, 8):
        for head_dim_v in range(8, 257, 8):
            assert not type(backend).not_supported_reasons(_problem(head_dim, head_dim_v))
    assert b"192x128" in FULL_FWD_HEAD_DIMS and b"256x256" in FULL_BWD_HEAD_DIMS


def test_a_refused_ck_call_runs_elsewhere_or_says_why():
    q, k, v = torch.randn(1, 5, 2, 192), torch.randn(1, 6, 2, 192), torch.randn(1, 6, 2, 128)
    backend = emulated(head_dims=MINIMAL)
    with pytest.raises(fa.NoBackendError, match=r"no backward instance for them"):
        fa.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend=backend)
    problem = describe_call(q, k, v, AttentionOptions())
    assert select_backend(problem).name == "reference"


# ---- the Triton backend: which kernels run d_v != d ---------------------------------------------------------

def test_triton_runs_d_v_on_the_one_launch_kernels_and_says_why_not_the_others():
    """The one-launch kernels take v's head dim (tests/triton/test_triton_interpret.py runs them); the warp-specialised
    kernels refuse a wider v, each saying why; they run a narrower one (fwd_ws at its own head dim, the backward padded
    to q/k's) by default only in the head blocks of their narrower_value_head_blocks (tests/triton/test_triton_ws.py,
    test_triton_fwd_ws.py), saying so elsewhere; the GQA accumulator epilogue (one row width) says why it does not
    run such a call."""
    from flash_attn_ck.backends.triton import TritonBackend, config
    from flash_attn_ck.backends.triton.operators import BACKWARD, FORWARD, GluonOperator
    assert not any("head dim" in r for r in TritonBackend.not_supported_reasons(_problem(192, 128, "cuda")))
    backend = TritonBackend(gqa_epilogue="accumulate")
    narrower, wider = _problem(192, 128), _problem(128, 192)  # (on the CPU: the Gluon reasons ask no GPU anything)
    for operator in FORWARD + BACKWARD:
        below = [r for r in backend.reasons(narrower, operator) if r.startswith("value head dim")]
        above = [r for r in backend.reasons(wider, operator) if r.startswith("value head dim")]
        assert not [r for r in backend.reasons(_problem(192, 192), operator) if r.startswith("value head dim")]
        if not issubclass(operator, GluonOperator):
            assert below == above == [], operator.name
            continue
        assert above == [f"value head dim 192 above q/k's 128: {operator.wider_value_refusal}"], operator.name
        runs_by_default = config.head_block(192) in operator.narrower_value_head_blocks
        assert len(below) == (0 if runs_by_default else 1), (operator.name, below)
        assert all(r.startswith("value head dim 128 below q/k's 192: not measured faster") for r in below)
    assert not backend.accumulate_kv(_problem(192, 128, heads=(4, 2)))
    assert backend.accumulate_kv(_problem(192, 190, heads=(4, 2)))     # padded alike: one kernel head dim


# ---- bad input ------------------------------------------------------------------------------------------

@st.composite
def bad_value_head_dims(draw):
    """(entry, which operand is wrong, its head dim): v wider than 256 or empty; out or dout (and a given dv)
    with a head dim other than v's."""
    entry = draw(st.sampled_from(["func", "fwd_out", "varlen", "bwd", "bwd_dv"]))
    head_dim_v = draw(st.integers(1, 24))
    if entry in ("func", "varlen"):
        return entry, "v", draw(st.sampled_from([0, 257, 300]))
    wrong = draw(st.integers(1, 24).filter(lambda n: n != head_dim_v))
    return entry, {"fwd_out": "out", "bwd": draw(st.sampled_from(["out", "dout"])), "bwd_dv": "dv"}[entry], \
        (head_dim_v, wrong)


@settings(max_examples=40, deadline=None)
@given(case=bad_value_head_dims(), head_dim=st.integers(1, 24))
def test_a_bad_value_head_dim_is_refused_naming_the_argument_before_anything_is_written(case, head_dim):
    entry, name, dims = case
    q, k = torch.randn(1, 5, 4, head_dim), torch.randn(1, 6, 2, head_dim)
    if name == "v":
        v = torch.randn(1, 6, 2, dims)
        cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
        call = (lambda: fa.flash_attn_func(q, k, v, backend="reference")) if entry == "func" else \
            (lambda: fa.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 5, 6, backend="reference"))
        with pytest.raises(ArgumentError, match=r"^v: value head dim \(its last dimension\) must be in 1\.\.256"):
            call()
        return
    head_dim_v, wrong = dims
    v = torch.randn(1, 6, 2, head_dim_v)
    right = torch.full((1, 5, 4, head_dim_v), 7.0)
    bad = torch.full((1, 5, 4, wrong), 7.0)
    dq, dk = torch.full_like(q, 7.0), torch.full_like(k, 7.0)
    dv = torch.full((1, 6, 2, wrong if name == "dv" else head_dim_v), 7.0)
    expected = rf"^{name}: expected v's head dim {head_dim_v} in its last dimension" if name != "dv" else \
        rf"^dv: expected shape \(1, 6, 2, {head_dim_v}\)"
    out, dout = (bad, right) if name == "out" else (right, bad) if name == "dout" else (right, right)
    call = (lambda: fa.flash_attn_fwd(q, k, v, out=bad, backend="reference")) if entry == "fwd_out" else \
        (lambda: fa.flash_attn_bwd(dout, q, k, v, out, torch.zeros(1, 4, 5), dq, dk, dv, backend="reference"))
    with pytest.raises(ArgumentError, match=expected):
        call()
    for t in (bad, right, dq, dk, dv):
        assert (t == 7).all(), "written before the error"


def test_a_v_whose_rows_or_heads_are_not_ks_is_refused():
    q, k = torch.randn(1, 5, 4, 16), torch.randn(1, 6, 2, 16)
    for v in (torch.randn(1, 7, 2, 8), torch.randn(1, 6, 4, 8)):
        with pytest.raises(ArgumentError, match=r"^v: expected shape \(1, 6, 2, 8\)"):
            fa.flash_attn_func(q, k, v, backend="reference")


# ---- ops, fakes, compile ---------------------------------------------------------------------------------

def test_fwd_op_opcheck_with_d_v():
    from torch.library import opcheck
    q, k, v = torch.randn(2, 5, 4, 24), torch.randn(2, 6, 2, 24), torch.randn(2, 6, 2, 13)
    options = AttentionOptions(causal=True, backend="reference")
    results = opcheck(torch.ops.flash_attn_ck.fwd.default, (q, k, v, *_flatten(options, _FWD)),
                      raise_exception=False)
    assert all(result == "SUCCESS" for result in results.values()), results


def test_fakes_have_the_real_shapes_and_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = torch.randn(2, 5, 4, 24), torch.randn(2, 6, 2, 24), torch.randn(2, 6, 2, 13)
    options = AttentionOptions(backend="reference")
    real = torch.ops.flash_attn_ck.fwd(q, k, v, *_flatten(options, _FWD))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.flash_attn_ck.fwd(*(mode.from_tensor(t) for t in (q, k, v)), *_flatten(options, _FWD))
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    assert real[0].shape == (2, 5, 4, 13)


@pytest.mark.parametrize("varlen", [False, True])
def test_compile_fullgraph_with_d_v(varlen):
    """One graph (fullgraph) through the fwd op's fake and the Function's backward with d = 24, d_v = 13;
    compiled and eager agree, and out and dv have v's head dim."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 9, 4, 24, generator=gen), torch.randn(2, 9, 2, 24, generator=gen), \
        torch.randn(2, 9, 2, 13, generator=gen)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)

    def attention(q, k, v):
        if varlen:
            return fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 9, 9,
                                             causal=True, backend="reference")
        return fa.flash_attn_func(q, k, v, causal=True, backend="reference")

    def run(fn):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        return out.detach(), [t.grad for t in inputs]

    torch._dynamo.reset()
    eager, compiled = run(attention), run(torch.compile(attention, fullgraph=True, backend="aot_eager"))
    assert compiled[0].shape[-1] == 13 and compiled[1][2].shape == v.shape
    torch.testing.assert_close(compiled[0], eager[0])
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b)


# ---- workspace: plans and chunks ------------------------------------------------------------------------

def test_the_workspace_plan_sizes_v_side_buffers_with_d_v():
    q, k, v = (torch.empty(2, 100, heads, dim, device="meta")
               for heads, dim in ((8, 192), (2, 192), (2, 59)))
    plan = fa.backward_workspace(q, k, v, deterministic=True, backends=("reference",))["reference"].per_chunk
    shapes = {b.name: b.shape for b in plan.buffers}
    assert shapes["dq_accum"][-1] == shapes["dk_expanded"][-1] == 192       # q's d, a multiple of 8 already
    assert shapes["dv_expanded"][-1] == 64                                  # v's d_v = 59, padded
    assert {name for name in shapes if name.endswith("_padded")} == {"v_padded", "out_padded", "dout_padded",
                                                                       "dv_padded"}
    assert all(shapes[name][-1] == 64 for name in shapes if name.endswith("_padded"))
    assert shapes["dq_accum"][0] == 2        # deterministic: one split per key tile of 64 rows (bucket 256)


def test_flops_count_d_v():
    problem = describe_call(torch.empty(1, 10, 2, 192, device="meta"), torch.empty(1, 10, 2, 192, device="meta"),
                            torch.empty(1, 10, 2, 128, device="meta"), AttentionOptions())
    assert problem.forward_flops() == 2 * 2 * 10 * 10 * (192 + 128)
    assert problem.backward_flops() == 2 * 2 * 10 * 10 * (3 * 192 + 2 * 128)
    same = describe_call(torch.empty(1, 10, 2, 64, device="meta"), torch.empty(1, 10, 2, 64, device="meta"),
                         torch.empty(1, 10, 2, 64, device="meta"), AttentionOptions(causal=True))
    assert same.forward_flops() == 4 * 2 * 10 * 10 * 64 / 2 and same.backward_flops() == 2.5 * same.forward_flops()


@pytest.mark.parametrize("backend", ["reference", "ck"])
@pytest.mark.parametrize("varlen", [False, True])
def test_chunked_backward_is_bit_identical(backend, varlen):
    """A cap below the call's workspace splits it into batch / KV-group / head-slice chunks (dK/dV partial sums of
    a split group, each with its own head dim): the gradients equal the unchunked call's bit for bit."""
    cfg = Config(**{**BASE, "heads_q": 6, "heads_k": 2, "head_dim": 40, "head_dim_v": 20, "deterministic": True,
                    "dtype": torch.float16}, seqlens=[(30, 41), (0, 9), (25, 52)] if varlen else None)
    q, k, v, dout, _ = make_inputs(cfg)
    run = emulated() if backend == "ck" else backend
    extra = {}
    if varlen:
        cu_q = torch.tensor([0, 30, 30, 55], dtype=torch.int32)
        cu_k = torch.tensor([0, 41, 50, 102], dtype=torch.int32)
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=30, max_seqlen_k=52)
    out, lse, _ = fa.flash_attn_fwd(q, k, v, **extra, deterministic=True, backend=run)
    whole = fa.flash_attn_bwd(dout, q, k, v, out, lse, **extra, deterministic=True, backend=run)
    plan = fa.backward_workspace(q, k, v, **extra, deterministic=True, max_workspace_bytes=-1,
                                 backends=("reference",))["reference"]
    cap = plan.peak_bytes // 4
    chunked = fa.flash_attn_bwd(dout, q, k, v, out, lse, **extra, deterministic=True, backend=run,
                                max_workspace_bytes=cap)
    chunks = fa.backward_workspace(q, k, v, **extra, deterministic=True, max_workspace_bytes=cap,
                                   backends=("reference",))["reference"].chunks
    assert len(chunks) > 1
    for a, b in zip(whole[:3], chunked[:3]):
        assert torch.equal(a, b)
    assert chunked[2].shape == v.shape


def test_packed_variants_keep_one_head_dim():
    """qkv / kv packed in one tensor carry one head dim: their v is a slot of it, so d_v = d there."""
    qkv = torch.randn(2, 7, 3, 2, 16, requires_grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, backend="reference")
    assert out.shape == (2, 7, 2, 16)
