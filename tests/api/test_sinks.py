"""Learnable attention sinks (`learnable_sink=`, docs/semantics.md §Learnable sinks) on the CPU: forward out/lse and
dq/dk/dv/dsink against the float64 oracle with the sink under the 2x rule, on the reference backend, the emulated CK
backend and (in a subprocess) the Triton kernels under TRITON_INTERPRET=1; the rows without keys, a float64
gradcheck, validation, the ops and torch.compile, the workspace cap, determinism and every public function."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ck_emulated import emulated

import flash_attn_ck as fa
from cases import check_case, judge, make_inputs, make_sink, packed_if
from flash_attn_ck import ArgumentError
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.ops import _FWD, _flatten
from oracle import Config
from sink_cases import BASE, CASES, SINK_DTYPES


def _case(name: str, sink_dtype=torch.float32, dtype=torch.bfloat16) -> Config:
    return Config(**{**BASE, **CASES[name]}, sink_dtype=sink_dtype, dtype=dtype)


# ---- against the oracle -----------------------------------------------------------------------------

@pytest.mark.parametrize("sink", sorted(SINK_DTYPES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_the_oracle(name, sink):
    check_case(_case(name, SINK_DTYPES[sink]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_reference_in_other_dtypes(dtype):
    check_case(_case("gqa", torch.float32, dtype))


# CK runs neither softcap nor (here) dropout: the emulator draws no keep pattern.
@pytest.mark.parametrize("name", sorted(name for name in CASES if "dropout" not in name and "softcap" not in name))
def test_emulated_ck_matches_the_oracle(name):
    check_case(_case(name, torch.bfloat16, torch.float16), backend=emulated())


# ---- the rows without keys -----------------------------------------------------------------------------

def test_rows_without_keys_have_out_zero_and_lse_the_sink():
    """Causal s_q > s_k (the first rows see no key) and a varlen sequence without keys: out 0, lse = sink[h], and the
    sink takes the whole row (p_sink = 1, D = 0: no dsink from them)."""
    sink = torch.tensor([0.5, -1.0, 2.0, 3.0])
    q = torch.randn(1, 9, 4, 16)
    k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16)
    out, lse, _ = fa.flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink, backend="reference")
    assert (out[0, :5] == 0).all() and (out[0, 5:] != 0).any()
    assert torch.equal(lse[0, :, :5], sink[:, None].expand(4, 5))
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 4], dtype=torch.int32)
    out, lse, _ = fa.flash_attn_fwd(q[0, :7], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                                    max_seqlen_k=4, learnable_sink=sink, backend="reference")
    assert (out[:3] == 0).all() and torch.equal(lse[:, :3], sink[:, None].expand(4, 3))


def test_rows_in_no_sequence_keep_the_empty_row_convention():
    """Varlen rows after cu_seqlens_q[-1] belong to no softmax: out 0, lse +inf, with a sink too."""
    q, k, v = torch.randn(9, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    out, lse, _ = fa.flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4,
                                    learnable_sink=torch.zeros(2), backend="reference")
    assert (out[6:] == 0).all() and (lse[:, 6:] == math.inf).all() and torch.isfinite(lse[:, :6]).all()


def test_a_sink_of_minus_infinity_is_no_sink():
    q, k, v = (torch.randn(2, 7, 2, 8) for _ in range(3))
    plain = fa.flash_attn_fwd(q, k[:, :3], v[:, :3], causal=True, backend="reference")
    sunk = fa.flash_attn_fwd(q, k[:, :3], v[:, :3], causal=True, learnable_sink=torch.full((2,), -math.inf),
                             backend="reference")
    assert torch.equal(plain[0], sunk[0]) and torch.equal(plain[1], sunk[1])


# ---- gradients -------------------------------------------------------------------------------------

@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_gradcheck_float64(varlen):
    """dq, dk, dv and dsink of the reference backend against finite differences, GQA and causal."""
    gen = torch.Generator().manual_seed(0)
    sink = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    if varlen:
        q = torch.randn(9, 4, 8, generator=gen, dtype=torch.float64).requires_grad_()
        k, v = (torch.randn(7, 2, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
        cu_q, cu_k = torch.tensor([0, 5, 5, 9], dtype=torch.int32), torch.tensor([0, 3, 6, 7], dtype=torch.int32)

        def attention(q, k, v, sink):
            return fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 3, causal=True, learnable_sink=sink,
                                             backend="reference")
    else:
        q = torch.randn(2, 6, 4, 8, generator=gen, dtype=torch.float64).requires_grad_()
        k, v = (torch.randn(2, 4, 2, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))

        def attention(q, k, v, sink):
            return fa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, backend="reference")
    assert torch.autograd.gradcheck(attention, (q, k, v, sink))


def test_flash_attn_bwd_returns_dsink_and_autograd_agrees():
    cfg = _case("gqa")
    q, k, v, dout, _ = make_inputs(cfg)
    sink = make_sink(cfg).requires_grad_()
    out, lse, _ = fa.flash_attn_fwd(q, k, v, learnable_sink=sink, backend="reference")
    dq, dk, dv, softmax_d, dsink = fa.flash_attn_bwd(dout, q, k, v, out, lse, learnable_sink=sink,
                                                     backend="reference")
    assert dsink.dtype == sink.dtype and dsink.shape == sink.shape
    assert len(fa.flash_attn_bwd(dout, q, k, v, out, lse, backend="reference")) == 4
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    fa.flash_attn_func(q, k, v, learnable_sink=sink, backend="reference").backward(dout)
    for ours, autograd in zip((dq, dk, dv, dsink), (q.grad, k.grad, v.grad, sink.grad)):
        assert torch.equal(ours, autograd)


def test_a_sink_without_grad_gets_none_and_double_backward_raises():
    q, k, v = (torch.randn(1, 6, 2, 8, requires_grad=True) for _ in range(3))
    sink = torch.zeros(2)
    fa.flash_attn_func(q, k, v, learnable_sink=sink, backend="reference").sum().backward()
    assert sink.grad is None and q.grad is not None
    sink.requires_grad_()
    out = fa.flash_attn_func(q, k, v, learnable_sink=sink, backend="reference")
    dsink, = torch.autograd.grad(out.sum(), sink, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        dsink.sum().backward()


def test_chunked_backward_under_a_workspace_cap():
    """The fold sits outside the chunks (the backward needs only the folded out and lse): a backward in chunks, split
    GQA groups included, matches the oracle, dsink too."""
    cfg = Config(**{**BASE, "batch": 3, "seqlen_q": 40, "seqlen_k": 40}, causal=True, sink_dtype=torch.float32)
    q, k, v, dout, _ = make_inputs(cfg)
    sink = make_sink(cfg)
    out, lse, _ = fa.flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink, backend="reference")
    full = fa.backward_workspace(q, k, v, causal=True, backends=("reference",))["reference"].unchunked_bytes
    cap = full // 5
    plan = fa.backward_workspace(q, k, v, causal=True, max_workspace_bytes=cap, backends=("reference",))["reference"]
    assert len(plan.chunks) > 1
    capped = fa.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, learnable_sink=sink, max_workspace_bytes=cap,
                               backend="reference")
    judge(cfg, (q, k, v, dout, None), out, lse, None, capped[:3] + capped[4:], sink)


@pytest.mark.parametrize("backend", ["reference", "ck"])
def test_deterministic_is_bit_identical(backend):
    cfg = Config(**{**BASE, **CASES["varlen_empty"]}, deterministic=True, sink_dtype=torch.float32,
                 dtype=torch.float16)

    def once():
        return check_case(cfg, backend=emulated() if backend == "ck" else backend)

    (out_a, grads_a), (out_b, grads_b) = once(), once()
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


# ---- every public function ---------------------------------------------------------------------------

def test_packed_variants_take_the_sink():
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 11, 3, 4, 16, generator=gen)
    sink = torch.randn(4, generator=gen)
    expected = fa.flash_attn_func(*qkv.unbind(2), causal=True, learnable_sink=sink, backend="reference")
    packed = fa.flash_attn_qkvpacked_func(qkv, causal=True, learnable_sink=sink, backend="reference")
    kvpacked = fa.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True, learnable_sink=sink,
                                           backend="reference")
    assert torch.equal(packed, expected) and torch.equal(kvpacked, expected)
    flat = qkv.flatten(0, 1)
    cu = torch.tensor([0, 11, 22], dtype=torch.int32)
    varlen = fa.flash_attn_varlen_func(*flat.unbind(1), cu, cu, 11, 11, causal=True, learnable_sink=sink,
                                       backend="reference")
    varlen_qkv = fa.flash_attn_varlen_qkvpacked_func(flat, cu, 11, causal=True, learnable_sink=sink,
                                                     backend="reference")
    varlen_kv = fa.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu, cu, 11, 11, causal=True,
                                                   learnable_sink=sink, backend="reference")
    for result in (varlen, varlen_qkv, varlen_kv):
        torch.testing.assert_close(result, expected.flatten(0, 1), rtol=0, atol=1e-6)


def test_a_given_out_and_fp32_results_are_folded_alike():
    q, k, v = (torch.randn(2, 7, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    sink = torch.tensor([0.5, 2.0])
    out, lse, _ = fa.flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink, backend="reference")
    given = torch.empty_like(q)
    assert torch.equal(fa.flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink, out=given,
                                         backend="reference")[1], lse)
    assert torch.equal(given, out)
    out32, lse32, _ = fa.flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink, out_dtype=torch.float32,
                                        backend="reference")
    torch.testing.assert_close(out32.bfloat16(), out, rtol=0, atol=2 ** -7 * out.abs().max().item())
    assert torch.equal(lse32, lse)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       causal=st.booleans(), varlen=st.booleans())
def test_the_reference_backend_rounds_a_sinks_out_once(seed, dtype, causal, varlen):
    """The reference backend takes the sink before its one rounding, as the Triton kernels do (the fold around CK's
    kernels rounds out a second time): its fp16/bf16 out is its fp32 out (out_dtype) rounded, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 9, 2, 16, generator=gen).to(dtype) for _ in range(3))
    sink = torch.randn(2, generator=gen) * 2
    kwargs = dict(causal=causal, learnable_sink=sink, backend="reference")
    if varlen:
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu = torch.tensor([0, 5, 18], dtype=torch.int32)
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13)
    out = fa.flash_attn_fwd(q, k, v, **kwargs)[0]
    assert torch.equal(out, fa.flash_attn_fwd(q, k, v, out_dtype=torch.float32, **kwargs)[0].to(dtype))


