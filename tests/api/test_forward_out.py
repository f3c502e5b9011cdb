"""`flash_attn_fwd(out=)`: the forward writes the caller's tensor and returns it as `out`.

- A good out (q's shape, dtype and device, unit last stride, any other strides): written in place, bit-identical
  to the allocating call, nothing outside its view touched; head dims that the kernels pad included.
- A bad one (dtype, shape, device, strides, stride 0, memory shared with any input, gradients): `ArgumentError`
  naming `out` and what was expected, raised before anything is written (no input, no out, not torch's
  generator changed).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_edge_cases import SETTINGS

import flash_attn_ck as fa


def _call(draw, dtype=torch.float64):
    """q, k, v and the options of a small batch or varlen call (varlen: rows after the last sequence)."""
    varlen = draw(st.booleans())
    h, h_k = draw(st.sampled_from([(2, 2), (4, 2)]))
    d = draw(st.sampled_from([8, 12]))          # 12: the kernels write a padded buffer, copied into out
    gen = torch.Generator().manual_seed(draw(st.integers(0, 100)))
    options = dict(causal=draw(st.booleans()), backend="reference")
    if varlen:
        lengths = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=3))
        extra = draw(st.integers(0, 2))
        rows_q, rows_k = (sum(s for s, _ in lengths) + extra,), (sum(s for _, s in lengths) + extra,)
        for side, index in (("q", 0), ("k", 1)):
            options[f"cu_seqlens_{side}"] = torch.tensor([0, *torch.tensor([s[index] for s in lengths]).cumsum(0)],
                                                         dtype=torch.int32)
            options[f"max_seqlen_{side}"] = max(s[index] for s in lengths)
    else:
        b = draw(st.integers(1, 2))
        rows_q, rows_k = (b, draw(st.integers(1, 5))), (b, draw(st.integers(1, 5)))
    q = torch.randn(*rows_q, h, d, generator=gen, dtype=dtype)
    k, v = (torch.randn(*rows_k, h_k, d, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v, options


def _strided_like(q: torch.Tensor, layout: str, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the buffer, an out view of it shaped like q with a unit last stride), the buffer filled with `fill`."""
    *rows, h, d = q.shape
    if layout == "contiguous":
        base = torch.full(q.shape, fill, dtype=q.dtype)
        return base, base
    if layout == "every_other_head":
        base = torch.full((*rows, 2 * h, d), fill, dtype=q.dtype)
        return base, base[..., ::2, :]
    if layout == "wider_rows":
        base = torch.full((*rows, h, d + 5), fill, dtype=q.dtype)
        return base, base[..., :d]
    base = torch.full((h, *rows, d), fill, dtype=q.dtype)          # heads outermost: (b, s, h, d) as a transpose
    return base, base.movedim(0, -2)


def _in_view(q: torch.Tensor, layout: str) -> torch.Tensor:
    """The elements of `_strided_like`'s buffer that its out view covers."""
    base, view = _strided_like(q, layout, 0.0)
    view.fill_(1.0)
    return base == 1.0


@settings(max_examples=80, **SETTINGS)
@given(data=st.data(), layout=st.sampled_from(["contiguous", "every_other_head", "wider_rows", "heads_outermost"]),
       dropout=st.booleans(), probs=st.booleans())
def test_out_is_written_in_place_and_equals_the_allocating_call(data, layout, dropout, probs):
    q, k, v, options = _call(data.draw)
    if dropout:     # a given pattern, so both calls drop the same entries
        options.update(dropout_p=0.3, rng_state=torch.tensor([7, 64], dtype=torch.int64))
    expected = fa.flash_attn_fwd(q, k, v, return_attn_probs=probs, **options)
    base, out = _strided_like(q, layout, 3.0)
    result = fa.flash_attn_fwd(q, k, v, out=out, return_attn_probs=probs, **options)
    assert result[0] is out
    for got, want in zip(result, expected):
        assert (got is None and want is None) or torch.equal(got, want)
    assert (base[~_in_view(q, layout)] == 3.0).all(), "an element outside out's view was written"


