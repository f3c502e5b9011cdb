"""CPU tests of the warp-specialised kernels' varlen schedule (TritonBackend(varlen_schedule=True),
backends/triton/runtime/varlen_schedule.py): which walk and bound each launch builds for each kernel and mask, where
the grid over every (batch, tile) stays (the option off, dense calls, a deterministic backward with a left window),
the launch specs the backend builds (grid (heads, items), the schedule of the model, one schedule for every kv-head
launch), that a scheduled launch never shares a compiled kernel with the grid's, and that the scheduled kernels
compile for sm_90a (ptxas: their spills stay those of the grid's kernels). Their numerics against the grid's run on
the GPU (tests/gpu/test_triton.py, `-k schedule`)."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from gluon_compile import (  # noqa: E402
    SM90_SHARED_BYTES,
    bwd_spec,
    compile_spec,
    fwd_spec,
    pretend_capability,
    ptxas_report,
)

from flash_attn_ck.backends.triton import config, operators  # noqa: E402
from flash_attn_ck.backends.triton.backend import TritonBackend  # noqa: E402
from flash_attn_ck.backends.triton.runtime import launch  # noqa: E402
from flash_attn_ck.backends.triton.runtime import varlen_schedule as vs  # noqa: E402
from flash_attn_ck.core.inputs import describe_call, kernel_params  # noqa: E402
from flash_attn_ck.core.mask import MaskInfo  # noqa: E402
from flash_attn_ck.core.options import AttentionOptions  # noqa: E402

# name -> (AttentionOptions keywords, or a top-left MaskInfo maker; the window the kernels take: (left, right,
# top_left), -1 unbounded)
MASKS = {
    "none": (dict(), (-1, -1, False)),
    "causal": (dict(causal=True), (-1, 0, False)),
    "window_left": (dict(window_size=(96, 0)), (96, 0, False)),
    "right_only": (dict(window_size=(-1, 20)), (-1, 20, False)),
    "top_left_causal": (lambda s_q, s_k: MaskInfo.top_left(-1, 0, s_q, s_k), (-1, 0, True)),
    "top_left_window": (lambda s_q, s_k: MaskInfo.top_left(80, 16, s_q, s_k), (80, 16, True)),
}
LEFT = {name for name, (_, window) in MASKS.items() if window[0] >= 0}
PACK = [(300, 300), (0, 0), (1, 1), (1500, 1400), (0, 5), (77, 0), (129, 200)]


def cumulative(values):
    out = [0]
    for n in values:
        out.append(out[-1] + n)
    return out


def call(mask: str, lens=PACK, heads=(8, 2), head_dim=128, deterministic=False, device="cuda"):
    """(problem, params) of a varlen call on CPU tensors; the problem says `device` (the rules read a CUDA device)."""
    cu_q, cu_k = (torch.tensor(cumulative([n[i] for n in lens]), dtype=torch.int32) for i in (0, 1))
    q = torch.zeros(int(cu_q[-1]), heads[0], head_dim, dtype=torch.bfloat16)
    k = torch.zeros(int(cu_k[-1]), heads[1], head_dim, dtype=torch.bfloat16)
    made, _ = MASKS[mask]
    max_q, max_k = max([n[0] for n in lens] + [1]), max([n[1] for n in lens] + [1])
    options = AttentionOptions(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                               deterministic=deterministic, **(made if isinstance(made, dict) else {}))
    p = describe_call(q, k, k.clone(), options)
    if not isinstance(made, dict):
        p = replace(p, mask=made(max_q, max_k))
    params = kernel_params(p, q, k, k.clone(), options, None)
    return replace(p, device=torch.device(device)), params


# ---- the walk and bound of each launch -----------------------------------------------------------------------------
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 1), (128, 4), (256, 2)])
def test_each_launch_walks_its_own_tiles_under_the_calls_window(mask, head_dim, group):
    """The forward owns query tiles of its tile's block_m and walks key tiles of block_n; the backward (bwd_ws, or
    bwd_ws_split at d256) owns key tiles of block_n and walks query tiles of block_m; both under the window the
    kernels take; the bound from the owned axis's rows (no cu_seqlens read); the plan and the forward say so."""
    p, _ = call(mask, heads=(2 * group, 2), head_dim=head_dim)
    left, right, top_left = MASKS[mask][1]
    fwd_tile = config.fwd_ws_tile(head_dim, p.mask.is_causal)
    ws_tile = config.bwd_ws_tile(head_dim, p.mask.is_causal, group)
    backend = TritonBackend(ws=True, fwd_ws=True, varlen_schedule=True)
    with pretend_capability():
        assert operators.FwdWs.schedule_walk(backend, p) == (
            vs.TileWalk(fwd_tile.block_m, fwd_tile.block_n, False, left, right, top_left),
            vs.schedule_bound(p.total_q, len(PACK), fwd_tile.block_m))
        assert operators.BwdWs.schedule_walk(backend, p) == (
            vs.TileWalk(ws_tile.block_n, ws_tile.block_m, True, left, right, top_left),
            vs.schedule_bound(p.total_k, len(PACK), ws_tile.block_n))
        assert "varlen schedule" in backend.backward_plan(p).kernel
        assert "varlen schedule" in backend.forward_kernel(p)
        assert backend.backward_plan(p).kernel.startswith("bwd_ws_split " if head_dim > 128 else "bwd_ws ")
        off = TritonBackend(ws=True, fwd_ws=True, varlen_schedule=False)
        assert "varlen schedule" not in off.backward_plan(p).kernel + off.forward_kernel(p)


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_a_deterministic_backward_with_a_left_window_keeps_the_grid(mask):
    """Deterministic dQ adds wait on the sequence's lower key tiles: the schedule is safe where a sequence's steps never
    increase with the key tile (no left bound), so there the backward takes it; with a left bound the first key tiles'
    steps grow with n (their windows are cut at query 0), so it keeps the grid. The forward has no ordering."""
    p, _ = call(mask, deterministic=True)
    backend = TritonBackend(ws=True, varlen_schedule=True)
    with pretend_capability():
        assert operators.FwdWs.schedule_walk(backend, p) is not None
        assert (operators.BwdWs.schedule_walk(backend, p) is None) == (mask in LEFT)
        assert ("varlen schedule" in backend.backward_plan(p).kernel) == (mask not in LEFT)


