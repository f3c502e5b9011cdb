"""A small transformer block (attention + MLP, GQA) through `torch.compile(fullgraph=True)`.

fullgraph=True turns any graph break into an error, so passing means the public functions trace
into one graph, the ops included (inside the autograd Function's traced forward and backward), and the
compiled backward calls the `bwd` op. Compiled and eager must agree on the output and on every gradient.
CPU: the reference backend; inductor for the batch block, aot_eager (the same tracing, fakes and
autograd, without inductor's ~40 s cold C++ build per graph on a small CI machine) for the rest.
On a GPU (tests/gpu/test_compile_gpu.py): the Triton backend, inductor throughout.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_block import check_compiled_matches_eager
from flash_attn_ck import ArgumentError, flash_attn_func, flash_attn_fwd, flash_attn_varlen_func

# ---- CPU: the reference backend -------------------------------------------------------------------

@pytest.mark.parametrize("varlen, dropout_p, compiler", [(False, 0.0, "inductor"), (True, 0.0, "aot_eager"),
                                                          (False, 0.2, "aot_eager")],
                         ids=["batch", "varlen", "batch-dropout"])
def test_block_compiles_and_matches_eager(varlen, dropout_p, compiler):
    # With dropout both runs start from the same seed, so the op draws the same rng_state.
    check_compiled_matches_eager("cpu", torch.float32, "reference", varlen, dropout_p, atol=1e-5, rtol=1e-4,
                                 compiler=compiler)


def outputs_and_grads(fn, q, k, v, extra, dout):
    out = fn(q, k, v, *extra)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def test_dynamic_shapes_compile_once():
    """With symbolic sizes (the fake impls see SymInts, the padded head dim included) one graph serves
    every batch/sequence size; sizes are chosen so no two coincide (no duck-sizing guards).
    aot_eager: it traces the fake impls like inductor does, at a fraction of the compile time."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    def varlen_attention(q, k, v, cu_seqlens, max_seqlen):
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)

    torch._dynamo.reset()
    counters = CompileCounterWithBackend("aot_eager"), CompileCounterWithBackend("aot_eager")
    compiled = [torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
                for fn, counter in zip((attention, varlen_attention), counters)]
    torch.manual_seed(0)
    for (batch, s_q, s_k), lengths in zip([(3, 5, 8), (4, 7, 10), (5, 9, 12)], [[3, 4], [5, 8, 4], [9, 1, 5, 6]]):
        cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        calls = [(attention, compiled[0], ((batch, s_q, 6), (batch, s_k, 2)), ()),
                 (varlen_attention, compiled[1], ((sum(lengths), 6), (sum(lengths), 2)), (cu_seqlens, max(lengths)))]
        for eager, fn, (shape_q, shape_k), extra in calls:
            q, k, v = (torch.randn(*shape, 13, requires_grad=True) for shape in (shape_q, shape_k, shape_k))
            dout = torch.randn(*shape_q, 13)
            for got, expected in zip(outputs_and_grads(fn, q, k, v, extra, dout),
                                     outputs_and_grads(eager, q, k, v, extra, dout)):
                torch.testing.assert_close(got, expected)
    # Dynamo also hands the backend an empty graph; count only the graphs that call the op (inside
    # the autograd Function's forward subgraph).
    def calls_op(graph):
        applies = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.autograd_function_apply]
        return any("flash_attn_ck.fwd" in getattr(graph, n.args[0].target).code for n in applies)
    op_graphs = [[g for g in c.graphs if calls_op(g)] for c in counters]
    assert [len(graphs) for graphs in op_graphs] == [1, 1]


def test_forward_into_out_compiles():
    """flash_attn_fwd(out=) under fullgraph: the fwd_out op declares `out` mutated, so the compiled function
    writes the caller's tensor (here a strided view) with the eager call's values; seqused_k traced along."""
    torch._dynamo.reset()
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    seqused_k = torch.tensor([3, 0, 7], dtype=torch.int32)

    def forward(q, k, v, out):
        return flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7,
                              seqused_k=seqused_k, causal=True, out=out)[1]

    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
    q, k, v = (torch.randn(12, heads, 16) for heads in (4, 2, 2))
    buffer = torch.zeros(12, 8, 16)
    lse = compiled(q, k, v, buffer[:, 1::2])
    expected = flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7,
                              seqused_k=seqused_k, causal=True)
    assert torch.equal(buffer[:, 1::2], expected[0]) and torch.equal(lse, expected[1]) and not buffer[:, ::2].any()


