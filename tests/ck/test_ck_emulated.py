"""backend="ck" end to end on CPU tensors, through a CPU emulation of CK's kernels behind the C ABI
(tests/ck_emulator.py), against the float64 oracle under the 2x rule.

What runs: the whole frontend (validation, plan, chunks, padding, the GQA group sum), the CK backend's
argument builders and launch code, and the emulator executing CK's kernel contract from the very
`fack_*` structs the backend built, reading and writing only through their pointers and strides
(every access bounds-checked against the registered allocations). Everything the backend is handed
as an output (out, lse, dq, dk, dv, the expanded dK/dV, D) is poisoned with NaN first, so a row CK
leaves unwritten shows. Nothing here ran on an AMD GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from unittest import mock

import pytest
import torch
from ck_emulator import EmulatedCkLibrary, Memory, OutOfBounds, TrackAllocations
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_edge_cases import EMPTY_SEQUENCE_LAYOUTS, SETTINGS, check_rows_outside_sequences
from test_seqused_k import check_seqused_k, seqused_layouts

import flash_attn_ck as fa
from cases import check_case, check_mask_kind, make_inputs, mask_kind_grid
from flash_attn_ck.backends.ck import backend as ck
from flash_attn_ck.backends.ck.backend import CkBackend, CkError
from flash_attn_ck.backends.ck.plan import ck_backward_plan
from flash_attn_ck.backends.reference import ReferenceBackend
from flash_attn_ck.core import checks
from flash_attn_ck.core.errors import ArgumentError
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.options import AttentionOptions
from oracle import Config


def _fields(params):
    return [getattr(params, f.name) for f in dataclasses.fields(params)]


class PoisonedCk(CkBackend):
    """The CK backend with its outputs poisoned before each launch and its tensors registered."""
    memory: Memory

    def _register(self, *tensors, workspace=None):
        for t in (*tensors, *(workspace or {}).values()):
            self.memory.register(t)

    def forward(self, problem, params, out, lse):
        self._register(*_fields(params), out, lse)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        with TrackAllocations(self.memory):
            super().forward(problem, params, out, lse)

    def backward(self, problem, params, out, lse, dout, dq, dk, dv, workspace):
        self._register(*_fields(params), out, lse, dout, dq, dk, dv, workspace=workspace)
        for name in ("dk_expanded", "dv_expanded", "softmax_d"):
            if name in workspace:
                workspace[name].fill_(float("nan"))
        for t in (dq, dk, dv):
            t.fill_(float("nan"))
        with TrackAllocations(self.memory):
            super().backward(problem, params, out, lse, dout, dq, dk, dv, workspace)


def _dq_accum(plan):
    return next(b for b in plan.buffers if b.name == "dq_accum")


def emulated(**kwargs) -> PoisonedCk:
    memory = Memory()
    library = EmulatedCkLibrary(memory, **kwargs)
    backend = PoisonedCk.on_library(library, {"cpu"}, lambda device: "gfx942")
    backend.memory = memory
    backend.library = library
    return backend


# ---- the feature grid ----------------------------------------------------------------------------

BASE = dict(batch=2, seqlen_q=77, seqlen_k=141, heads_q=4, heads_k=2, head_dim=64)
DENSE = {
    "mha": dict(heads_q=3, heads_k=3),
    "gqa": {},
    "mqa_causal": dict(heads_q=4, heads_k=1, causal=True),
    "window": dict(window=(32, 8)),
    "window_left_only": dict(window=(17, -1)),
    "sq_gt_sk_causal": dict(seqlen_q=150, seqlen_k=70, causal=True),
    "sq_1": dict(seqlen_q=1, causal=True),
    "alibi_causal": dict(alibi=True, causal=True),
    "padded_d59": dict(head_dim=59, causal=True),
    "padded_d72_fp16": dict(head_dim=72, dtype=torch.float16),
    "d160_kn0_64": dict(head_dim=160, deterministic=True),
    "deterministic_window": dict(deterministic=True, window=(40, 3)),
    "dropout": dict(dropout_p=0.2),
    "dropout_gqa_causal_deterministic": dict(dropout_p=0.15, causal=True, deterministic=True),
}
VARLEN = {
    "empty_sequences": dict(seqlens=[(30, 50), (0, 37), (21, 0), (0, 0), (64, 129)]),
    "empty_causal_deterministic": dict(seqlens=[(0, 37), (45, 20), (17, 140)], causal=True, deterministic=True),
    "mha_window": dict(seqlens=[(33, 47), (0, 9), (80, 80)], heads_q=2, heads_k=2, window=(10, 10)),
    "mqa_alibi": dict(seqlens=[(5, 200), (0, 130), (90, 3)], heads_q=4, heads_k=1, alibi=True),
    "alibi_causal": dict(seqlens=[(40, 90), (0, 12), (70, 30), (150, 160)], alibi=True, causal=True),
    "padded_d40_causal": dict(seqlens=[(12, 30), (0, 31), (40, 8)], head_dim=40, causal=True),
    "dropout": dict(seqlens=[(20, 33), (0, 12), (31, 7)], dropout_p=0.1),
}


@pytest.mark.parametrize("name", sorted(DENSE))
def test_dense_grid(name):
    backend = emulated()
    check_case(Config(**{**BASE, **DENSE[name]}), backend=backend)
    assert [kind for kind, _ in backend.library.launches[-3:]] == ["dot_do_o", "dq_dk_dv", "convert_dq"]


@pytest.mark.parametrize("name", sorted(VARLEN))
def test_varlen_grid(name):
    check_case(Config(**{**BASE, **VARLEN[name]}), backend=emulated())


@pytest.mark.parametrize("kind,seqlens", mask_kind_grid(CkBackend.mask_kinds))
def test_every_declared_mask_kind_matches_the_oracle(kind, seqlens):
    """Each mask kind the CK backend declares, as the emulated kernels read it from mask_type/left/right."""
    for alibi in (False, True):
        check_mask_kind(emulated(), kind, seqlens, alibi=alibi)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("window", [(-1, 0), (25, 0), (-1, 6)], ids=["causal", "left", "right"])
def test_alibi_lse_is_the_bottom_right_forms_so_backends_mix(varlen, window):
    """ck_tile applies ALiBi to a mask it reads as causal (left side unbounded, right side 0) from the first key,
    +slope * j (the emulator follows it): the same probabilities, lse moved by slope * (i + s_k - s_q). The
    backend sends such a mask as a window reaching past the first key, so CK's lse is the reference's, the
    reference's lse drives CK's backward to the reference's gradients, and the probabilities made from CK's lse
    sum to 1."""
    lengths = [(40, 90), (70, 30), (150, 160)]
    q, k, v, dout, slopes = make_inputs(Config(seqlens=lengths if varlen else None, batch=3, seqlen_q=70,
                                               seqlen_k=50, heads_q=4, heads_k=2, head_dim=32, alibi=True))
    options = dict(causal=window == (-1, 0), window_size=window, alibi_slopes=slopes)
    if varlen:
        cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(side)], dtype=torch.int32) for side in zip(*lengths))
        options.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=150, max_seqlen_k=160)
    out, lse, _ = fa.flash_attn_fwd(q, k, v, backend="reference", **options)
    ck_out, ck_lse, _ = fa.flash_attn_fwd(q, k, v, backend=emulated(), **options)
    finite = torch.isfinite(lse)
    assert torch.equal(torch.isfinite(ck_lse), finite)
    assert torch.allclose(ck_lse[finite], lse[finite], atol=2e-3, rtol=1e-4), (ck_lse - lse)[finite].abs().max()
    expected = fa.flash_attn_bwd(dout, q, k, v, out, lse, backend="reference", **options)[:3]
    got = fa.flash_attn_bwd(dout, q, k, v, out, lse, backend=emulated(), **options)[:3]
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        scale = e.float().abs().max().item()
        assert (g.float() - e.float()).abs().max().item() <= 0.02 * scale, name
    if not varlen:
        probs = fa.flash_attn_func(q, k, v, return_attn_probs=True, backend=emulated(),
                                   **{n: options[n] for n in ("causal", "window_size", "alibi_slopes")})[2]
        sums = probs.float().sum(-1)
        assert torch.allclose(sums[sums > 0], torch.ones(()), atol=1e-2)


@settings(max_examples=30, **SETTINGS)
@given(**EMPTY_SEQUENCE_LAYOUTS, cap_fraction=st.sampled_from([None, 0.5, 0.3]))
# The adversarial round's instances: every sequence query-empty with max_seqlen_q = 0 and rows after the last
# (a zero grid); a query-empty sequence's GQA head-slice chunk under a cap (a NULL dout).
@example(lengths=[(0, 3), (0, 2)], extra_q=2, extra_k=1, heads=(2, 2), causal=False, exact_max=True,
         cap_fraction=None)
@example(lengths=[(0, 9), (6, 9)], extra_q=0, extra_k=0, heads=(3, 1), causal=False, exact_max=False,
         cap_fraction=0.5)
def test_varlen_layouts_with_empty_sequences(lengths, extra_q, extra_k, heads, causal, exact_max, cap_fraction):
    # Whole calls and chunks under a cap: a side with no rows launches nothing (an empty grid is an invalid
    # launch; a chunk of query-empty sequences would hand CK NULL q/dout pointers), and every output is written.
    check_rows_outside_sequences(emulated(), torch.float16, lengths, extra_q, extra_k, heads, causal, exact_max,
                                 cap_fraction)


@settings(max_examples=25, **SETTINGS)
@given(layout=seqused_layouts())
def test_seqused_k_equals_truncated_keys(layout):
    # CK's kernels run the 2b sequences as any varlen call (core/inputs.py: sequence_tensors).
    check_seqused_k(emulated(), torch.float16, **layout)


def test_a_bad_seqused_k_on_a_device_is_a_bad_offset_caught_there(monkeypatch):
    # On a GPU seqused_k is not read (a sync); simulated by skipping the CPU check. A value past its sequence
    # makes decreasing offsets, which the CK backend's device assert on cu_seqlens refuses.
    monkeypatch.setattr(checks, "check_seqused_k_values", lambda seqused_k, cu_seqlens_k: None)
    q, k, v, _, _ = make_inputs(Config(**{**BASE, "seqlens": [(3, 5), (4, 6)]}))
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 11], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="decreasing offsets"):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6, seqused_k=torch.tensor([6, 2], dtype=torch.int32),
                                  backend=emulated())


@pytest.mark.parametrize("slopes_shape", ["(b, h)", "(h,)"])
def test_alibi_slopes_of_one_head_run_at_any_stride(slopes_shape):
    """ALiBi slopes of one head pass validation at any stride of that dim (size 1: no neighbour to read); CK's
    argument builder takes them as they are (it raised a bare ValueError), equal to contiguous slopes'."""
    q, k, v = (torch.randn(2, 9, 1, 16, generator=torch.Generator().manual_seed(i)).half() for i in range(3))
    wide = torch.rand(1, 2 if slopes_shape == "(b, h)" else 1)
    slopes = wide.t() if slopes_shape == "(b, h)" else wide.t()[0]       # strides (1, 2) / (1,) over one head
    backend = emulated()
    got = fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, backend=backend)
    assert torch.equal(got, fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes.contiguous(),
                                               backend=backend))