def ascending(rows) -> bool:
    """Whether every sequence's key tiles come in ascending order in a schedule's rows."""
    position = {tuple(r): i for i, r in enumerate(rows) if r[0] >= 0}
    return all(position[(b, t)] < position[(b, t + 1)] for b, t in position if (b, t + 1) in position)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700)), min_size=1, max_size=12),
       mask=st.sampled_from(sorted(MASKS)), block=st.sampled_from([64, 128]))
def test_the_schedule_order_is_safe_for_ordered_adds_exactly_without_a_left_bound(lens, mask, block):
    """The deterministic decision's premise, on the model: without a left bound every sequence's key tiles come in
    ascending order in the backward's schedule (so a waiting CTA's predecessors start before it); with one, a long
    enough sequence breaks it (key tile 0's window is cut at query 0, key tile 1's is not), which is why those calls
    keep the grid."""
    left, right, top_left = MASKS[mask][1]
    walk = vs.TileWalk(block, 64, True, left, right, top_left)
    cu_q, cu_k = cumulative([n[0] for n in lens]), cumulative([n[1] for n in lens])
    if left < 0:
        assert ascending(vs.schedule_model(cu_q, cu_k, walk, vs.schedule_bound(cu_k[-1], len(lens), block)))
    else:
        assert not all(ascending(vs.schedule_model([0, n_q], [0, n_k], walk, vs.schedule_bound(n_k, 1, block)))
                       for n_q, n_k in ((1024, 1024), (1024, 1124)))


def test_the_option_off_a_dense_call_or_too_many_items_keep_the_grid(monkeypatch):
    p, _ = call("causal")
    dense = describe_call(*(torch.zeros(2, 300, 4, 128, dtype=torch.bfloat16) for _ in range(3)),
                          AttentionOptions(causal=True))
    monkeypatch.setattr(config, "VARLEN_SCHEDULE", False)
    with pretend_capability():
        for backend in (TritonBackend(), TritonBackend(varlen_schedule=False)):
            assert all(op.schedule_walk(backend, p) is None for op in (operators.FwdWs, operators.BwdWs))
        on = TritonBackend(varlen_schedule=True)
        assert operators.FwdWs.schedule_walk(on, replace(dense, device=p.device)) is None
        monkeypatch.setattr(config, "VARLEN_SCHEDULE", True)     # None follows the config
        assert operators.FwdWs.schedule_walk(TritonBackend(), p) is not None
        assert operators.FwdWs.schedule_walk(TritonBackend(varlen_schedule=False), p) is None
        bound = operators.BwdWs.schedule_walk(TritonBackend(varlen_schedule=True), p)[1]
        monkeypatch.setattr(config, "GRID_Y_MAX", bound - 1)
        assert operators.BwdWs.schedule_walk(TritonBackend(varlen_schedule=True), replace(p)) is None