def test_seqused_k_gradients_compile():
    """flash_attn_varlen_func(seqused_k=) under fullgraph: the Function saves seqused_k for the bwd op."""
    torch._dynamo.reset()
    cu = torch.tensor([0, 6, 13], dtype=torch.int32)
    seqused_k = torch.tensor([4, 7], dtype=torch.int32)

    def attention(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, seqused_k=seqused_k)

    q, k, v = (torch.randn(13, heads, 16, requires_grad=True) for heads in (4, 2, 2))
    dout = torch.randn(13, 4, 16)
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    for got, expected in zip(outputs_and_grads(compiled, q, k, v, (), dout),
                             outputs_and_grads(attention, q, k, v, (), dout)):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_one_tensor_as_q_k_v_compiles():
    """Self-attention on one tensor (q is k is v) and one cu_seqlens for both sides: the autograd
    Function gets distinct views (dynamo refuses a Function given one tensor twice), and gradients
    still sum over the three uses."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lengths = [4, 7]
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)

    def attention(x):
        return flash_attn_varlen_func(x, x, x, cu_seqlens, cu_seqlens, max(lengths), max(lengths), causal=True)

    x = torch.randn(sum(lengths), 2, 16, requires_grad=True)
    dout = torch.randn(sum(lengths), 2, 16)
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    got = (compiled(x), *torch.autograd.grad(compiled(x), x, dout))
    x_copies = [x.detach().clone().requires_grad_() for _ in range(3)]
    out = flash_attn_varlen_func(*x_copies, cu_seqlens, cu_seqlens, max(lengths), max(lengths), causal=True)
    expected = (out, sum(torch.autograd.grad(out, x_copies, dout)))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("max_seqlens", [(3, 5), (9, 11), (3, 40)], ids=["exact", "above-total", "k-above"])
def test_varlen_probs_have_the_shape_the_fake_declares(max_seqlens):
    """The fake of the forward op sizes probs as the real op does: max_seqlen bounded by the packed rows (a bound
    above the rows gives the rows' count), so code that reads their shape traces what eager runs."""
    torch._dynamo.reset()
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q, k = torch.randn(5, 2, 8), torch.randn(7, 2, 8)
    cu_k = torch.tensor([0, 2, 7], dtype=torch.int32)

    def probs_shape(q, k):
        _, _, probs = flash_attn_varlen_func(q, k, k, cu, cu_k, *max_seqlens, return_attn_probs=True)
        return probs.new_zeros(probs.shape), probs

    eager_shape, eager_probs = probs_shape(q, k)
    compiled_shape, compiled_probs = torch.compile(probs_shape, backend="aot_eager", fullgraph=True)(q, k)
    assert eager_shape.shape == compiled_shape.shape == compiled_probs.shape == eager_probs.shape
    assert eager_probs.shape == (2, 2, min(max_seqlens[0], 5), min(max_seqlens[1], 7))


def _bad_call(kind: str, q: torch.Tensor):
    """A call with one class of bad structural argument (what the checks of shapes and options refuse)."""
    total = q.shape[0]
    cu = torch.tensor([0, total // 2, total], dtype=torch.int32)
    dense = q.view(1, *q.shape)
    if kind == "varlen without max_seqlen":
        return flash_attn_varlen_func(q, q, q, cu, cu, None, None)
    if kind == "varlen without max_seqlen_k":
        return flash_attn_varlen_func(q, q, q, cu, cu, total, None)
    if kind == "cu_seqlens_k without cu_seqlens_q":
        return flash_attn_fwd(dense, dense, dense, cu_seqlens_k=cu)[0]
    if kind == "dense q with cu_seqlens":
        return flash_attn_fwd(dense, dense, dense, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total,
                              max_seqlen_k=total)[0]
    if kind == "head count":
        return flash_attn_func(dense, dense[:, :, :1].expand(-1, -1, 3, -1), dense)
    raise AssertionError(kind)


@settings(max_examples=10, deadline=None)
@given(kind=st.sampled_from(["varlen without max_seqlen", "varlen without max_seqlen_k",
                             "cu_seqlens_k without cu_seqlens_q", "dense q with cu_seqlens", "head count"]),
       total=st.integers(2, 9))
def test_a_compiled_bad_call_fails_with_the_eager_message(kind, total):
    """Property: a call that eagerly raises ArgumentError fails compiled with that ArgumentError's message (dynamo
    wraps what the fake raises; the fakes run the eager checks of shapes), not an AssertionError or AttributeError
    from inside a fake."""
    q = torch.randn(total, 2, 8)
    with pytest.raises(ArgumentError) as eager:
        _bad_call(kind, q)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:      # noqa: PT011 (dynamo's own wrapper class)
        torch.compile(lambda t: _bad_call(kind, t), backend="aot_eager", fullgraph=True)(q)
    assert str(eager.value) in str(compiled.value), compiled.value