def test_probs_include_the_sink():
    """return_attn_probs: each row's probabilities over its keys sum to 1 - p_sink."""
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    sink = torch.tensor([1.0, -2.0])
    _, lse, probs = fa.flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True, backend="reference")
    torch.testing.assert_close(probs.sum(-1) + torch.exp(sink[:, None] - lse[0]), torch.ones(1, 2, 5))


# ---- validation ------------------------------------------------------------------------------------

BAD_SINKS = st.one_of(
    st.tuples(st.integers(0, 9).filter(lambda n: n != 4)).map(lambda shape: torch.zeros(shape)),
    st.just(torch.zeros(1, 4)), st.just(torch.zeros(())),
    st.sampled_from([torch.int32, torch.int64, torch.bool, torch.complex64]).map(lambda d: torch.zeros(4, dtype=d)),
    st.just(torch.zeros(4, device="meta")),
    st.sampled_from([[0.0] * 4, 1.0, "sink", (0.0,) * 4]),
)


@settings(max_examples=40, deadline=None)
@given(sink=BAD_SINKS, entry=st.sampled_from(["fwd", "func", "varlen", "bwd"]))
def test_a_bad_sink_is_refused_naming_it_before_anything_is_written(sink, entry):
    q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    out = torch.full_like(q, 7.0)
    dq = torch.full_like(q, 7.0)
    with pytest.raises(ArgumentError, match=r"^learnable_sink"):
        _call_with_sink(entry, sink, q, k, v, out, dq)
    assert (out == 7).all() and (dq == 7).all()


