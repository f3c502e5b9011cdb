"""backends/triton/runtime/varlen_schedule.py on CPU: the plain-Python schedule against brute force (the project's
mask), and both device builders (torch ops; the Triton kernel under TRITON_INTERPRET=1, in a subprocess) against it,
over cu_seqlens with empty and 1-token sequences (hypothesis). The sm_90a build is checked with ptxas."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cases import cumulative

pytest.importorskip("triton")
from flash_attn_ck.backends.triton.runtime import varlen_schedule as vs
from flash_attn_ck.core.mask import MaskInfo

ROOT = Path(__file__).resolve().parents[2]

lengths = st.lists(st.integers(0, 300) | st.sampled_from([0, 1]), min_size=0, max_size=12)
walks = st.builds(vs.TileWalk, own_block=st.sampled_from([1, 16, 64, 128]), walk_block=st.sampled_from([1, 32, 64]),
                  owns_keys=st.booleans(), left=st.integers(-1, 200), right=st.integers(-1, 40),
                  top_left=st.booleans())


def brute_steps(len_q: int, len_k: int, tile: int, walk: vs.TileWalk) -> int:
    """Walked tiles holding any pair the mask keeps with a row of the owned tile."""
    if walk.top_left:   # the same window with no bottom-right shift: an s x s mask over the longer side
        side = max(len_q, len_k)
        keep = MaskInfo.bottom_right(walk.left, walk.right, side, side).keep(torch.arange(side), torch.arange(side))
        keep = keep[:len_q, :len_k]
    else:
        mask = MaskInfo.bottom_right(walk.left, walk.right, len_q, len_k)
        keep = mask.keep(torch.arange(len_q), torch.arange(len_k))
    if walk.owns_keys:
        keep = keep.T
    own = keep[tile * walk.own_block:(tile + 1) * walk.own_block].any(dim=0)
    return len({int(i) // walk.walk_block for i in torch.nonzero(own).flatten()})


@settings(max_examples=150, deadline=None)
@given(len_q=st.integers(0, 90), len_k=st.integers(0, 90), walk=walks, data=st.data())
def test_item_steps_count_the_walked_tiles_the_mask_reaches(len_q, len_k, walk, data):
    own_len = len_k if walk.owns_keys else len_q
    if own_len == 0:
        return
    tile = data.draw(st.integers(0, -(-own_len // walk.own_block) - 1))
    assert vs.item_steps(len_q, len_k, tile, walk) == brute_steps(len_q, len_k, tile, walk)


@settings(max_examples=100, deadline=None)
@given(seqlens=lengths, walk=walks, extra_rows=st.integers(0, 70))
def test_the_model_lists_every_tile_once_longest_first_within_the_bound(seqlens, walk, extra_rows):
    cu = cumulative(seqlens)
    bound = vs.schedule_bound(cu[-1] + extra_rows, len(seqlens), walk.own_block)
    rows = vs.schedule_model(cu, cu, walk, bound)
    real = [r for r in rows if r[0] >= 0]
    expected = {(b, t) for b, n in enumerate(seqlens) for t in range(-(-n // walk.own_block))}
    assert sorted(map(tuple, real)) == sorted(expected) and len(rows) == bound
    assert rows[len(real):] == [[-1, -1]] * (bound - len(real))
    steps = [vs.item_steps(seqlens[b], seqlens[b], t, walk) for b, t in real]
    assert steps == sorted(steps, reverse=True)
    for (a, b), (c, d) in zip(zip(real, steps), zip(real[1:], steps[1:])):     # ties keep (sequence, tile) order
        assert b != d or a < c


@settings(max_examples=80, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 200) | st.sampled_from([0, 1]), st.integers(0, 200)), max_size=10),
       walk=walks, extra=st.integers(0, 5))
def test_the_torch_builder_is_the_model(pairs, walk, extra):
    cu_q, cu_k = cumulative([p[0] for p in pairs]), cumulative([p[1] for p in pairs])
    own_rows = (cu_k if walk.owns_keys else cu_q)[-1]
    bound = vs.schedule_bound(own_rows, len(pairs), walk.own_block) + extra
    built = vs.build_schedule(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), walk,
                              bound, use_triton=False)
    assert built.dtype == torch.int32 and built.tolist() == vs.schedule_model(cu_q, cu_k, walk, bound)


_RUNNER = r"""
import json, sys, torch
from flash_attn_ck.backends.triton.runtime import varlen_schedule as vs
results = []
for case in json.loads(sys.argv[1]):
    walk = vs.TileWalk(**case["walk"])
    cu_q, cu_k = (torch.tensor(case[name], dtype=torch.int32) for name in ("cu_q", "cu_k"))
    built = vs.build_schedule(cu_q, cu_k, walk, case["bound"], use_triton=True)
    results.append(built.tolist())
print(json.dumps(results))
"""


@settings(max_examples=3, deadline=None)
@given(cases=st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 150) | st.sampled_from([0, 1]),
                                                   st.integers(0, 150)), max_size=8), walks),
                      min_size=6, max_size=6))
def test_the_triton_builder_is_the_model_under_the_interpreter(cases):
    """One subprocess (TRITON_INTERPRET=1 must be set before triton loads) runs a batch of cases."""
    specs = []
    for pairs, walk in cases:
        cu_q, cu_k = cumulative([p[0] for p in pairs]), cumulative([p[1] for p in pairs])
        bound = vs.schedule_bound((cu_k if walk.owns_keys else cu_q)[-1], len(pairs), walk.own_block)
        specs.append(dict(cu_q=cu_q, cu_k=cu_k, bound=bound, walk=dict(
            own_block=walk.own_block, walk_block=walk.walk_block, owns_keys=walk.owns_keys, left=walk.left,
            right=walk.right, top_left=walk.top_left)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(specs)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    for spec, rows in zip(specs, built):
        assert rows == vs.schedule_model(spec["cu_q"], spec["cu_k"], vs.TileWalk(**spec["walk"]), spec["bound"])


def test_the_bound_holds_the_items_of_any_lengths():
    with pytest.raises(ValueError, match="exceed the bound"):
        vs.schedule_model([0, 5, 10], [0, 5, 10], vs.TileWalk(4, 4, True), vs.schedule_bound(10, 2, 4) - 1)


def test_the_triton_builder_compiles_for_sm90_without_spills():
    import triton
    from gluon_compile import ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    items = 1024
    constexprs = dict(OWN_BLOCK=128, WALK_BLOCK=64, OWNS_KEYS=True, TOP_LEFT=False, ITEMS=items)
    pointers = {"cu_q", "cu_k", "out"}
    sig = {n: "constexpr" if n in constexprs else "*i32" if n in pointers else "i32"
           for n in inspect.signature(vs.schedule_kernel.fn).parameters}
    kernel = triton.compile(ASTSource(vs.schedule_kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=vs.schedule_warps(items)))
    report = ptxas_report(kernel.asm["ptx"])
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0
