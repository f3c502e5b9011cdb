"""scripts/workload_waves.py, the wave model behind docs/workloads.md: today's varlen grids and the scheduled
ones carry the same work, and the deterministic model's waits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import workload_waves as ww

from flash_attn_ck.backends.triton.runtime.varlen_schedule import TileWalk


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 700), min_size=1, max_size=12), heads=st.integers(1, 4),
       owns_keys=st.booleans(), window=st.sampled_from([-1, 100]), tile_axis_first=st.booleans())
def test_today_and_scheduled_grids_carry_the_same_work(lengths, heads, owns_keys, window, tile_axis_first):
    costs = ww.Costs(exit_us=0.0)
    walk = TileWalk(128, 64, owns_keys, window, 0)
    now = ww.grid_order(lengths, walk, 1.0, 0.5, heads, costs, tile_axis_first, reverse_tiles=not owns_keys)
    new = ww.scheduled(lengths, walk, 1.0, 0.5, heads, costs)
    tiles = -(-max(lengths) // 128)
    assert len(now) == tiles * len(lengths) * heads
    assert sorted(x for x in now if x) == sorted(x for x in new if x)
    assert new == sorted(new, reverse=True)     # longest first (the padding exits cost nothing here)


@settings(max_examples=30, deadline=None)
@given(tiles=st.integers(1, 12), per_key=st.integers(1, 3), heads=st.integers(1, 4), add=st.sampled_from([0.0, 0.3]))
def test_the_causal_direction_never_waits_with_an_sm_per_cta(tiles, per_key, heads, add):
    """Descending key tiles on enough SMs: tile n reaches each query tile after tile n + 1 did, so no add waits
    and the makespan is the longest CTA (key tile 0) and its last add (each earlier add hides behind a step)."""
    span = ww.deterministic_makespan(tiles, per_key, heads, tiles * heads, True, False, add)
    assert span == pytest.approx(tiles * per_key + add)


@pytest.mark.parametrize("tiles, per_key, heads, sms", [(8, 2, 2, 8), (16, 2, 4, 16), (32, 2, 8, 40)])
def test_ascending_tiles_side_by_side_hold_sms_waiting(tiles, per_key, heads, sms):
    """Ascending order with a head's tiles side by side (today's MHA grid): tile n starts r query tiles later than
    n - 1 but must add after it, so CTAs sit on SMs waiting while other heads' CTAs queue; the causal direction
    or the heads-fastest grid does not (the deterministic causal row of docs/workloads.md)."""
    today = ww.deterministic_makespan(tiles, per_key, heads, sms, False, False, 0.1)
    assert today > 1.2 * ww.deterministic_makespan(tiles, per_key, heads, sms, True, False, 0.1)
    assert today > 1.2 * ww.deterministic_makespan(tiles, per_key, heads, sms, False, True, 0.1)
