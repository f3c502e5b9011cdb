"""The reference backend, through the public API, against the naive float64 oracle (docs/semantics.md §Correctness)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_attn_ck as fa
from cases import check_case, check_mask_kind, make_inputs, mask_kind_grid, run_ours
from flash_attn_ck.backends.reference import ReferenceBackend
from oracle import Config, assert_close_2x

GRID = {
    "mha": Config(heads_q=3, heads_k=3),
    "gqa": Config(heads_q=6, heads_k=2),
    "mqa": Config(heads_q=4, heads_k=1),
    "causal": Config(causal=True),
    "causal-sq>sk": Config(causal=True, seqlen_q=60, seqlen_k=21),
    "sq=1": Config(seqlen_q=1, seqlen_k=50, causal=True),
    "window": Config(window=(7, 3)),
    "window-left-only": Config(window=(5, -1), seqlen_q=70, seqlen_k=30),
    "window-wider-than-seq": Config(window=(500, 400)),
    "causal+window": Config(causal=True, window=(9, 4)),
    "alibi": Config(alibi=True, causal=True),
    "softcap": Config(softcap=5.0),
    "dropout": Config(dropout_p=0.2, causal=True),
    "dropout-gqa-window": Config(dropout_p=0.15, heads_q=4, heads_k=2, window=(6, 6)),
    "d59-pad": Config(head_dim=59),
    "d8": Config(head_dim=8),
    "d256": Config(head_dim=256, seqlen_q=20, seqlen_k=140),
    "d200-deterministic": Config(head_dim=200, seqlen_k=150, deterministic=True),
    "fp16": Config(dtype=torch.float16, alibi=True),
    "long-keys-multitile": Config(seqlen_q=20, seqlen_k=300, heads_q=2, heads_k=1, causal=True),
    "varlen": Config(seqlens=[(5, 9), (17, 3), (30, 30)], causal=True),
    "varlen-zero-lengths": Config(seqlens=[(0, 4), (6, 0), (11, 13), (0, 0)], heads_q=4, heads_k=2),
    "varlen-dropout-alibi": Config(seqlens=[(12, 20), (7, 7)], dropout_p=0.25, alibi=True),
    "varlen-window-softcap": Config(seqlens=[(25, 10), (3, 40)], window=(4, 2), softcap=3.0, head_dim=24),
}


@pytest.mark.parametrize("name", GRID)
def test_reference_against_naive(name):
    check_case(GRID[name])


@pytest.mark.parametrize("kind,seqlens", mask_kind_grid(ReferenceBackend.mask_kinds))
def test_every_declared_mask_kind_matches_the_oracle(kind, seqlens):
    for alibi in (False, True):
        check_mask_kind(ReferenceBackend(), kind, seqlens, alibi=alibi)


def test_gqa_gradients_rounded_per_head_meet_the_rule():
    """One key, d = 1, three query heads per kv head, dropout: dV is three per-head values (dO / 0.7) rounded to
    bf16 (the CK contract's expanded dV) and summed, 1.7 bf16 units from the exact value, where autograd in bf16
    happened to land 0.3 units away. The rule's floor for those roundings passes it (without it: 1.34e-2 against
    a bound of 9.7e-3, found by test_reference_random_configs)."""
    torch.manual_seed(0)   # the dropout draw in which every head keeps the key
    check_case(Config(batch=1, seqlen_q=31, seqlen_k=1, heads_q=3, heads_k=1, head_dim=1, causal=True,
                      window=(0, 0), softcap=4.0, dropout_p=0.3), seed=12233)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 200), scale=st.floats(0.01, 100.0), roundings=st.integers(1, 9),
       over=st.floats(1.5, 10.0), seed=st.integers(0, 2 ** 16))
def test_the_2x_rule_rejects_errors_past_its_bound(n, scale, roundings, over, seed):
    """A bf16 result whose largest entry is off by `over` times (a bound on) the rule's bound (2x the same-precision
    error, floored at the unavoidable roundings, plus atol) fails it; the same-precision result itself passes."""
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    pt = (ref + torch.randn(n, generator=gen, dtype=torch.float64) * scale * 1e-3).to(torch.bfloat16)
    pt_err = (pt.double() - ref).abs().max().item()
    eps, top = torch.finfo(torch.bfloat16).eps, ref.abs().max().item()
    floor = roundings * eps / 2 * top
    bound = max(2 * pt_err, floor) + 4 * eps * (top + 0.3)   # atol is 2 units of bf16 rounding near |ref| + 0.3
    broken = ref.clone()
    broken[ref.abs().argmax()] += over * bound   # bf16 rounding moves it by < 1% of that
    with pytest.raises(AssertionError, match="max error"):
        assert_close_2x("x", broken.to(torch.bfloat16), ref, pt, roundings=roundings)
    assert_close_2x("x", pt, ref, pt, roundings=roundings)


@settings(max_examples=25, deadline=None)
@given(s_q=st.integers(1, 40), s_k=st.integers(1, 160), groups=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
       d=st.integers(1, 72), causal=st.booleans(), left=st.integers(-1, 50), right=st.integers(-1, 50),
       alibi=st.booleans(), softcap=st.sampled_from([0.0, 4.0]), dropout=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 2 ** 16))
def test_reference_random_configs(s_q, s_k, groups, d, causal, left, right, alibi, softcap, dropout, seed):
    cfg = Config(batch=1, seqlen_q=s_q, seqlen_k=s_k, heads_q=groups[0], heads_k=groups[1], head_dim=d,
                 causal=causal, window=(left, right), alibi=alibi, softcap=softcap, dropout_p=dropout)
    check_case(cfg, seed=seed)


def test_deterministic_mode_is_bit_identical():
    cfg = Config(seqlen_k=300, heads_q=4, heads_k=2, deterministic=True, dropout_p=0.1, causal=True)
    q, k, v, dout, slopes = make_inputs(cfg)
    out, lse, rng_state, grads = run_ours(cfg, q, k, v, dout, slopes)
    for _ in range(3):
        again = fa.flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=cfg.dropout_p, causal=True,
                                  deterministic=True, rng_state=rng_state)
        for a, b in zip(grads, again):
            assert torch.equal(a, b)


def test_dropout_pattern_follows_rng_state():
    """Forward and backward see the same pattern; consecutive forwards draw different ones."""
    cfg = Config(dropout_p=0.5, heads_q=2, heads_k=2)
    q, k, v, _, _ = make_inputs(cfg)
    first = fa.flash_attn_fwd(q, k, v, dropout_p=0.5, return_attn_probs=True)
    second = fa.flash_attn_fwd(q, k, v, dropout_p=0.5, return_attn_probs=True)
    assert not torch.equal(first[2], second[2]), "the generator must advance between calls"
    dropped = (first[3] < 0).double().mean().item()
    assert 0.45 < dropped < 0.55, f"dropout rate {dropped}"
    # The probs tensor encodes the pattern; kept probabilities sum with dropped ones to 1 per row.
    assert torch.allclose(first[3].abs().sum(-1), torch.ones(2, 2, cfg.seqlen_q, dtype=torch.float32), atol=1e-5)


def test_empty_key_rows_give_zero_output_and_inf_lse():
    # s_q > s_k with a causal mask: the first s_q - s_k rows see no key (bottom-right alignment).
    cfg = Config(seqlen_q=10, seqlen_k=4, causal=True, heads_q=2, heads_k=2)
    q, k, v, dout, _ = make_inputs(cfg)
    out, lse, _ = fa.flash_attn_fwd(q, k, v, causal=True)
    assert torch.equal(out[:, :6], torch.zeros_like(out[:, :6]))
    assert torch.isinf(lse[:, :, :6]).all() and torch.isfinite(lse[:, :, 6:]).all()
    dq, _, _, _ = fa.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)
    assert torch.equal(dq[:, :6], torch.zeros_like(dq[:, :6]))


def test_empty_sequences_batch_mode():
    q = torch.randn(2, 0, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 5, 2, 16, dtype=torch.bfloat16)
    out, lse, _ = fa.flash_attn_fwd(q, k, k)
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)
    dk = torch.full_like(k, 7.0)
    dq, dk, dv, softmax_d = fa.flash_attn_bwd(torch.empty_like(q), q, k, k, out, lse, dk=dk)
    assert torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(k))
    q = torch.randn(2, 3, 2, 16, dtype=torch.bfloat16)
    k0 = torch.randn(2, 0, 2, 16, dtype=torch.bfloat16)
    out, lse, _ = fa.flash_attn_fwd(q, k0, k0)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()


def test_packed_variants_match_unpacked():
    cfg = Config(heads_q=2, heads_k=2, seqlen_q=19, seqlen_k=19, causal=True)
    q, k, v, dout, _ = make_inputs(cfg)
    qkv = torch.stack([q, k, v], dim=2).requires_grad_()
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    out.backward(dout)
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    ref = fa.flash_attn_func(q2, k2, v2, causal=True)
    ref.backward(dout)
    assert torch.equal(out, ref)
    assert torch.equal(qkv.grad, torch.stack([q2.grad, k2.grad, v2.grad], dim=2))
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(fa.flash_attn_kvpacked_func(q, kv, causal=True), ref)


def test_varlen_packed_variants_match_unpacked():
    lengths = [5, 11, 0, 8]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    qkv = torch.randn(sum(lengths), 3, 2, 16, dtype=torch.bfloat16)
    packed = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=True)
    plain = fa.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, max(lengths), max(lengths), causal=True)
    kvpacked = fa.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, max(lengths), max(lengths),
                                                  causal=True)
    assert torch.equal(packed, plain) and torch.equal(kvpacked, plain)


def test_return_attn_probs_matches_output():
    cfg = Config(heads_q=2, heads_k=1, window=(4, 4), dropout_p=0.3)
    q, k, v, _, _ = make_inputs(cfg)
    out, lse, probs = fa.flash_attn_func(q, k, v, dropout_p=0.3, window_size=(4, 4), return_attn_probs=True)
    kept = probs.clamp(min=0) / 0.7
    vf = v.float().transpose(1, 2).repeat_interleave(2, 1)
    assert torch.allclose((kept @ vf).transpose(1, 2), out.float(), atol=2e-2)


@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True, window_size=(3, -1)), dict(softcap=2.0),
                                    dict(alibi=True)])
def test_gradcheck_float64(kwargs):
    kwargs = dict(kwargs)
    torch.manual_seed(0)
    q = torch.randn(1, 5, 2, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 7, 1, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 7, 1, 6, dtype=torch.float64, requires_grad=True)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(2, dtype=torch.float32)
    assert torch.autograd.gradcheck(lambda q, k, v: fa.flash_attn_func(q, k, v, **kwargs), (q, k, v))


def test_dropout_gradients_match_finite_differences():
    """With dropout the pattern is fixed by rng_state, so differentiate the forward under one state."""
    from flash_attn_ck.backends.reference import ReferenceBackend
    from flash_attn_ck.core.inputs import describe_call, kernel_params
    from flash_attn_ck.core.options import AttentionOptions

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    out, lse, rng_state = fa.flash_attn_fwd(q, k, v, dropout_p=0.4, causal=True)
    dout = torch.randn_like(out)
    grads = fa.flash_attn_bwd(dout, q, k, v, out, lse, dropout_p=0.4, causal=True, rng_state=rng_state)[:3]

    def loss(q, k, v):
        options = AttentionOptions(causal=True, dropout_p=0.4)
        problem = describe_call(q, k, v, options)
        params = kernel_params(problem, q, k, v, options, rng_state)
        result = torch.empty_like(params.q)
        ReferenceBackend().forward(problem, params, result, torch.empty(problem.lse_shape, dtype=torch.float64))
        return (result * dout).sum().item()

    eps = 1e-6
    for which, grad in enumerate(grads):
        for index in [(0, 1, 0, 2), (0, 4, 1, 7), (0, 5, 1, 0)]:
            args = [q.clone(), k.clone(), v.clone()]
            args[which][index] += eps
            plus = loss(*args)
            args[which][index] -= 2 * eps
            numeric = (plus - loss(*args)) / (2 * eps)
            assert abs(numeric - grad[index].item()) < 1e-6, (which, index, numeric, grad[index].item())


def test_long_sequence_runs_on_cpu_in_key_tiles(monkeypatch):
    """s = 8192 on the CPU: the reference walks keys in tiles of kN0, never an s x s matrix per head.
    A torch-function spy inside the backend's forward and backward records the largest tensor any torch
    call returns there: at most heads x s x kN0 elements (one key tile of scores), far below s x s."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    from flash_attn_ck.backends.ck.plan import CkBwdTile
    from flash_attn_ck.backends.reference import ReferenceBackend

    class LargestTensor(TorchFunctionMode):
        largest = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            sizes = [t.numel() for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
            LargestTensor.largest = max([LargestTensor.largest, *sizes])
            return result

    def spied(method):
        def run(self, *args, **kwargs):
            with LargestTensor():      # entered here: the backward runs on autograd's engine
                return method(self, *args, **kwargs)
        return run

    for name in ("forward", "backward"):
        monkeypatch.setattr(ReferenceBackend, name, spied(getattr(ReferenceBackend, name)))
    s, heads, d = 8192, 1, 32
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, s, heads, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.detach().float().transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    assert (out.float() - ref).abs().max().item() < 2e-2
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert 0 < LargestTensor.largest <= heads * s * CkBwdTile.for_head_dim(d).kN0 < s * s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_an_autocast_around_the_call_changes_nothing(dtype, autocast_dtype):
    """The reference computes in its own accumulation dtype, as the kernels do (and as torch.compile runs the ops):
    an autocast context around the call leaves out, lse, the probabilities and the gradients exactly what they are
    without it (before, its matmuls ran in bf16/fp16: an fp32 result of bf16 accuracy)."""
    cfg = Config(heads_q=4, heads_k=2, seqlen_q=33, seqlen_k=47, head_dim=32, dtype=dtype, causal=True, alibi=True)
    q, k, v, dout, slopes = make_inputs(cfg)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse, probs = fa.flash_attn_func(*leaves, causal=True, alibi_slopes=slopes, return_attn_probs=True,
                                             backend="reference")
        out.backward(dout)
        return out, lse, probs, *(t.grad for t in leaves)

    expected = run()
    with torch.autocast("cpu", dtype=autocast_dtype):
        got = run()
    for name, g, e in zip(("out", "lse", "probs", "dq", "dk", "dv"), got, expected):
        assert g.dtype == e.dtype and torch.equal(g, e), name


def test_a_sparse_gradient_of_out_is_read_as_its_dense_values():
    """out.backward(a sparse tensor): the gradients equal those of the same values dense (before, torch's
    "unsupported memory format option Contiguous" from the backward)."""
    cfg = Config(heads_q=4, heads_k=2, seqlen_q=9, seqlen_k=13, head_dim=16, dtype=torch.float64, causal=True)
    q, k, v, dout, _ = make_inputs(cfg)
    dout = dout * (torch.rand(dout.shape, generator=torch.Generator().manual_seed(3)) < 0.3)

    def grads(gradient):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fa.flash_attn_func(*leaves, causal=True, backend="reference").backward(gradient)
        return [t.grad for t in leaves]

    for got, expected in zip(grads(dout.to_sparse()), grads(dout), strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