def test_forward_writes_a_strided_out():
    # CK takes out's batch, row and head strides: a view of a wider buffer is written in place, nothing else.
    q, k, v, _, _ = make_inputs(Config(**BASE))
    backend = emulated()
    expected = fa.flash_attn_fwd(q, k, v, causal=True, backend=backend)[0]
    buffer = torch.zeros(*q.shape[:2], 2 * q.shape[2], q.shape[3], dtype=q.dtype)
    out = buffer[:, :, 1::2]
    assert fa.flash_attn_fwd(q, k, v, causal=True, out=out, backend=backend)[0] is out
    assert torch.equal(out, expected) and not buffer[:, :, ::2].any()


def test_deterministic_is_bit_identical():
    cfg = Config(**{**BASE, "deterministic": True, "seqlens": [(30, 300), (0, 5), (60, 129)]})
    first = check_case(cfg, backend=emulated())[1]
    second = check_case(cfg, backend=emulated())[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_chunked_under_a_workspace_cap():
    # A cap below one call's deterministic dq_accum: chunks of batch entries / KV groups / head slices.
    cfg = Config(**{**BASE, "deterministic": True})
    q, k, v, dout, _ = make_inputs(cfg)
    backend = emulated()
    out, lse, _ = fa.flash_attn_fwd(q, k, v, backend=backend)
    whole = fa.flash_attn_bwd(dout, q, k, v, out, lse, deterministic=True, backend=backend)
    plan = backend.backward_plan(describe_call(q, k, v, AttentionOptions(deterministic=True)))
    cap = plan.total_bytes // 3
    chunked = fa.flash_attn_bwd(dout, q, k, v, out, lse, deterministic=True, backend=backend, max_workspace_bytes=cap)
    assert sum(kind == "dq_dk_dv" for kind, _ in backend.library.launches) > 2
    for a, b in zip(whole[:3], chunked[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_with_dropout_softmax_d_and_dsink_are_the_reference_backends(varlen):
    """CK's dot_do_o writes D scaled by p_undrop; the backend hands back the package's D = rowsum(dout * out), and the
    sink's gradient taken from it, as the reference backend does for the same rng_state, out and lse (to fp32
    rounding): a D left scaled gives a dsink (1 - p) times too small. (The forwards' outs agree to a rounding: CK's is
    rounded twice, by the kernel and the fold, the reference's once.)"""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 16, 4, 32, generator=gen).half()
    k, v = (torch.randn(1, 16, 2, 32, generator=gen).half() for _ in range(2))
    dout = torch.randn(1, 16, 4, 32, generator=gen).half()
    sink, rng = torch.tensor([1.0, 2.0, -0.5, 0.0]), torch.tensor([123, 0])
    kwargs = dict(dropout_p=0.5, rng_state=rng, learnable_sink=sink)
    if varlen:
        q, k, v, dout = (t[0] for t in (q, k, v, dout))
        cu = torch.tensor([0, 7, 16], dtype=torch.int32)
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=9)
    ck = emulated()
    out, lse, _ = fa.flash_attn_fwd(q, k, v, backend=ck, **kwargs)
    torch.testing.assert_close(out, fa.flash_attn_fwd(q, k, v, backend="reference", **kwargs)[0])
    ours, ref = (fa.flash_attn_bwd(dout, q, k, v, out, lse, backend=backend, **kwargs) for backend in (ck, "reference"))
    for name, a, b in zip(("dq", "dk", "dv", "softmax_d", "dsink"), ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=name)


def test_dropout_can_be_refused_clearly():
    cfg = Config(**{**BASE, "dropout_p": 0.1})
    with pytest.raises(CkError, match="dropout is not emulated"):
        check_case(cfg, backend=emulated(dropout=False))


# ---- the emulator catches wrong pointers and strides ---------------------------------------------

def test_a_wrong_stride_is_detected(monkeypatch):
    # k's row stride doubled in the struct: the emulator walks out of k's storage.
    build = ck.tensor_arg

    def wrong(name, t, varlen):
        arg = build(name, t, varlen)
        if name == "k":
            arg.row_stride *= 2
        return arg
    monkeypatch.setattr(ck, "tensor_arg", wrong)
    with pytest.raises(OutOfBounds, match="k: elements"):
        check_case(Config(**BASE), backend=emulated())


def test_an_unregistered_pointer_is_detected():
    memory = Memory()
    backend = CkBackend.on_library(EmulatedCkLibrary(memory), {"cpu"}, lambda d: "gfx942")
    q, k, v, _, _ = make_inputs(Config(**BASE))
    with pytest.raises(OutOfBounds, match="no registered allocation"):
        fa.flash_attn_func(q, k, v, backend=backend)


# ---- the findings of docs/ck.md, one test each (numbered as there) --------------------------

def test_finding1_dk_dv_rows_of_empty_query_sequences_are_zero():
    # CK's group-mode dq_dk_dv returns before its dK/dV epilogue for s_q == 0: MHA (dk/dv) and GQA
    # (the expanded buffers) both.
    for heads in ((2, 2), (4, 2)):
        cfg = Config(**{**BASE, "heads_q": heads[0], "heads_k": heads[1], "seqlens": [(0, 37), (20, 30)]})
        _, (dq, dk, dv) = check_case(cfg, backend=emulated())
        assert (dk[:37] == 0).all() and (dv[:37] == 0).all()


def test_finding2_non_contiguous_cu_seqlens_are_refused():
    cfg = Config(**{**BASE, "seqlens": [(3, 5), (4, 6)]})
    q, k, v, _, _ = make_inputs(cfg)
    strided = torch.tensor([0, 99, 3, 99, 7, 99], dtype=torch.int32)[::2]
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    with pytest.raises(ArgumentError, match="cu_seqlens_q: must be contiguous"):
        fa.flash_attn_varlen_func(q, k, v, strided, cu_k, 4, 6, backend=emulated())


@pytest.mark.parametrize("varlen", [False, True])
def test_finding3_no_keys_no_launch(varlen):
    if varlen:
        cfg = Config(**{**BASE, "seqlens": [(5, 0), (7, 0)]})
    else:
        cfg = Config(**{**BASE, "seqlen_k": 0})
    for backend in (emulated(), "reference"):
        _, (dq, dk, dv) = check_case(cfg, backend=backend)
        assert (dq == 0).all()
    assert emulated().library.launches == []


def test_finding4_max_seqlen_k_too_small_is_caught_on_the_device(monkeypatch):
    # On a GPU the frontend does not read cu_seqlens (a sync); simulate that by skipping the CPU check.
    original = checks.check_cu_seqlens_values

    def gpu_like(name, cu, total, max_seqlen):
        original(name, cu, total, 10 ** 9)      # the offsets, not the lengths against max_seqlen
    monkeypatch.setattr(checks, "check_cu_seqlens_values", gpu_like)
    cfg = Config(**{**BASE, "deterministic": True, "seqlens": [(20, 300), (10, 20)]})
    q, k, v, dout, _ = make_inputs(cfg)
    cu_q = torch.tensor([0, 20, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 320], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="longer than max_seqlen"):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 128, deterministic=True, backend=emulated())