def _call_with_sink(entry: str, sink, q, k, v, out, dq) -> None:
    if entry == "fwd":
        fa.flash_attn_fwd(q, k, v, out=out, learnable_sink=sink, backend="reference")
    elif entry == "func":
        fa.flash_attn_func(q, k, v, learnable_sink=sink, backend="reference")
    elif entry == "varlen":
        cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
        fa.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 5, 6, learnable_sink=sink, backend="reference")
    else:
        fa.flash_attn_bwd(q, q, k, v, q, torch.zeros(1, 4, 5), dq, learnable_sink=sink, backend="reference")


# ---- the ops and torch.compile ------------------------------------------------------------------------

def test_fwd_op_opcheck_with_a_sink():
    from torch.library import opcheck
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    options = AttentionOptions(causal=True, backend="reference", learnable_sink=torch.randn(4))
    results = opcheck(torch.ops.flash_attn_ck.fwd.default, (q, k, v, *_flatten(options, _FWD)),
                      raise_exception=False)
    assert all(result == "SUCCESS" for result in results.values()), results


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_compile_fullgraph_with_a_sink(varlen):
    """One graph (fullgraph) through the fwd op's fake and the Function's backward, dsink included; compiled and
    eager agree."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 9, 4, 16, generator=gen), torch.randn(2, 9, 2, 16, generator=gen), \
        torch.randn(2, 9, 2, 16, generator=gen)
    sink = torch.randn(4, generator=gen)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)

    def attention(q, k, v, sink):
        if varlen:
            return fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 9, 9,
                                             causal=True, learnable_sink=sink, backend="reference")
        return fa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, backend="reference")

    def run(fn):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, sink)]
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        return out.detach(), [t.grad for t in inputs]

    torch._dynamo.reset()
    eager, compiled = run(attention), run(torch.compile(attention, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(compiled[0], eager[0])
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b)


# ---- the Triton kernels under the interpreter -----------------------------------------------------------

TRITON_CASES = {
    "gqa_causal": dict(causal=True),
    "varlen_empty": dict(seqlens=[[5, 9], [0, 7], [17, 3], [4, 0]], causal=True),
    "dropout_window": dict(dropout_p=0.25, window=[6, 2]),
}

_TRITON_RUNNER = r"""
import json, sys
import torch
import flash_attn_ck.api  # noqa: F401
from flash_attn_ck import use_backend
from flash_attn_ck.backends.triton import TritonBackend
from oracle import Config
from cases import check_case

