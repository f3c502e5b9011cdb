"""Host side of the warp-specialised Gluon kernels (backends/triton/gluon/gluon_common.py), on CPU: which tensors a TMA
descriptor can view in place, and the descriptors themselves (a box of one head, padded to a power of two)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from flash_attn_ck.backends.triton.gluon import gluon_common

HEAD_DIMS = [64, 80, 96, 128, 192, 256]


def _tensor(varlen, rows, heads, d, dtype=torch.bfloat16):
    return torch.empty(rows, heads, d, dtype=dtype) if varlen else torch.empty(2, rows // 2, heads, d, dtype=dtype)


@settings(max_examples=40, deadline=None)
@given(varlen=st.booleans(), rows=st.integers(1, 64).map(lambda r: 2 * r), heads=st.integers(1, 8),
       d=st.sampled_from(HEAD_DIMS), box_rows=st.sampled_from([64, 128]))
def test_a_box_holds_one_head_padded_to_a_power_of_two(varlen, rows, heads, d, box_rows):
    """The descriptor views (rows, heads, d) with the tensor's own strides and a (box_rows, 1, 2^k) box, the
    smallest power of two that holds d, so a head dim that is not a power of two reads as zeros past d in shared
    memory and is written only up to d (TMA's out-of-bounds rule along the last dimension)."""
    t = _tensor(varlen, rows, heads, d)
    desc = gluon_common.descriptor(t, varlen, box_rows)
    box = desc.block_shape[-1]
    assert box >= d and box & (box - 1) == 0 and box < 2 * d
    assert list(desc.shape) == [rows, heads, d]
    assert list(desc.strides) == [heads * d, d, 1]
    assert list(desc.block_shape) == [box_rows, 1, box]
    assert desc.layout.rank == 3 and desc.layout.swizzle_byte_width == 128


LAYOUTS = ["contiguous", "heads-apart", "batch-gap", "offset"]


def _laid_out(varlen, heads, d, layout):
    """16 rows of `heads` x `d` (varlen (16, h, d), else (2, 8, h, d)) in `layout`; "contiguous" is the only one
    whose rows a descriptor can view in place. Returns the layout actually made (a varlen tensor has no batch gap)."""
    base = torch.randn(2 * 10 * heads * d + 8).bfloat16()
    if varlen and layout == "batch-gap":
        layout = "contiguous"   # a varlen tensor has no batch dimension
    if layout == "offset":          # a base 2 bytes past a 16-byte boundary
        t = base[1:1 + 16 * heads * d].view(16, heads, d)
    elif layout == "heads-apart":   # heads not adjacent: a head-major tensor seen row-major
        t = base[:16 * heads * d].view(heads, 16, d).transpose(0, 1)
    elif layout == "batch-gap":     # batch entries with a gap between them
        t = base[:2 * 10 * heads * d].view(2, 10, heads, d)[:, :8]
    else:
        t = base[:16 * heads * d].view(16, heads, d)
    if not varlen and t.dim() == 3:
        t = t.view(2, 8, heads, d) if t.is_contiguous() else t.unflatten(0, (2, 8))
    return t, layout


@settings(max_examples=40, deadline=None)
@given(varlen=st.booleans(), heads=st.integers(2, 6), d=st.sampled_from(HEAD_DIMS), layout=st.sampled_from(LAYOUTS))
def test_only_uniform_aligned_rows_are_viewed_in_place(varlen, heads, d, layout):
    """uniform_rows returns the tensor itself exactly when one descriptor can view its rows (heads adjacent,
    batch entries back to back, 16-byte aligned), else a contiguous, aligned copy with the same values."""
    t, layout = _laid_out(varlen, heads, d, layout)
    viewed = gluon_common.uniform_rows(t, varlen)
    assert (viewed is t) == (layout == "contiguous")
    assert torch.equal(viewed, t)
    assert gluon_common.rows_view(viewed, varlen) is not None and viewed.data_ptr() % 16 == 0


@settings(max_examples=40, deadline=None)
@given(varlen=st.booleans(), heads=st.integers(2, 6), d=st.sampled_from(HEAD_DIMS), layout=st.sampled_from(LAYOUTS),
       box_rows=st.sampled_from([64, 128]))
def test_uniform_descriptor_describes_the_tensor_it_returns(varlen, heads, d, layout, box_rows):
    """uniform_descriptor is uniform_rows and descriptor in one: the tensor itself or its copy, and a descriptor
    over that tensor (never over a tensor it could not view), as descriptor would make it."""
    t, layout = _laid_out(varlen, heads, d, layout)
    viewed, desc = gluon_common.uniform_descriptor(t, varlen, box_rows)
    assert (viewed is t) == (layout == "contiguous")
    assert torch.equal(viewed, t)
    assert desc.base is viewed
    expected = gluon_common.descriptor(viewed, varlen, box_rows)
    assert (desc.shape, desc.strides, desc.block_shape, desc.layout) == \
        (expected.shape, expected.strides, expected.block_shape, expected.layout)
