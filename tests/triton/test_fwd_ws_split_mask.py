"""The warp-specialised forward's split of the key tiles (config.FwdWsTile.split_mask): which key tiles a CTA walks,
and which of them a consumer warpgroup runs without the mask, read from the kernel's own functions run on the host
(gluon_host.py: gluon_common.Mask.key_tiles, fwd_ws._unmasked_tiles) against core/mask.py's rule; and that the
variant compiles for sm_90a with a key-tile loop per consumer that carries no mask code. Its numerics run on the GPU
(scripts/lab/fwd_ws_check.py, scripts/lab/candidates.sh)."""

from __future__ import annotations

import re
import types
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from gluon_compile import TUNED_WITH, compile_spec, fwd_spec, ptxas_report, sass_loops, spill_allowance
from gluon_host import HostMask, on_host

from flash_attn_ck.backends.triton import config
from flash_attn_ck.backends.triton.gluon import fwd_ws
from flash_attn_ck.backends.triton.runtime import triton_versions
from flash_attn_ck.core.mask import MaskInfo

ROWS = 64   # query rows per consumer warpgroup
# (block_m, block_n) of the forward's tiles: two consumers (the table's), three (FA3's d64 shape), 64-key tiles (d256)
SHAPES = [(128, 128), (128, 64), (192, 128), (192, 64)]
unmasked_tiles = on_host(fwd_ws._unmasked_tiles)


def visible(left: int, right: int, top_left: bool, len_q: int, len_k: int, width: int) -> torch.Tensor:
    """core/mask.py's keep matrix of one sequence (-1: no bound on that side), widened to `width` key columns with
    the keys past len_k hidden."""
    align = MaskInfo.top_left if top_left else MaskInfo.bottom_right
    keep = torch.zeros(len_q, width, dtype=torch.bool)
    keep[:, :len_k] = align(left, right, len_q, len_k).keep(torch.arange(len_q), torch.arange(len_k))
    return keep


bound = st.one_of(st.just(-1), st.integers(0, 600))


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700)), min_size=1, max_size=3),
       window=st.one_of(st.tuples(bound, bound), st.just((-1, 0))), top_left=st.booleans(),
       shape=st.sampled_from(SHAPES), overlap=st.booleans())
@example(lengths=[(100, 300), (300, 100)], window=(-1, 0), top_left=False, shape=(128, 128), overlap=True)
@example(lengths=[(384, 384)], window=(64, 32), top_left=False, shape=(128, 128), overlap=True)
@example(lengths=[(300, 200)], window=(17, -1), top_left=True, shape=(192, 64), overlap=False)
@example(lengths=[(200, 200), (0, 50), (64, 0), (1, 1)], window=(-1, -1), top_left=False, shape=(128, 128),
         overlap=True)