cfg = json.loads(sys.argv[1])
cfg.update(dtype=torch.float16, sink_dtype=torch.float32)
if "seqlens" in cfg:
    cfg["seqlens"] = [tuple(s) for s in cfg["seqlens"]]
if "window" in cfg:
    cfg["window"] = tuple(cfg["window"])
TritonBackend.device_types = frozenset({"cuda", "cpu"})   # the interpreter runs on CPU tensors
with use_backend(TritonBackend()):
    check_case(Config(**cfg), backend="triton")
print("PASS")
"""


@pytest.mark.parametrize("name", sorted(TRITON_CASES))
def test_interpreted_triton_kernels_with_a_sink(name):
    pytest.importorskip("triton")
    from test_triton_interpret import _INTERPRETER_PATCH, _interpret
    _interpret(_INTERPRETER_PATCH + _TRITON_RUNNER, json.dumps(TRITON_CASES[name]))


_SPECIAL_SINKS_RUNNER = r"""
import json, sys
import torch
import flash_attn_ck as fa
from flash_attn_ck.backends.triton import TritonBackend

TritonBackend.device_types = frozenset({"cuda", "cpu"})   # the interpreter runs on CPU tensors
cfg = json.loads(sys.argv[1])
gen = torch.Generator().manual_seed(0)
lengths = [[5, 9], [0, 7], [17, 3], [4, 0]]        # a sequence without queries, one without keys
cu_q, cu_k = (torch.tensor([0, *torch.tensor([pair[i] for pair in lengths]).cumsum(0).tolist()], dtype=torch.int32)
              for i in (0, 1))
