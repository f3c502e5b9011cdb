"""MaskInfo against CK's mask_identify strings and a brute-force statement of the keep rule, for each mask kind."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_attn_ck.core.mask import API_MASK_KINDS, MaskInfo, MaskKind, MaskType, canonical_window

# (spec, s_q, s_k) -> (type, left, right, y, x), worked out by hand from CK's mask.hpp rules. The
# strings are those flash-attention's CK frontend writes as mask_identify: "0" and "b:L,R".
DECODE_TABLE = [
    ("0", 8, 8, (MaskType.NO_MASK, -1, -1, 8, 8)),
    ("b:2,1", 5, 7, (MaskType.BOTTOM_RIGHT, 2, 1, 1, 4)),
    ("b:-1,0", 5, 7, (MaskType.BOTTOM_RIGHT, -1, 0, 5, 3)),
    ("b:-1,0", 4, 6, (MaskType.BOTTOM_RIGHT, -1, 0, 4, 3)),
]


@pytest.mark.parametrize("spec,s_q,s_k,expected", DECODE_TABLE)
def test_decode_table(spec, s_q, s_k, expected):
    m = MaskInfo.decode(spec, s_q, s_k)
    assert (m.type, m.left, m.right, m.y, m.x) == expected


@pytest.mark.parametrize("spec", ["b:1", "q:1,2", "b:a,2", "7", "xt:"])
def test_decode_rejects_malformed(spec):
    with pytest.raises(ValueError, match=r"mask spec|MaskType"):
        MaskInfo.decode(spec, 4, 4)


def brute_force_keep(s_q, s_k, causal, left, right, top_left=False):
    """docs/semantics.md §Masks in words, flash-attn's documented interval with no normalisation: row i
    attends j in [i + s_k - s_q - left, i + s_k - s_q + right], -1 unbounded, causal -> right = 0;
    top-left alignment puts row i's diagonal at key i."""
    keep = torch.zeros(s_q, s_k, dtype=torch.bool)
    if causal:
        right = 0
    for i in range(s_q):
        for j in range(s_k):
            diag = i if top_left else i + s_k - s_q
            keep[i, j] = (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
    return keep


@settings(max_examples=300, deadline=None)
@given(s_q=st.integers(1, 24), s_k=st.integers(1, 24), causal=st.booleans(),
       left=st.integers(-1, 30), right=st.integers(-1, 30), extra_q=st.integers(0, 8), extra_k=st.integers(0, 8))
def test_keep_rule_matches_brute_force(s_q, s_k, causal, left, right, extra_q, extra_k):
    # Built from bounds of the lengths (varlen: max_seqlen), applied to a sequence of lengths (s_q, s_k).
    mask = MaskInfo.from_flash_args(causal, (left, right), s_q + extra_q, s_k + extra_k).for_lengths(s_q, s_k)
    keep = mask.keep(torch.arange(s_q), torch.arange(s_k))
    assert torch.equal(keep, brute_force_keep(s_q, s_k, causal, left, right))
    # Only type, left and right reach a CK kernel, which rebuilds (y, x) itself: they alone must give the mask.
    assert torch.equal(ck_kernel_keep(mask.type, mask.left, mask.right, s_q, s_k), keep)


@settings(max_examples=200, deadline=None)
@given(s_q=st.integers(1, 24), s_k=st.integers(1, 24), left=st.integers(-1, 30), right=st.integers(-1, 30),
       extra_q=st.integers(0, 8), extra_k=st.integers(0, 8))
def test_top_left_keep_rule_matches_brute_force(s_q, s_k, left, right, extra_q, extra_k):
    if left < 0 and right < 0:
        right = 0       # a window with neither side bounded is no mask, which the constructors never make
    mask = MaskInfo.top_left(left, right, s_q + extra_q, s_k + extra_k).for_lengths(s_q, s_k)
    keep = mask.keep(torch.arange(s_q), torch.arange(s_k))
    assert torch.equal(keep, brute_force_keep(s_q, s_k, False, left, right, top_left=True))
    assert torch.equal(ck_kernel_keep(mask.type, mask.left, mask.right, s_q, s_k), keep)


@settings(max_examples=200, deadline=None)
@given(s_q=st.integers(1, 24), s_k=st.integers(1, 24), y=st.integers(-30, 30), x=st.integers(-30, 30),
       extra_q=st.integers(0, 8))
def test_generic_window_keeps_its_coordinates_for_every_length(s_q, s_k, y, x, extra_q):
    """CK's generic (y, x): row i keeps keys i + 1 - y <= j < i + x, whatever the lengths it is applied to."""
    mask = MaskInfo.generic(y, x, s_q + extra_q, s_k).for_lengths(s_q, s_k)
    i, j = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
    assert torch.equal(mask.keep(torch.arange(s_q), torch.arange(s_k)), (j >= i + 1 - y) & (j < i + x))


@settings(max_examples=300, deadline=None)
@given(s_q=st.integers(1, 24), s_k=st.integers(1, 24), causal=st.booleans(), left=st.integers(-1, 30),
       right=st.integers(-1, 30), top_left=st.booleans())
def test_kind_names_the_keep_rule(s_q, s_k, causal, left, right, top_left):
    """flash-attn's arguments make only the API kinds; a mask's kind is causal exactly when it keeps the
    causal rule of its alignment, none exactly when it keeps every key."""
    mask = MaskInfo.from_flash_args(causal, (left, right), s_q, s_k)
    assert mask.kind in API_MASK_KINDS
    if top_left and mask.is_masked:
        mask = MaskInfo.top_left(mask.left, mask.right, s_q, s_k)
    keep = mask.keep(torch.arange(s_q), torch.arange(s_k))
    causal_keep = brute_force_keep(s_q, s_k, True, -1, 0, top_left=mask.type == MaskType.TOP_LEFT)
    assert (mask.kind in (MaskKind.CAUSAL, MaskKind.CAUSAL_TOP_LEFT)) == (mask.left < 0 and mask.right == 0)
    if mask.kind in (MaskKind.CAUSAL, MaskKind.CAUSAL_TOP_LEFT):
        assert torch.equal(keep, causal_keep)
    assert (mask.kind == MaskKind.NONE) == (not mask.is_masked)
    assert (mask.kind in (MaskKind.CAUSAL_TOP_LEFT, MaskKind.WINDOW_TOP_LEFT)) == (mask.type == MaskType.TOP_LEFT)


def ck_kernel_keep(mtype, left, right, s_q, s_k):
    """What a CK kernel keeps given only (type, left, right): CK's mask_info rules written out here
    (docs/semantics.md §Masks), independent of MaskInfo's stored (y, x)."""
    if mtype == MaskType.NO_MASK:
        return torch.ones(s_q, s_k, dtype=torch.bool)
    top_left = mtype == MaskType.TOP_LEFT
    left = (s_q - 1 if top_left else s_k - 1) if left < 0 else left
    right = (s_k - 1 if top_left else s_q - 1) if right < 0 else right
    x = 1 + right + (0 if top_left else s_k - s_q)
    y = 1 + left + (0 if top_left else s_q - s_k)
    assert x + y > 1, "CK requires x + y > 1"
    i, j = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
    return (j >= i + 1 - y) & (j < torch.minimum(i + x, torch.tensor(s_k)))


def test_normalisation_drops_only_redundant_sides():
    assert canonical_window(True, (-1, -1), 10, 10) == (-1, 0)
    assert canonical_window(False, (9, 3), 10, 10) == (-1, 3)     # left >= s_k - 1 -> unbounded
    assert canonical_window(False, (8, 3), 10, 10) == (8, 3)
    assert canonical_window(False, (2, 9), 10, 10) == (2, -1)     # right >= s_q - 1 -> unbounded
    # s_q > s_k: right = 5 >= s_k is NOT unbounded (flash-attention's CK frontend drops it).
    assert canonical_window(False, (1, 5), 10, 3) == (1, 5)
    assert not MaskInfo.from_flash_args(False, (1, 5), 10, 3).keep(torch.arange(10), torch.arange(3))[0].any()
    assert canonical_window(False, (1, 9), 10, 3) == (1, -1)
    assert MaskInfo.from_flash_args(False, (20, 20), 5, 10).type == MaskType.NO_MASK
    causal = MaskInfo.from_flash_args(True, (-1, -1), 5, 10)
    assert causal.type == MaskType.BOTTOM_RIGHT and causal.is_causal
    local = MaskInfo.from_flash_args(False, (3, 0), 5, 10)
    assert local.type == MaskType.BOTTOM_RIGHT and (local.left, local.right) == (3, 0)


def test_for_lengths_realigns_bottom_right_per_sequence():
    mask = MaskInfo.from_flash_args(True, (-1, -1), 16, 16)       # built from the max lengths
    short = mask.for_lengths(3, 7)
    assert torch.equal(short.keep(torch.arange(3), torch.arange(7)), brute_force_keep(3, 7, True, -1, 0))
