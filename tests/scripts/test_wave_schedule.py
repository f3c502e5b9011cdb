"""scripts/wave_schedule.py, the model behind the longest-first grids (WsTile.key_major / FwdWsTile.query_major)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "wave_schedule.py"
_spec = importlib.util.spec_from_file_location("wave_schedule", _SCRIPT)
wave_schedule = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wave_schedule)


@settings(max_examples=50, deadline=None)
@given(count=st.integers(1, 500), length=st.integers(1, 50), sms=st.integers(1, 140))
def test_equal_ctas_take_whole_waves(count, length, sms):
    assert wave_schedule.makespan([length] * count, sms) == -(-count // sms) * length


@settings(max_examples=50, deadline=None)
@given(tiles=st.integers(1, 80), heads=st.integers(1, 40), sms=st.integers(1, 140), group=st.integers(1, 8))
@example(tiles=1, heads=4, sms=3, group=1)   # four equal CTAs on three SMs: two lengths, 3/2 of the ideal
def test_a_causal_grid_runs_longest_first_key_major(tiles, heads, sms, group):
    """Under a causal mask the key-major order is longest-first (LPT), so the CTA that ends the launch started by
    the ideal (total / SMs) and is no longer than the (SMs + 1)-th longest, or is one of the first wave: the makespan
    is at most max(longest, total / SMs + the (SMs + 1)-th longest). (Graham's 4/3 bound is against the best
    schedule, not against the ideal: SMs + 1 equal CTAs take two of their lengths.)"""
    tile_major, key_major = wave_schedule.orders(tiles, heads, lambda n: group * (tiles - n))
    assert sorted(tile_major) == sorted(key_major) and key_major == sorted(key_major, reverse=True)
    tail = key_major[sms] if len(key_major) > sms else 0
    assert wave_schedule.makespan(key_major, sms) <= max(key_major[0], sum(key_major) / sms + tail) + 1e-9