d, d_v = cfg["d"], cfg["d_v"]
q = torch.randn(int(cu_q[-1]), 4, d, generator=gen).half()
k = torch.randn(int(cu_k[-1]), 2, d, generator=gen).half()
v = torch.randn(int(cu_k[-1]), 2, d_v, generator=gen).half()
sink = torch.tensor(cfg["sink"], dtype=torch.float32)
results = {}
for name in ("triton", "reference"):
    out, lse, _ = fa.flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=17, max_seqlen_k=9,
                                    causal=cfg["causal"], learnable_sink=sink, out_dtype=cfg.get("out_dtype") and
                                    torch.float32, backend=name)
    results[name] = (out.float(), lse)
(out, lse), (ref_out, ref_lse) = results["triton"], results["reference"]
assert torch.equal(lse.isnan(), ref_lse.isnan()) and torch.equal(lse.isinf(), ref_lse.isinf()), (lse, ref_lse)
assert torch.equal(lse[lse.isinf()], ref_lse[ref_lse.isinf()]), "lse: the same infinities"
finite = lse.isfinite()
torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
assert torch.equal(out.isnan(), ref_out.isnan()), "out: NaN where the fold gives NaN"
torch.testing.assert_close(out.nan_to_num(), ref_out.nan_to_num(), atol=2e-3, rtol=2e-3)
print("PASS")
"""

# Sinks far above and below the scores, +-inf, a NaN; with v's own head dim and fp32 results; the reference
# backend's fold is the yardstick (NaN, infinities and empty rows alike).
SPECIAL_SINKS = {
    "infinities": dict(sink=[float("-inf"), float("inf"), 60.0, -60.0], d=16, d_v=16, causal=True),
    "nan_d_v_fp32": dict(sink=[float("nan"), 0.5, float("-inf"), 30.0], d=24, d_v=40, causal=False, out_dtype=True),
}


@pytest.mark.parametrize("name", sorted(SPECIAL_SINKS))
def test_interpreted_triton_forward_takes_special_sinks_as_the_fold_does(name):
    """The one-launch forward takes the sink into its softmax (TritonBackend.forward_takes_sink): rows without keys,
    sinks of +-inf, far above or below every score and NaN give the out and lse the fold around a kernel gives."""
    pytest.importorskip("triton")
    from test_triton_interpret import _INTERPRETER_PATCH, _interpret
    _interpret(_INTERPRETER_PATCH + _SPECIAL_SINKS_RUNNER, json.dumps(SPECIAL_SINKS[name]))


@pytest.mark.parametrize("varlen", [False, True])
def test_a_sink_of_plus_infinity_takes_its_rows_and_gets_a_zero_gradient(varlen):
    """A sink of +inf takes every row of its head (out 0, lse +inf), so nothing flows back to it: dsink 0, not the NaN
    of exp(inf - inf); a NaN sink keeps NaN; the other heads' dsink are the finite sink's."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, extra = packed_if(varlen, *(torch.randn(2, 6, 3, 8, generator=gen) for _ in range(3)))
    sink = torch.tensor([math.inf, float("nan"), 0.5])
    out, lse, _ = fa.flash_attn_fwd(q, k, v, learnable_sink=sink, backend="reference", **extra)
    dsink = fa.flash_attn_bwd(torch.randn_like(out), q, k, v, out, lse, learnable_sink=sink, backend="reference",
                              **extra)[4]
    assert dsink[0].item() == 0.0 and dsink[1].isnan() and dsink[2].isfinite(), dsink