def _sharing(shape, dtype: torch.dtype, count: int, other_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An out of `shape` and a `(count,)` tensor of `other_dtype` whose first element lies in out's last one."""
    size, other_size = dtype.itemsize, other_dtype.itemsize
    nbytes = math.prod(shape) * size
    raw = torch.zeros(nbytes + count * other_size, dtype=torch.uint8)
    start = (nbytes - size) // other_size * other_size
    return raw[:nbytes].view(dtype).view(shape), raw[start:start + count * other_size].view(other_dtype)


# A bad out -> what the message says after "out: ".
BAD_OUT = {
    "not_a_tensor": "expected a torch.Tensor", "dtype": "expected dtype float32", "shape": "expected shape",
    "meta": "a meta tensor has no data", "last_stride": "expected a contiguous last dimension",
    "stride_0": "an output must not have overlapping elements", "is_q": "shares memory with q",
    "overlaps_q": "shares memory with q", "overlaps_q_other_storage": "shares memory with q",
    "sparse": r"expected a dense \(strided\) tensor, got layout sparse_coo",
    "overlaps_alibi_slopes": "shares memory with alibi_slopes",
    "overlaps_rng_state": "shares memory with rng_state", "overlaps_cu_seqlens_k": "shares memory with cu_seqlens_k",
    "overlaps_seqused_k": "shares memory with seqused_k", "requires_grad": "the forward into a given out is not "
    "differentiable", "input_requires_grad": "the forward into a given out is not differentiable",
    "alibi_requires_grad": "the forward into a given out is not differentiable",
    "inference": "an inference tensor",
}


def _overlapping_q(q, out, options):
    flat = torch.randn(2 * q.numel())
    return flat[:q.numel()].view(q.shape), flat[q.numel() - 1:-1].view(q.shape)


def _overlapping_q_other_storage(q, out, options):      # two storages over one buffer (views of one numpy array)
    flat = torch.randn(2 * q.numel()).numpy()
    return (torch.from_numpy(flat[:q.numel()]).view(q.shape),
            torch.from_numpy(flat[q.numel() - 1:-1]).view(q.shape))


def _sharing_alibi_slopes(q, out, options):
    out, options["alibi_slopes"] = _sharing(q.shape, q.dtype, q.shape[-2], torch.float32)
    return q, out


def _sharing_rng_state(q, out, options):
    out, rng_state = _sharing(q.shape, q.dtype, 2, torch.int64)
    options.update(dropout_p=0.2, rng_state=rng_state)
    return q, out


def _sharing_sequence_tensor(name):
    def make(q, out, options):
        given = options["cu_seqlens_k"] if name == "cu_seqlens_k" else torch.zeros(len(options["cu_seqlens_k"]) - 1)
        out, options[name] = _sharing(q.shape, q.dtype, given.numel(), torch.int32)
        options[name].copy_(given)          # valid values: only the sharing is wrong
        return q, out
    return make


def _input_requiring_grad(q, out, options):
    return q.requires_grad_(), out


def _inference_out(q, out, options):
    with torch.inference_mode():
        return q, torch.full_like(q, 3.0)


def _alibi_requiring_grad(q, out, options):      # the slopes would otherwise carry a graph into out
    options["alibi_slopes"] = torch.rand(q.shape[-2]).requires_grad_()
    return q, out


# Per kind of bad out: (q, a valid out like it, the call's options) -> (q, the bad out); the options are updated
# where the out shares memory with one of them.
_BAD_OUTS = {
    "not_a_tensor": lambda q, out, options: (q, q.tolist()),
    "dtype": lambda q, out, options: (q, out.double()),
    "shape": lambda q, out, options: (q, out[..., :1, :] if q.shape[-2] > 1 else out.unsqueeze(0)),
    "meta": lambda q, out, options: (q, out.to("meta")),
    "last_stride": lambda q, out, options: (q, torch.stack([out, out], -1)[..., 0]),
    # over two heads at least: elements overlap
    "stride_0": lambda q, out, options: (q, torch.zeros(q.shape[-1]).expand(q.shape)),
    "is_q": lambda q, out, options: (q, q),
    "overlaps_q": _overlapping_q,
    "overlaps_q_other_storage": _overlapping_q_other_storage,
    "sparse": lambda q, out, options: (q, out.to_sparse()),
    "overlaps_alibi_slopes": _sharing_alibi_slopes,
    "overlaps_rng_state": _sharing_rng_state,
    "overlaps_cu_seqlens_k": _sharing_sequence_tensor("cu_seqlens_k"),
    "overlaps_seqused_k": _sharing_sequence_tensor("seqused_k"),
    "requires_grad": lambda q, out, options: (q, out.requires_grad_()),
    "input_requires_grad": _input_requiring_grad,
    "inference": _inference_out,
    "alibi_requires_grad": _alibi_requiring_grad,
}
assert set(_BAD_OUTS) == set(BAD_OUT), "a maker per kind of bad out"


@settings(max_examples=120, **SETTINGS)
@given(data=st.data(), bad=st.sampled_from(sorted(BAD_OUT)))
def test_a_bad_out_is_named_before_anything_is_written(data, bad):
    q, k, v, options = _call(data.draw, torch.float32)
    assume(q.numel() > 0)       # an empty out shares no memory with anything
    varlen = "cu_seqlens_q" in options
    if bad in ("overlaps_cu_seqlens_k", "overlaps_seqused_k") and not varlen:
        bad = "overlaps_q"
    q, out = _BAD_OUTS[bad](q, torch.full_like(q, 3.0), options)
    tensors = [t for t in (q, k, v, out, *options.values())
               if torch.is_tensor(t) and t.device.type != "meta" and t.layout == torch.strided]
    before = [t.detach().clone() for t in tensors]
    generator = torch.get_rng_state()
    with pytest.raises(fa.ArgumentError, match=f"^out: {BAD_OUT[bad]}"):
        fa.flash_attn_fwd(q, k, v, out=out, **options)
    assert all(torch.equal(t, saved) for t, saved in zip(tensors, before)), "a tensor was written"
    assert torch.equal(torch.get_rng_state(), generator), "torch's generator advanced"


_TRITON_RUNNER = r"""
import torch
from flash_attn_ck.backends.triton import TritonBackend
TritonBackend.device_types = frozenset({"cuda", "cpu"})
import flash_attn_ck as fa
import test_forward_out as t
gen = torch.Generator().manual_seed(0)
cu = torch.tensor([0, 5, 5, 17], dtype=torch.int32)
for d in (16, 12):     # 12: a padded head dim, copied from the kernels' buffer
    dense = [torch.randn(2, 9, 4, d, generator=gen).half(), *(torch.randn(2, 13, 2, d, generator=gen).half()
                                                             for _ in range(2))]
    packed = [torch.randn(19, 4, d, generator=gen).half(), *(torch.randn(19, 2, d, generator=gen).half()
                                                             for _ in range(2))]
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12, max_seqlen_k=12)    # rows 17, 18: in no sequence
    for (q, k, v), options in ((dense, {}), (packed, varlen)):
        expected = fa.flash_attn_fwd(q, k, v, causal=True, backend="triton", **options)
        for layout in ("every_other_head", "wider_rows", "heads_outermost"):
            base, out = t._strided_like(q, layout, 3.0)
            result = fa.flash_attn_fwd(q, k, v, causal=True, backend="triton", out=out, **options)
            assert result[0] is out and torch.equal(out, expected[0]) and torch.equal(result[1], expected[1]), layout
            assert (base[~t._in_view(q, layout)] == 3.0).all(), layout
print("PASS")
"""


def test_triton_interpreter_writes_a_strided_out():
    """The Triton forward kernel takes out's strides (launch.rows3): views are written in place, nothing else."""
    pytest.importorskip("triton")
    from test_triton_interpret import _INTERPRETER_PATCH, _interpret
    _interpret(_INTERPRETER_PATCH + _TRITON_RUNNER, "")
