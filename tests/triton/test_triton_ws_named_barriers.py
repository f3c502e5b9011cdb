"""CPU tests of config.WsTile.named_barriers (bwd_ws.py's hand-offs by hardware named barriers): the sm_90a compile of
the option's kernels passes fewer barriers of the whole MMA partition per step than the default's, spills no more,
and uses barrier ids that Triton's own code leaves free; the tile spells and checks the flag."""

from __future__ import annotations

import copy
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from gluon_compile import bwd_spec, compile_spec, ptxas_report  # noqa: E402

from flash_attn_ck.backends.triton import config  # noqa: E402

UNSPLIT = [d for d, tile in sorted(config.BWD_WS_SM90.items()) if not tile.split_d]
# (varlen, (TOP_LEFT, HAS_LEFT, HAS_RIGHT), deterministic)
CALLS = {"dense": (False, (False, False, False), False), "causal": (False, (False, False, True), False),
         "varlen-window-det": (True, (False, True, True), True)}
BARRIER = re.compile(r"\b(?:bar|barrier)(?:\.cta)?\.(sync|arrive|red)(?:\.aligned)?(?:\.\w+)*\s+([%\w]+)(?:,\s*(\d+))?")


def barriers(ptx: str, op: str, threads: int) -> int:
    """How many `op` (sync, arrive) instructions of the PTX wait for `threads` threads."""
    return sum(1 for found in BARRIER.finditer(ptx) if found.group(1) == op and found.group(3) == str(threads))


def constant_ids(ptx: str) -> set[int]:
    """The barrier ids the PTX names as constants (a register id is one of the option's)."""
    return {int(found.group(2)) for found in BARRIER.finditer(ptx) if found.group(2).isdigit()}


def _compile(tile, head_dim, call):
    return compile_spec(bwd_spec(tile, head_dim, *CALLS[call][:2], deterministic=CALLS[call][2]))


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("head_dim", UNSPLIT)
def test_named_barriers_take_two_partition_barriers_out_of_each_step(head_dim, call):
    """The default's MMA partition passes four barriers of its threads a step (the dS^T hand-over between its
    warpgroups, the dQ hand-off's, and Triton's two around the slot's one-thread mbarrier arrive); with the option, two
    (dS^T's, and Triton's before the next step's dS^T store overwrites what the dQ matmul read), and each step arrives
    on two named barriers that the loader and the writer wait on with the partition."""
    default = config.BWD_WS_SM90[head_dim]
    named = replace(default, named_barriers=True)
    mma_threads, with_worker = 32 * default.num_warps, 32 * (default.num_warps + 1)
    before, after = (_compile(tile, head_dim, call).asm["ptx"] for tile in (default, named))
    assert barriers(before, "sync", mma_threads) - barriers(after, "sync", mma_threads) == 2
    assert barriers(before, "arrive", with_worker) == barriers(before, "sync", with_worker) == 0
    assert barriers(after, "arrive", with_worker) == 2   # a slot's release, the dQ hand-off
    assert barriers(after, "sync", with_worker) == 3     # the loader's (in the loop and after it), the writer's
    spills_before, spills_after = ptxas_report(before), ptxas_report(after)
    assert spills_after["spill_stores"] <= spills_before["spill_stores"], (spills_before, spills_after)


@pytest.mark.parametrize("head_dim", UNSPLIT)
def test_tritons_own_barrier_ids_stay_below_the_options(head_dim):
    """Triton's partitions and warp specialisation name their barriers by constant ids below NAMED_BARRIER_FIRST; the
    option's are computed from it (registers) or fold to constants at or above it."""
    tile = config.BWD_WS_SM90[head_dim]
    default = _compile(tile, head_dim, "causal").asm["ptx"]
    assert constant_ids(default) and max(constant_ids(default)) < config.NAMED_BARRIER_FIRST
    named = _compile(replace(tile, named_barriers=True), head_dim, "causal").asm["ptx"]
    assert constant_ids(named) - constant_ids(default) <= set(range(config.NAMED_BARRIER_FIRST,
                                                                      config.NAMED_BARRIER_COUNT))


def test_the_tile_spells_the_flag():
    tile = replace(config.BWD_WS_SM90[128], named_barriers=True)
    assert str(tile) == "64x128x2x1x8x0x0x1"
    assert config.WsTile.parse(str(tile)) == tile
    assert config.WsTile.parse(str(config.BWD_WS_SM90[64])) == config.BWD_WS_SM90[64]


@given(stages=st.integers(1, 12), dq_stages=st.integers(1, 12))
def test_named_barriers_need_a_barrier_per_stage(stages, dq_stages):
    fits = config.NAMED_BARRIER_FIRST + stages + dq_stages <= config.NAMED_BARRIER_COUNT
    if fits:
        assert config.WsTile(64, 128, stages, dq_stages, named_barriers=True).named_barriers
    else:
        with pytest.raises(ValueError, match=r"num_stages \+ dq_stages"):
            config.WsTile(64, 128, stages, dq_stages, named_barriers=True)
    assert not config.WsTile(64, 128, stages, dq_stages).named_barriers   # without the flag any depth goes


def test_the_split_kernel_refuses_named_barriers():
    with pytest.raises(ValueError, match=r"named_barriers.*split_d=False"):
        replace(config.BWD_WS_SM90[256], named_barriers=True)


def test_launch_compare_takes_the_flag_off_for_the_launches_of_a_tree_without_it():
    """scripts/launch_compare.py: a bwd_ws launch whose tile has named_barriers off matches an older tree's launch
    without the field; on, it differs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from launch_compare import compare

    old = {"launches": [{"kernel": "attn_bwd_ws_kernel", "grid": [4, 1, 2], "options": {"num_warps": 8},
                         "runtime": [], "constexprs": {"BLOCK_M": 64, "KEY_MAJOR": False}}]}
    for named in (False, True):
        new = copy.deepcopy(old)
        new["launches"][0]["constexprs"]["NAMED_BARRIERS"] = named
        found, intended = compare(old, new)
        assert (found == [] and len(intended) == 1) if not named else any("NAMED_BARRIERS" in f for f in found)