def test_finding4_rows_past_the_last_sequence_are_zero():
    cfg = Config(**{**BASE, "seqlens": [(20, 30), (10, 20)]})
    q, k, v, dout, _ = make_inputs(cfg)
    pad = 7
    q, dout = (torch.cat([t, torch.randn(pad, *t.shape[1:]).to(t.dtype)]) for t in (q, dout))
    k, v = (torch.cat([t, torch.randn(pad, *t.shape[1:]).to(t.dtype)]) for t in (k, v))
    cu_q = torch.tensor([0, 20, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 50], dtype=torch.int32)
    backend = emulated()
    out, lse, _ = fa.flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=30,
                                    backend=backend)
    dq, dk, dv, _ = fa.flash_attn_bwd(dout, q, k, v, out.nan_to_num(), lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=20, max_seqlen_k=30, backend=backend)
    assert (dq[30:] == 0).all() and (dk[50:] == 0).all() and (dv[50:] == 0).all()
    assert not dq[:30].isnan().any() and not dk[:50].isnan().any()


@pytest.mark.parametrize("kn0", [16, 64, 192])
def test_finding5_plan_uses_the_tile_of_the_instance(kn0):
    cfg = Config(**{**BASE, "head_dim": 128, "deterministic": True, "seqlens": [(30, 141), (0, 9), (12, 70)]})
    backend = emulated(kn0=kn0)
    q, k, v, *_ = make_inputs(cfg)
    cu_k = torch.tensor([0, 141, 150, 220], dtype=torch.int32)
    cu_q = torch.tensor([0, 30, 30, 42], dtype=torch.int32)
    problem = describe_call(q, k, v, AttentionOptions(deterministic=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                      max_seqlen_q=30, max_seqlen_k=141))
    plan = backend.backward_plan(problem)
    assert _dq_accum(plan).shape[0] == -(-141 // kn0)
    check_case(cfg, backend=backend)


def test_finding5_a_plan_with_the_wrong_tile_is_caught():
    # What the hard-coded kN0 = 128 did with an instance of kN0 = 64: CK writes splits past dq_accum.
    class HardCoded(PoisonedCk):
        def backward_plan(self, problem):
            return ck_backward_plan(problem, self.name)

    memory = Memory()
    backend = HardCoded.on_library(EmulatedCkLibrary(memory, kn0=64), {"cpu"}, lambda d: "gfx942")
    backend.memory = memory
    with pytest.raises(OutOfBounds, match="dq_acc"):
        check_case(Config(**{**BASE, "head_dim": 128, "deterministic": True}), backend=backend)


def test_finding5_no_library_plans_with_the_gfx942_table():
    q = torch.randn(1, 300, 2, 128, dtype=torch.float16)
    problem = describe_call(q, q, q, AttentionOptions(deterministic=True))
    assert _dq_accum(CkBackend().backward_plan(problem)).shape[0] == 3


def test_finding7_launch_failure_is_reported_as_such():
    # An invalid grid (what s_k = 0 did before finding 3 was fixed): CK's launch throws a HIP error.
    memory = Memory()
    library = EmulatedCkLibrary(memory)
    backend = CkBackend.on_library(library, {"cpu"}, lambda d: "gfx942")
    q = torch.randn(1, 4, 2, 16, dtype=torch.float16)
    k = torch.randn(1, 0, 2, 16, dtype=torch.float16)
    problem = describe_call(q, k, k, AttentionOptions())
    from flash_attn_ck.core.inputs import kernel_params
    params = kernel_params(problem, q, k, k, AttentionOptions(), None)
    plan = backend.backward_plan(problem)
    workspace = plan.allocate(torch.device("cpu"))
    lse = torch.zeros(problem.lse_shape)
    for t in (q, k, lse, *workspace.values()):
        memory.register(t)
    with pytest.raises(CkError, match="fack_bwd: kernel launch failed: kernel launch failed: HIP runtime error: "
                                      "invalid configuration argument"):
        backend.backward(problem, params, q, lse, q, q.clone(), k.clone(), k.clone(), workspace)


def test_seam_keeps_the_real_backend_unchanged():
    assert CkBackend.device_types == frozenset({"cuda"}) and CkBackend._library is None
    assert "cpu" in emulated().device_types
    assert ck.STATUS_NAMES[5] == "kernel launch failed"


@settings(max_examples=12, deadline=None)
@given(backend=st.sampled_from(["reference", "ck"]), varlen=st.booleans(),
       layout=st.sampled_from(["slice", "heads_outer"]), extra=st.integers(1, 9),
       heads=st.sampled_from([(2, 1), (4, 4)]), seed=st.integers(0, 99))
def test_an_lse_strided_otherwise_is_read_as_the_compact_one(backend, varlen, layout, extra, heads, seed):
    """The kernels read lse and D with one set of strides (CK's lsed, the Triton kernels' lse group); a caller's lse
    that is a slice of a longer one (context parallelism's all-gather passes lse[..., rows]) or stored heads outermost
    reaches the backend strided as softmax_d, and gives the gradients of the compact copy (the Triton kernels read D
    at lse's head stride: the all-gather's dq/dk were off by 10 on the H200)."""
    h, h_k = heads
    g = torch.Generator().manual_seed(seed)
    b, s_q, s_k, d = (1, 13, 11, 16) if varlen else (2, 7, 9, 16)
    q_shape = (b * s_q, h, d) if varlen else (b, s_q, h, d)
    k_shape = (b * s_k, h_k, d) if varlen else (b, s_k, h_k, d)
    q, dout = (torch.randn(q_shape, generator=g, dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(k_shape, generator=g, dtype=torch.float16) for _ in range(2))
    options = dict(causal=True, backend=emulated() if backend == "ck" else "reference")
    if varlen:
        options.update(cu_seqlens_q=torch.tensor([0, 5, s_q], dtype=torch.int32),
                       cu_seqlens_k=torch.tensor([0, 4, s_k], dtype=torch.int32), max_seqlen_q=8, max_seqlen_k=7)
    out, lse, _ = fa.flash_attn_fwd(q, k, v, **options)
    compact = fa.flash_attn_bwd(dout, q, k, v, out, lse, **options)[:3]
    if layout == "slice":       # the rows of a longer lse, from column `extra`
        longer = torch.randn(*lse.shape[:-1], lse.shape[-1] + 2 * extra, generator=g)
        strided = longer[..., extra:extra + lse.shape[-1]]
    elif varlen:                # (h, total_q) rows of a wider one, from column 0
        strided = torch.randn(*lse.shape[:-1], lse.shape[-1] + extra, generator=g)[..., :lse.shape[-1]]
    else:                       # heads outermost: (b, h, s) viewed from (h, b, s)
        strided = torch.randn(h, b, lse.shape[-1], generator=g).transpose(0, 1)
    strided.copy_(lse)
    assert strided.stride() != lse.stride()
    runs = []
    cls = type(options["backend"]) if backend == "ck" else ReferenceBackend
    real = cls.backward

    def spy(self, problem, params, out, lse, *rest):
        runs.append((lse.stride(), rest[-1]["softmax_d"].stride()))
        return real(self, problem, params, out, lse, *rest)
    with mock.patch.object(cls, "backward", spy):
        grads = fa.flash_attn_bwd(dout, q, k, v, out, strided, **options)[:3]
    assert runs and all(lse_strides == d_strides for lse_strides, d_strides in runs), runs
    for name, got, want in zip(("dq", "dk", "dv"), grads, compact, strict=True):
        assert torch.equal(got, want), name