def test_the_option_is_checked_fixed_and_kept_by_the_leaner_backend():
    with pytest.raises(ValueError, match="varlen_schedule"):
        TritonBackend(varlen_schedule="yes")
    with pytest.raises(ValueError, match="varlen_schedule"):
        TritonBackend(varlen_schedule=1)
    backend = TritonBackend(varlen_schedule=True)
    with pytest.raises(AttributeError, match="fixed"):
        backend.varlen_schedule = False
    assert backend.leaner().varlen_schedule is True and TritonBackend().leaner().varlen_schedule is None


# ---- the launches the backend builds ---------------------------------------------------------------------------------
def run_launches(backend, p, params, monkeypatch):
    """The launch specs of the warp-specialised forward and backward of the call (CPU tensors: nothing runs; the
    backward's D and casts skipped, the zeroings between its launches left out)."""
    from flash_attn_ck.backends.triton.runtime.bwd_postprocess import zero_kernel
    seen = []
    monkeypatch.setattr(launch.LaunchSpec, "launch", lambda spec: seen.append(spec))
    monkeypatch.setattr(operators, "_preprocess", lambda *a: None)
    monkeypatch.setattr(operators, "cast", lambda *a: None)
    q = params.q
    lse = torch.zeros(p.lse_shape)
    with pretend_capability():
        operators.FwdWs.run(backend, p, params, torch.empty_like(q), lse)
        plan = backend.backward_plan(p)
        workspace = plan.allocate(torch.device("cpu"))
        operators.BwdWs.run(backend, p, params, q, lse, q, torch.empty_like(q), torch.empty_like(params.k),
                             torch.empty_like(params.v), workspace)
    return seen[0], [spec for spec in seen[1:] if spec.kernel is not zero_kernel]


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 600) | st.sampled_from([0, 1]), st.integers(0, 600)), min_size=1,
                     max_size=8),
       mask=st.sampled_from(sorted(MASKS)), group=st.sampled_from([1, 4]), heads_k=st.integers(1, 3),
       per_launch=st.integers(1, 3), deterministic=st.booleans(), head_dim=st.sampled_from([128, 256]))