def test_each_key_tile_is_skipped_masked_or_unmasked_as_the_mask_says(lengths, window, top_left, shape, overlap):
    """Property, per sequence of a (varlen) call and per query tile: the CTA walks every key tile in which one of its
    rows sees a key (the others are skipped, but for a tile key_range's rounding may add where a left window starts
    at or past len_k); each consumer warpgroup runs without the mask exactly the walked tiles whose every key each of
    its rows sees (in full, inside len_k), and every other walked tile (one with a key hidden from a row: the
    diagonal, a window's edge, the tile across len_k, or a tile no row of the warpgroup sees) with it. With OVERLAP
    the first tile runs before the split and tests at run time whether it needs the mask: it must, when one of its
    keys is hidden from a row."""
    block_m, block_n = shape
    left, right = window
    mask = HostMask(left, right, top_left)
    consts = types.SimpleNamespace(ROWS=ROWS, BLOCK_N=block_n)
    start = 1 if overlap else 0
    for len_q, len_k in lengths:
        shift = mask.shift(len_q, len_k)
        key_tiles = -(-len_k // block_n) + 1
        keep = visible(left, right, top_left, len_q, len_k, key_tiles * block_n).unflatten(1, (key_tiles, block_n))
        for m0_cta in range(0, len_q, block_m):
            n_lo, n_tiles = mask.key_tiles(m0_cta, len_q, len_k, shift, block_m, block_n)
            assert n_lo % block_n == 0 and n_tiles >= 0
            walked = range(n_lo // block_n, n_lo // block_n + n_tiles)
            seen = keep[m0_cta:m0_cta + block_m].any(dim=2).any(dim=0)
            assert set(seen.nonzero().flatten().tolist()) <= set(walked), (m0_cta, n_lo, n_tiles)
            if n_tiles < start:
                continue   # the kernel's OVERLAP path runs no key tile then
            for m0 in range(m0_cta, min(m0_cta + block_m, len_q), ROWS):
                first, end = unmasked_tiles(consts, mask, m0, len_q, len_k, shift, n_lo, n_tiles, start)
                assert start <= first <= end <= n_tiles
                full = keep[m0:m0 + ROWS].all(dim=2).all(dim=0)
                unmasked = {j for j in range(n_tiles) if full[n_lo // block_n + j]}
                assert set(range(first, end)) == unmasked - set(range(start)), (m0, n_lo, n_tiles, first, end)
                for j in range(start):
                    if j not in unmasked:
                        assert mask.tile_needs_mask(m0, n_lo + j * block_n, len_k, shift, ROWS, block_n)


def test_the_option_reads_and_prints_as_a_tile_flag():
    """FwdWsTile.parse takes split_mask as the seventh flag and str writes it back; off by default, and off in every
    tile of the table."""
    tile = config.FwdWsTile.parse("128x128x2x1x1x0x1")
    assert tile.split_mask and not tile.query_major and str(tile) == "128x128x2x1x1x0x1"
    assert config.FwdWsTile.parse(str(replace(tile, query_major=True))) == replace(tile, query_major=True)
    assert not config.FwdWsTile(128, 128).split_mask
    assert not any(t.split_mask for by_causal in config.FWD_WS_SM90.values() for t in by_causal.values())


# ---- the variant compiles for sm_90a here (no GPU: ptxas and cuobjdump from the triton wheel) -------------------
def _fsel(body: list[str]) -> int:
    return sum(1 for text in body if re.search(r"\bFSEL\b", text))


def _local(body: list[str]) -> int:
    """Local-memory (stack) accesses: spilled registers."""
    return sum(1 for text in body if re.search(r"\b(STL|LDL)\b", text))


COMPILED = [   # head dim, tile, varlen, masks (TOP_LEFT, HAS_LEFT, HAS_RIGHT), loops per consumer with the split
    (128, config.FWD_WS_SM90[128][True], False, (False, False, True), 2),
    (128, config.FWD_WS_SM90[128][False], False, (False, False, False), 2),
    (128, config.FWD_WS_SM90[128][True], True, (True, True, True), 3),
    (64, config.FwdWsTile(192, 128, overlap=False, consumers=3), True, (False, False, True), 2),
]


@pytest.mark.parametrize("head_dim,tile,varlen,masks,loops", COMPILED,
                         ids=["d128-causal", "d128-dense", "d128-varlen-window", "d64-three-consumers-causal"])
def test_the_unmasked_loop_carries_no_mask_code(head_dim, tile, varlen, masks, loops):
    """With split_mask each consumer walks its key tiles in `loops` loops (masked before, unmasked, masked after; the
    first when the mask has a left bound), and the unmasked loop has none of the mask's per-score selects: fewer
    FSEL than a thread's share of the S tile, and fewer instructions than any key-tile loop of the kernel without
    the split. The unmasked loop touches the stack no more than the loops without the split (under the ptxas the
    tiles were tuned with, no loop touches it); around the loops the split keeps a few more words there."""
    scores_per_thread = ROWS * tile.block_n // 128
    split = compile_spec(fwd_spec(replace(tile, split_mask=True), head_dim, varlen, masks))
    plain = compile_spec(fwd_spec(tile, head_dim, varlen, masks))
    plain_loops, split_loops = sass_loops(plain.asm["cubin"]), sass_loops(split.asm["cubin"])
    assert len(plain_loops) == tile.consumers and len(split_loops) == loops * tile.consumers
    unmasked = [body for body in split_loops if _fsel(body) < scores_per_thread]
    assert len(unmasked) == tile.consumers
    assert max(map(len, unmasked)) < min(map(len, plain_loops))
    assert all(_fsel(body) >= scores_per_thread for body in split_loops if body not in unmasked)
    assert max(map(_local, unmasked)) <= min(map(_local, plain_loops))
    if triton_versions.release(triton_versions.installed()) == TUNED_WITH:
        assert not any(map(_local, split_loops))
    assert ptxas_report(split.asm["ptx"])["spill_stores"] <= spill_allowance(24)
