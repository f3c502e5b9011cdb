"""`out_dtype` of flash_attn_fwd / flash_attn_bwd (what context parallelism asks for, so that its steps' partial
outputs and dK/dV are merged in fp32 and rounded once): fp32 results of fp16/bf16 inputs that round to the default
results bit for bit; bad values refused naming the argument before anything is written; not differentiable;
CK and the warp-specialised Triton kernels decline with their reasons; the ops' fakes allocate the same dtype.
The Triton kernels that write fp32 results run under the interpreter in test_triton_interpret.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from cases import seeded_inputs
from flash_attn_ck import ArgumentError, NoBackendError
from flash_attn_ck.api import backward_workspace, flash_attn_bwd, flash_attn_fwd
from flash_attn_ck.core.errors import WorkspaceError
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.mask import MaskInfo
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.core.problem import AttentionProblem


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), h_k=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([8, 20, 64]), causal=st.booleans(), deterministic=st.booleans(),
       cap_part=st.sampled_from([None, 2, 8]), varlen=st.booleans(), seed=st.integers(0, 1000))
def test_fp32_results_round_to_the_default_ones(dtype, h_k, d, causal, deterministic, cap_part, varlen, seed):
    """The reference computes in fp32: with out_dtype=float32 out, dq, dk, dv are its results before the rounding,
    so they round to the default call's bit for bit, GQA (expanded dK/dV), padded head dims, chunks under a
    workspace cap (their partial sums) and varlen included."""
    q, k, v, dout = seeded_inputs(dtype, h_k=h_k, d=d, seed=seed)
    options = dict(causal=causal, deterministic=deterministic, backend="reference")
    if varlen:
        cu_q, cu_k = (torch.tensor([0, 3, 3, n], dtype=torch.int32) for n in (10, 14))
        q, dout, k, v = (t.flatten(0, 1)[:n] for t, n in ((q, 10), (dout, 10), (k, 14), (v, 14)))
        options.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=11)
    out, lse, _ = flash_attn_fwd(q, k, v, **options)
    planned = {name: value for name, value in options.items() if name != "backend"}
    unchunked = backward_workspace(q, k, v, **planned, backends=("reference",))["reference"].peak_bytes
    cap = None if cap_part is None else unchunked // cap_part       # a part of it: chunks, with partial sums
    try:
        grads = flash_attn_bwd(dout, q, k, v, out, lse, max_workspace_bytes=cap, **options)[:3]
    except WorkspaceError:
        assume(False)       # not even the smallest chunk fits that part
    out32, lse32, _ = flash_attn_fwd(q, k, v, out_dtype=torch.float32, **options)
    assert out32.dtype == torch.float32 and torch.equal(out32.to(dtype), out) and torch.equal(lse32, lse)
    grads32 = flash_attn_bwd(dout, q, k, v, out, lse, max_workspace_bytes=cap, out_dtype=torch.float32, **options)[:3]
    group = q.shape[-2] // h_k
    for name, g, g32 in zip(("dq", "dk", "dv"), grads, grads32, strict=True):
        assert g32.dtype == torch.float32, name
        # Exact, unless the default sums per-head gradients rounded to dtype (GQA's expanded dK/dV), or the cap cuts
        # the calls differently (fp32 buffers are larger) and the fp32 sums differ in their last bits.
        if cap is None and (group == 1 or name == "dq"):
            assert torch.equal(g32.to(dtype), g), name
        else:
            bound = torch.finfo(dtype).eps * group * g.double().abs().max()
            assert (g32.to(dtype).double() - g.double()).abs().max() <= bound, name
    given = tuple(torch.full_like(t, 7.0, dtype=torch.float32) for t in (q, k, v))
    filled = flash_attn_bwd(dout, q, k, v, out, lse, *given, max_workspace_bytes=cap, out_dtype=torch.float32,
                            **options)[:3]
    assert all(a is b for a, b in zip(filled, given, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(filled, grads32, strict=True))


@pytest.mark.parametrize("value, message", [
    ("float32", "out_dtype: expected None or a torch.dtype, got str"),
    (torch.float16, "out_dtype: expected None or bfloat16 or float32 for bfloat16 q"),
    (torch.float64, "out_dtype: expected None or bfloat16 or float32 for bfloat16 q"),
    (torch.int32, "out_dtype: expected None or bfloat16 or float32 for bfloat16 q"),
])
def test_bad_values_are_refused_before_anything_is_written(value, message):
    q, k, v, dout = seeded_inputs(torch.bfloat16)
    out, lse, _ = flash_attn_fwd(q, k, v)
    given = torch.full_like(q, 3.0, dtype=torch.float32)
    with pytest.raises(ArgumentError, match=message):
        flash_attn_fwd(q, k, v, out=given, out_dtype=value)
    assert (given == 3.0).all()
    grads = tuple(torch.full_like(t, 3.0, dtype=torch.float32) for t in (q, k, v))
    with pytest.raises(ArgumentError, match=message):
        flash_attn_bwd(dout, q, k, v, out, lse, *grads, out_dtype=value)
    assert all((g == 3.0).all() for g in grads)


def test_results_must_have_the_asked_dtype():
    q, k, v, dout = seeded_inputs(torch.float16)
    out, lse, _ = flash_attn_fwd(q, k, v)
    with pytest.raises(ArgumentError, match=r"out: expected dtype float32 \(out_dtype\), got float16"):
        flash_attn_fwd(q, k, v, out=torch.empty_like(q), out_dtype=torch.float32)
    with pytest.raises(ArgumentError, match=r"out: expected dtype float16 \(the dtype of q\), got float32"):
        flash_attn_fwd(q, k, v, out=torch.empty_like(q, dtype=torch.float32))
    with pytest.raises(ArgumentError, match=r"dk: expected dtype float32 \(out_dtype\), got float16"):
        flash_attn_bwd(dout, q, k, v, out, lse, None, torch.empty_like(k), out_dtype=torch.float32)
    # q's own dtype, and fp32 inputs' fp32, are the default results
    assert torch.equal(flash_attn_fwd(q, k, v, out_dtype=torch.float16)[0], out)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    assert torch.equal(flash_attn_fwd(q32, k32, v32, out_dtype=torch.float32)[0], flash_attn_fwd(q32, k32, v32)[0])


def test_fp32_results_are_not_differentiable():
    q, k, v, _ = seeded_inputs(torch.bfloat16)
    q.requires_grad_()
    with pytest.raises(ArgumentError, match="out_dtype: results in float32, not q's dtype, are not differentiable"):
        flash_attn_fwd(q, k, v, out_dtype=torch.float32)
    with torch.no_grad():
        assert flash_attn_fwd(q, k, v, out_dtype=torch.float32)[0].dtype == torch.float32


def test_ck_declines_with_its_reason():
    from ck_emulator import EmulatedCkLibrary, Memory

    from flash_attn_ck.backends.ck.backend import CkBackend
    ck = CkBackend.on_library(EmulatedCkLibrary(Memory()), {"cpu"}, lambda device: "gfx942")
    q, k, v, _ = seeded_inputs(torch.bfloat16, d=64)
    assert ck.not_supported_reasons(describe_call(q, k, v, AttentionOptions())) == []
    with pytest.raises(NoBackendError, match="out_dtype float32: CK's fmha kernels write out, dq, dk and dv in the "
                                             "input dtype"):
        flash_attn_fwd(q, k, v, out_dtype=torch.float32, backend=ck)


def _problem(out_dtype=None):
    mask = MaskInfo.from_flash_args(False, (-1, -1), 4096, 4096)
    return AttentionProblem(2, 4096, 4096, 16, 16, 128, torch.bfloat16, torch.device("cuda"), mask, 128 ** -0.5,
                            out_dtype=out_dtype)


def test_the_warp_specialised_triton_kernels_decline_fp32_results():
    """They store through TMA from shared tiles of the input dtype (their code is not changed for this): the Triton
    backend runs forward.py and bwd_main instead, which convert on store."""
    pytest.importorskip("triton")
    from gluon_compile import pretend_capability, ws_reasons

    from flash_attn_ck.backends.triton import operators
    from flash_attn_ck.backends.triton.backend import TritonBackend
    reason = "out_dtype float32: its TMA stores go through shared tiles of the input dtype"
    with pretend_capability():
        backend = TritonBackend(ws=True, fwd_ws=True)
        assert backend.reasons(_problem(), operators.FwdWs) == [] and ws_reasons(backend, _problem()) == []
        fp32 = _problem(torch.float32)
        assert backend.reasons(fp32, operators.FwdWs) == [reason] and ws_reasons(backend, fp32) == [reason]
        assert backend.forward_kernel(fp32) == f"forward (one program per query tile); fwd_ws not used: {reason}"
        assert f"; bwd_ws not used: {reason};" in backend.backward_plan(fp32).kernel
        assert TritonBackend.not_supported_reasons(fp32) == TritonBackend.not_supported_reasons(_problem())


def test_the_triton_backend_says_when_fp32_results_would_take_slower_kernels():
    """Context parallelism asks each backend (`fp32_outputs_slower`): fp32 step results where the kernels that run
    anyway write them, the input dtype where the warp-specialised kernels would give way to the older ones."""
    pytest.importorskip("triton")
    from gluon_compile import pretend_capability

    from flash_attn_ck.backends.reference import ReferenceBackend
    from flash_attn_ck.backends.triton.backend import TritonBackend
    with pretend_capability():
        assert TritonBackend(ws=True, fwd_ws=True).fp32_outputs_slower(_problem()) == \
            "fwd_ws and bwd_ws would give way to the older kernels"
        assert TritonBackend(ws=True, fwd_ws=False).fp32_outputs_slower(_problem()) == \
            "bwd_ws would give way to the older kernels"
        assert TritonBackend(ws=False, fwd_ws=False).fp32_outputs_slower(_problem()) is None
    assert ReferenceBackend().fp32_outputs_slower(_problem()) is None


def test_context_parallel_steps_take_fp32_only_without_a_cost(monkeypatch):
    from flash_attn_ck.backends.reference import ReferenceBackend
    from flash_attn_ck.integrations.context_parallel.plan import choose_step_dtype
    q, k, v, _ = seeded_inputs(torch.bfloat16, d=64)
    options = AttentionOptions(backend="reference")
    assert choose_step_dtype(q, k, v, options) == torch.float32
    monkeypatch.setattr(ReferenceBackend, "fp32_outputs_slower", lambda self, problem: "a faster kernel")
    assert choose_step_dtype(q, k, v, options) is None
    assert choose_step_dtype(q.double(), k.double(), v.double(), AttentionOptions(backend="reference")) is None


def test_the_fakes_allocate_the_asked_dtype():
    q, k, v, dout = seeded_inputs(torch.bfloat16)
    with FakeTensorMode() as mode:
        q, k, v, dout = (mode.from_tensor(t) for t in (q, k, v, dout))
        out, lse, _ = flash_attn_fwd(q, k, v, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        grads = flash_attn_bwd(dout, q, k, v, out.to(torch.bfloat16), lse, out_dtype=torch.float32)[:3]
        assert all(g.dtype == torch.float32 for g in grads)