def test_the_launches_run_the_schedule_of_the_model(lens, mask, group, heads_k, per_launch, deterministic, head_dim):
    """Forward: grid (query heads, bound) with the model's schedule of its walk; backward: one launch per group of kv
    heads (config.BWD_WS_DQ_ACCUM_BYTES), each on grid (its kv heads, bound) with the one schedule built for the call;
    the kernels' other arguments as the grid's launches have them. With the option off (and for a deterministic
    backward with a left window) the grids over every (batch, tile) and no schedule."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        p, params = call(mask, [*lens, (33, 40)], (heads_k * group, heads_k), head_dim, deterministic)  # rows in both
        per_kv_head = p.rows_q * group * head_dim * 4
        monkeypatch.setattr(config, "BWD_WS_DQ_ACCUM_BYTES", per_launch * per_kv_head)
        on = TritonBackend(ws=True, fwd_ws=True, varlen_schedule=True)
        fwd, bwds = run_launches(on, p, params, monkeypatch)
        off = TritonBackend(ws=True, fwd_ws=True, varlen_schedule=False)
        fwd_off, bwds_off = run_launches(off, p, params, monkeypatch)
    cu_q, cu_k = params.cu_seqlens_q.tolist(), params.cu_seqlens_k.tolist()
    with pretend_capability():
        walks = {op.role: op.schedule_walk(on, p) for op in (operators.FwdWs, operators.BwdWs)}
    walk, bound = walks["forward"]
    assert fwd.grid == (heads_k * group, bound)
    assert fwd.args["schedule"].dtype == torch.int32 and fwd.args["schedule"].tolist() == vs.schedule_model(
        cu_q, cu_k, walk, bound)
    assert fwd_off.args["schedule"] is None and len(fwd_off.grid) == 3
    launches = -(-heads_k // min(per_launch, heads_k))
    assert len(bwds) == len(bwds_off) == launches
    # a window wider than every sequence has no left bound
    if deterministic and operators.BwdWs.mask(on, p).flags.HAS_LEFT:
        assert walks["backward"] is None
        assert all(b.args["schedule"] is None and b.grid == o.grid for b, o in zip(bwds, bwds_off))
    else:
        walk, bound = walks["backward"]
        schedule = bwds[0].args["schedule"]
        assert schedule.tolist() == vs.schedule_model(cu_q, cu_k, walk, bound)
        for spec, spec_off in zip(bwds, bwds_off):
            assert spec.args["schedule"] is schedule
            assert spec.grid == (spec_off.args["k_desc"].shape[1], bound)
            assert spec_off.args["schedule"] is None and len(spec_off.grid) == 3
    for spec, spec_off in zip([fwd, *bwds], [fwd_off, *bwds_off]):      # the rest as the grid's launch has it
        assert spec.kernel is spec_off.kernel and spec.num_warps == spec_off.num_warps
        for name in ("TILE", "CALL", "window", "sizes"):
            assert spec.args[name] == spec_off.args[name], name


# ---- a scheduled launch compiles its own kernel ----------------------------------------------------------------
class _Recorder:
    """A Gluon kernel's launch surface for launch.launch_kernel: the real kernel's parameters (so its cache keys are
    the real ones), launches recorded."""

    def __init__(self, kernel):
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        self.params = kernel.params
        self.device_caches = {0: (None, None, None, CUDABackend(GPUTarget("cuda", 90, 32)), None)}
        self.jit, self.direct = [], []
        recorder = self

        class Compiled:
            function, packed_metadata = "function", "metadata"

            @staticmethod
            def run(*args):
                recorder.direct.append(args[:3])
        self.compiled = Compiled()

    def __getitem__(self, grid):
        def launch_(*args, **options):
            self.jit.append(grid)
            return self.compiled
        return launch_


def test_a_scheduled_launch_never_shares_the_grids_compiled_kernel(monkeypatch):
    """launch.launch_kernel keys its compiled kernels by Triton's specialisation of each argument: the schedule (an
    int32 pointer) and its absence (a constexpr None) are two keys, so neither backend launches the other's kernel;
    and on one problem each backend keeps its own decision (memoised per backend)."""
    import triton.runtime as runtime
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1)
    monkeypatch.setattr(runtime, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(launch, "_KERNELS", {})
    p, params = call("causal")
    on = TritonBackend(ws=True, fwd_ws=True, varlen_schedule=True)
    off = TritonBackend(ws=True, fwd_ws=True, varlen_schedule=False)
    specs = [run_launches(backend, p, params, monkeypatch) for backend in (on, off, on, off)]
    for role in (0, 1):
        first = [s[role] if role == 0 else s[role][0] for s in specs]
        recorder = _Recorder(first[0].kernel)
        for spec in first:
            launch.launch_kernel(recorder, spec.grid, tuple(spec.args.values()), spec.num_warps, spec.num_stages,
                                 spec.options)
        assert recorder.jit == [first[0].grid, first[1].grid] and first[0].grid != first[1].grid
        assert [args[:len(spec.grid)] for args, spec in zip(recorder.direct, first[2:])] == [s.grid for s in first[2:]]


# ---- the scheduled kernels compile for sm_90a ----------------------------------------------------------------
@pytest.mark.parametrize("kernel,head_dim,masks,deterministic", [
    ("fwd_ws", 128, (True, True, True), False), ("bwd_ws", 128, (False, False, True), True),
    ("bwd_ws_split", 256, (True, True, True), False)])
def test_the_scheduled_kernels_compile_with_the_grids_spills(kernel, head_dim, masks, deterministic):
    """Each kernel with a schedule (varlen) against the same kernel without: the schedule's kernel reads its row from
    the grid's y and its head from x (no z: grid (heads, items)), its buffers fit an SM, and ptxas spills at most 16
    bytes more than the grid's kernel (sm_90a, triton 3.6: +0-12 bytes in the 1-warp workers' 24 registers)."""
    def build(schedule):
        if kernel == "fwd_ws":
            return compile_spec(fwd_spec(config.FWD_WS_SM90[head_dim][True], head_dim, True, masks, schedule))
        return compile_spec(bwd_spec(config.BWD_WS_SM90[head_dim], head_dim, True, masks, deterministic, schedule))

    grid, scheduled = build(False), build(True)
    ptx = scheduled.asm["ptx"]
    assert "%ctaid.y" in ptx and "%ctaid.z" not in ptx and "%nctaid.z" not in ptx
    assert "%ctaid.z" in grid.asm["ptx"]     # the grid's kernel: (tiles, batch, heads)
    assert scheduled.metadata.shared <= SM90_SHARED_BYTES
    before, after = ptxas_report(grid.asm["ptx"]), ptxas_report(ptx)
    assert after["spill_stores"] <= before["spill_stores"] + 16 and after["spill_loads"] <= before["spill_loads"] + 16
