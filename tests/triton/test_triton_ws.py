"""CPU tests of the warp-specialised Gluon backward (backends/triton/gluon/bwd_ws.py): its dispatch rule
(its operators' declarations, operators.py), its workspace plan, and that every kernel variant compiles to sm_90a
with the instructions the design rests on. Its numerics run on the GPU (tests/gpu/test_triton.py)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from gluon_compile import (  # noqa: E402
    SM90_SHARED_BYTES,
    bwd_spec,
    compile_as_launched,
    compile_spec,
    pretend_capability,
    ptxas_report,
    spill_allowance,
    ws_reasons,
)

from cases import tile_head_dims  # noqa: E402
from flash_attn_ck.backends.triton import config, operators  # noqa: E402
from flash_attn_ck.backends.triton.backend import TritonBackend  # noqa: E402
from flash_attn_ck.core.mask import MaskInfo  # noqa: E402
from flash_attn_ck.core.problem import AttentionParams, AttentionProblem  # noqa: E402


@pytest.fixture
def sm90():
    """Pretend the problem's CUDA device is an sm_90 part (the rule reads only its capability)."""
    with pretend_capability():
        yield


def problem(seqlen=8192, head_dim=128, heads=(16, 16), batch=2, dtype=torch.bfloat16, causal=False, **features):
    mask = MaskInfo.from_flash_args(causal, (-1, -1), seqlen, seqlen)
    return AttentionProblem(batch, seqlen, seqlen, *heads, head_dim, dtype, torch.device("cuda"), mask,
                            head_dim ** -0.5, **features)


def test_ws_runs_where_it_measured_faster(sm90):
    assert ws_reasons(TritonBackend(), problem()) == []
    assert ws_reasons(TritonBackend(), problem(heads=(32, 8), causal=True)) == []
    short = ws_reasons(TritonBackend(), problem(seqlen=config.BWD_WS_MIN_SEQLEN[128] - 1))
    assert short and "one-launch kernel measured faster" in short[0]
    assert ws_reasons(TritonBackend(), problem(seqlen=config.BWD_WS_MIN_SEQLEN[128])) == []
    assert ws_reasons(TritonBackend(ws=True), problem(seqlen=512)) == []        # forced: any length
    assert ws_reasons(TritonBackend(ws=True), problem(seqlen=512, head_dim=64)) == []
    assert ws_reasons(TritonBackend(ws=False), problem()) == ["turned off (TritonBackend(ws=False))"]


@settings(max_examples=60, deadline=None)
@given(head_dim=st.sampled_from([32, *tile_head_dims(config.BWD_WS_SM90)]), causal=st.booleans(),
       group=st.sampled_from([1, 2, 4, 8]), seqlen=st.integers(1, 3 * max(config.BWD_WS_MIN_SEQLEN.values())))
def test_the_default_runs_it_exactly_where_measured(head_dim, causal, group, seqlen):
    """Property: with the default options the backward runs bwd_ws on a supported call (MHA or GQA) exactly when its
    head dim is in BWD_WS_DEFAULT_HEAD_DIMS and its longest sequence reaches its head block's BWD_WS_MIN_SEQLEN; a
    shorter one is told why."""
    with pretend_capability():
        reasons = ws_reasons(TritonBackend(), problem(head_dim=head_dim, causal=causal, heads=(8 * group, 8),
                                                     seqlen=seqlen))
    shortest = config.BWD_WS_MIN_SEQLEN.get(config.head_block(head_dim), 0)
    measured = head_dim in config.BWD_WS_DEFAULT_HEAD_DIMS
    assert (not reasons) == (measured and seqlen >= shortest), reasons
    if measured and seqlen < shortest:
        assert reasons == [f"sequences shorter than {shortest}: the one-launch kernel measured faster"]


FEATURES = {"float32": dict(dtype=torch.float32), "value head dim": dict(head_dim_v=192)}


@settings(max_examples=25, deadline=None)
@given(names=st.sets(st.sampled_from(sorted(FEATURES)), min_size=1), forced=st.booleans())
def test_every_unsupported_feature_is_named(names, forced):
    """Each feature the kernel does not implement keeps the call on the one-launch kernel, with its name."""
    features = {k: v for n in names for k, v in FEATURES[n].items()}
    with pretend_capability():
        reasons = ws_reasons(TritonBackend(ws=forced or None), problem(**features))
    for name in names:
        assert any(name in r for r in reasons), (name, reasons)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("forced", [True, None])
def test_dropout_runs_on_the_ws_backward_where_declared(head_dim, forced):
    """bwd_ws and bwd_ws_split take dropout, forced on, or by default in the head blocks of
    config.BWD_WS_DROPOUT_HEAD_BLOCKS; elsewhere the reason names dropout and the head dim."""
    with pretend_capability():
        p = problem(head_dim=head_dim, dropout_p=0.1)
        reasons = [r for r in ws_reasons(TritonBackend(ws=forced), p) if "dropout" in r]
    if forced or config.head_block(p.head_dim_padded) in config.BWD_WS_DROPOUT_HEAD_BLOCKS:
        assert reasons == [], reasons
    else:
        assert len(reasons) == 1 and reasons[0].startswith(f"dropout at head dim {p.head_dim_padded}: not measured"), \
            reasons


@pytest.mark.parametrize("forced", [True, None])
def test_bwd_ws_split_takes_dropout_or_a_softcap_not_both(forced):
    """Each hands bwd_ws_split's dP warpgroup a shared tile of its own: with both the CTA's shared memory is short, and
    the reason says so, forced on or not."""
    with pretend_capability():
        reasons = ws_reasons(TritonBackend(ws=forced), problem(head_dim=256, dropout_p=0.1, softcap=20.0))
    assert "dropout with a softcap: their two tiles beside P^T exceed a CTA's shared memory" in reasons, reasons


@pytest.mark.parametrize("head_dim,capability,dtype,expect", [
    (320, (9, 0), torch.bfloat16, "head dim 320"), (72, (9, 0), torch.bfloat16, "head dim 72"),
    (128, (8, 0), torch.bfloat16, "sm_90"), (128, (10, 0), torch.bfloat16, "sm_90"),
    (128, (9, 0), torch.float32, "float32")])
def test_ws_names_what_it_cannot_run(head_dim, capability, dtype, expect):
    with pretend_capability(capability):
        reasons = ws_reasons(TritonBackend(), problem(head_dim=head_dim, dtype=dtype))
    assert any(expect in r for r in reasons), reasons


def test_an_unmeasured_head_dim_keeps_the_one_launch_kernel(sm90, monkeypatch):
    monkeypatch.setattr(operators.BwdWs, "default_head_dims", frozenset({128}))
    assert ws_reasons(TritonBackend(), problem()) == []
    assert ws_reasons(TritonBackend(), problem(head_dim=64)) == ["head dim 64: the one-launch kernel measured faster"]
    assert ws_reasons(TritonBackend(ws=True), problem(head_dim=64)) == []


@pytest.mark.parametrize("head_dims", [(192, 128), (256, 200), (128, 64), (96, 72), (64, 128), (128, 192)])
@pytest.mark.parametrize("measured", [True, False])
@pytest.mark.parametrize("forced", [True, None])
def test_a_value_head_dim_runs_on_the_ws_backward_where_declared(sm90, monkeypatch, head_dims, measured, forced):
    """bwd_ws / bwd_ws_split take a v narrower than q/k at v's own head dim, never a wider one: forced on, or by
    default where their narrower_value_head_blocks (config.BWD_WS_NARROWER_VALUE_HEAD_BLOCKS, here a stand-in) hold
    q/k's head block; the plan's kernel line says so, or else why not, and no padded buffers are planned."""
    d, d_v = head_dims
    block = config.head_block(d)
    for operator in (operators.BwdWs, operators.BwdWsSplit):
        monkeypatch.setattr(operator, "narrower_value_head_blocks", frozenset({block} if measured else ()))
    plan = TritonBackend(ws=forced).backward_plan(problem(head_dim=d, heads=(8, 2), causal=True, head_dim_v=d_v))
    runs = d_v < d and (forced or measured)
    assert plan.kernel.startswith("bwd_ws") is runs, plan.kernel
    assert ("value head dim" in plan.kernel) is not runs, plan.kernel
    assert (f"v and dout at v's own head block {config.head_block(d_v)}" in plan.kernel) is runs, plan.kernel
    assert not [b for b in plan.buffers if "padded" in b.name]


@pytest.mark.parametrize("operator,head_dims", [(operators.BwdWsSplit, (192, 128)), (operators.BwdWs, (128, 40))])
def test_a_narrower_v_on_the_ws_backward_gives_the_d_v_gradients(monkeypatch, operator, head_dims):
    """The warp-specialised backward's run on a call whose v is narrower than q/k: the kernel (a float64 stand-in
    here) gets v, dout and dv as they are, at v's head dim; dq, dk and dv are the gradients of the call's attention,
    to float64 rounding."""
    from flash_attn_ck.backends.triton.gluon import bwd_ws
    from flash_attn_ck.core.problem import AttentionParams
    from oracle import naive_attention
    d, d_v = head_dims
    seqlen, widths = 96, []

    def gradients(q, k, v, dout):      # of the call's one sequence (naive_attention's (rows, heads, dim))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = naive_attention(q[0], k[0], v[0], causal=True, softmax_scale=d ** -0.5)[0]
        return torch.autograd.grad(out, (q, k, v), dout[0])

    def stand_in(q, k, v, dout, lse, delta, dq_accum, dk, dv, cu_q, cu_k, *, tile, **_):
        widths.append((tile.split_d, v.shape[-1], dout.shape[-1], dv.shape[-1]))
        for grad, target in zip(gradients(q, k, v, dout), (dq_accum, dk, dv)):
            target.copy_(grad)
    monkeypatch.setattr(bwd_ws, "launch", stand_in)     # both kernels' (the tile says which)
    monkeypatch.setattr(operators, "_preprocess", lambda *args: None)
    monkeypatch.setattr(operators, "cast", lambda acc, dq, *args: dq.copy_(acc))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, seqlen, heads, d, generator=gen, dtype=torch.float64) for heads in (8, 2))
    v = torch.randn(1, seqlen, 2, d_v, generator=gen, dtype=torch.float64)
    dout = torch.randn(1, seqlen, 8, d_v, generator=gen, dtype=torch.float64)
    p = replace(problem(seqlen=seqlen, head_dim=d, heads=(8, 2), batch=1, causal=True, head_dim_v=d_v),
                dtype=torch.float64, device=torch.device("cpu"))
    backend = TritonBackend(ws=True)
    workspace = {b.name: torch.full(b.shape, float("nan"), dtype=torch.float64) for b in operator.buffers(backend, p)}
    workspace["softmax_d"] = torch.empty(p.lse_shape, dtype=torch.float64)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    params = AttentionParams(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None)
    operator.run(backend, p, params, None, torch.empty(p.lse_shape), dout, dq, dk, dv, workspace)
    assert widths == [(operator.split_d, d_v, d_v, d_v)]
    for got, want in zip((dq, dk, dv), gradients(q, k, v, dout)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head_dims", [(192, 128), (256, 32), (128, 64), (64, 32)])
def test_a_narrower_v_compiles_with_v_s_own_tiles_on_the_ws_backward(head_dims):
    """bwd_ws (bwd_ws_split above 128) for a (d, d_v) call compiles for sm_90a with V, the dO ring and dV at v's head
    block: shared memory smaller than the (d, d) kernel's by exactly V's and the dO ring's narrower columns, and the
    dV matmul's wgmma at v's width (its accumulator's: half of the head block where the warpgroups split it), and
    less matmul work in all (dP^T's and dV's narrower operands; each m64 k16 wgmma counted by its N)."""
    d, d_v = head_dims
    tile = config.bwd_ws_tile(d, True, 1, False)
    same, narrower = (compile_spec(bwd_spec(tile, d, False, (False, False, True), head_dim_v=width))
                      for width in (None, d_v))
    columns = config.head_block(d) - config.head_block(d_v)
    saved = (tile.block_n + tile.num_stages * tile.block_m) * columns * 2    # bf16
    assert saved - 128 < same.metadata.shared - narrower.metadata.shared <= saved
    parts = 2 if tile.split_d else 1
    old, new = config.head_block(d) // parts, config.head_block(d_v) // parts
    widths = [Counter(int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", k.asm["ptx"]))
              for k in (same, narrower)]
    work = [sum(n * count for n, count in w.items()) for w in widths]
    assert widths[1][old] < widths[0][old] and new in widths[1] and work[1] < work[0], widths


@pytest.mark.parametrize("head_dims,tail", [((192, 128), 64), ((192, 192), 64), ((160, 128), 32), ((136, 64), 32),
                                             ((256, 128), 0), ((128, 64), 0)])
def test_q_k_take_a_tail_block_on_bwd_ws_split_where_config_turns_it_on(sm90, monkeypatch, head_dims, tail):
    """With config.BWD_WS_QK_TAIL on, bwd_ws_split loads q/k of a head dim in 129-192 (beside any v) as a 128-column
    block and a tail block of the rest, and hands dQ over in those two parts (dq_accum's boxes likewise); other calls,
    and every call with it off, take the head block whole (in halves)."""
    from flash_attn_ck.backends.triton.gluon import bwd_ws
    d, d_v = head_dims
    p = problem(head_dim=d, heads=(8, 2), causal=True, head_dim_v=d_v)
    for on in (False, True):
        monkeypatch.setattr(config, "BWD_WS_QK_TAIL", on)
        backend = TritonBackend(ws=True)
        operator = backend.operator(p, "backward")
        want = tail if on else 0
        assert operator.qk_tail(p) == want
        assert (f"q/k as 128 + {want} columns" in backend.backward_plan(p).kernel) is bool(want)
        spec = bwd_spec(config.bwd_ws_tile(d, True), d, False, (False, False, True), head_dim_v=d_v, qk_tail=want) \
            if config.bwd_ws_tile(d, True).split_d else None
        if spec is None:
            assert not want
            continue
        boxes = [spec.args[name].block_shape[-1] for name in ("q_desc", "k_desc", "dq_desc")]
        tails = [t.block_shape[-1] for t in spec.args["tail_descs"]] if want else None
        assert boxes == ([128] * 3 if want else [config.head_block(d)] * 2 + [config.head_block(d) // 2])
        assert tails == ([want] * 3 if want else None)
        assert spec.args["CALL"] == replace(spec.args["CALL"], QK_TAIL=want)
        seen = []
        monkeypatch.setattr(bwd_ws, "launch", lambda *args, **kwargs: seen.append(kwargs["qk_tail"]))
        monkeypatch.setattr(operators, "_preprocess", lambda *args: None)
        monkeypatch.setattr(operators, "cast", lambda *args: None)
        q, k = torch.zeros(2, 2048, 8, d, dtype=torch.bfloat16), torch.zeros(2, 2048, 2, d, dtype=torch.bfloat16)
        v = torch.zeros(2, 2048, 2, d_v, dtype=torch.bfloat16)
        workspace = {b.name: torch.zeros(b.shape, dtype=b.dtype) for b in operator.buffers(backend, p)}
        workspace["softmax_d"] = torch.zeros(p.lse_shape)
        operator.run(backend, p, AttentionParams(q, k, v), q.new_zeros(2, 2048, 8, d_v), torch.zeros(p.lse_shape),
                     q.new_zeros(2, 2048, 8, d_v), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                     workspace)
        assert seen and set(seen) == {want}


@pytest.mark.parametrize("head_dims", [(192, 128), (192, 192), (160, 128)])
def test_a_tail_block_takes_exactly_its_columns_of_the_split_backward(head_dims):
    """bwd_ws_split with q/k as a 128-column block and a tail block compiles for sm_90a with shared memory smaller than
    with the 256-column head block by the tail's missing columns of the Q ring, K and the fp32 dQ buffers (to the
    allocator's alignment of the more buffers), and matmul work (each m64 k16 wgmma counted by its N) smaller by those
    columns of S^T, dK and dQ."""
    d, d_v = head_dims
    tile = config.bwd_ws_tile(d, True)
    tail = config.head_block(d - 128)
    whole, split = (compile_spec(bwd_spec(tile, d, False, (False, False, True), head_dim_v=d_v, qk_tail=t))
                    for t in (0, tail))
    columns = config.head_block(d) - 128 - tail
    saved = (tile.num_stages * tile.block_m + tile.block_n) * columns * 2 + tile.dq_stages * tile.block_m * columns * 4
    assert saved - 1024 < whole.metadata.shared - split.metadata.shared <= saved
    work = [sum(int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", k.asm["ptx"]))
            for k in (whole, split)]
    assert work[0] - work[1] == columns * (2 * tile.block_m + tile.block_n) // 16


def test_plan_names_the_kernel_and_bounds_dq_accum(sm90):
    # GQA 32/8 d128 s8192: the accumulator covers as many kv heads per launch as fit its budget.
    p = problem(heads=(32, 8), causal=True)
    plan = TritonBackend().backward_plan(p)
    assert plan.kernel.startswith("bwd_ws")
    assert [b.name for b in plan.buffers] == ["softmax_d", "dq_accum"]
    acc = plan.buffers[1]
    assert acc.nbytes <= config.BWD_WS_DQ_ACCUM_BYTES and acc.shape[-2] % p.group_size == 0
    assert plan.total_bytes == acc.nbytes + plan.buffers[0].nbytes
    # a call the kernel does not take says which kernel runs instead, and why
    other = TritonBackend().backward_plan(problem(head_dim_v=64))
    assert other.kernel.startswith("bwd_main") and "value head dim" in other.kernel
    assert "dq_accum" not in [b.name for b in other.buffers]


def test_deterministic_plan_orders_every_query_tile(sm90):
    p = problem(seqlen=8191, heads=(32, 8), deterministic=True)
    plan = TritonBackend().backward_plan(p)
    assert plan.kernel.startswith("bwd_ws")
    acc, sem = plan.buffers[1], plan.buffers[2]
    assert sem.name == "dq_semaphore" and sem.dtype == torch.int32
    tile = config.BWD_WS_SM90[128]
    # one semaphore per (batch, head of a launch, query tile), the last partial tile included
    assert sem.shape == (p.batch, acc.shape[-2], -(-8191 // tile.block_m))


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_launches_cover_every_kv_head_once(sm90, group):
    """kv heads are walked in launches whose dQ accumulators fit; together they cover every head once."""
    p = problem(seqlen=16384, heads=(8 * group, 8), batch=4)
    per = operators.BwdWs.kv_heads_per_launch(TritonBackend(), p)
    assert per * p.rows_q * group * 128 * 4 <= config.BWD_WS_DQ_ACCUM_BYTES or per == 1
    covered = [h for h0 in range(0, p.heads_k, per) for h in range(h0, min(h0 + per, p.heads_k))]
    assert covered == list(range(p.heads_k))


def test_a_launch_over_every_head_passes_the_tensors_themselves():
    """The warp-specialised backward (operators.BwdWs.run) hands each launch the heads it covers: the tensor itself
    when that is all of them (no view to make per tensor and launch), else exactly those heads."""
    from flash_attn_ck.backends.triton.operators import heads_of
    t = torch.arange(2 * 3 * 4 * 5).view(2, 3, 4, 5)
    assert heads_of(t, -2, slice(0, 4)) is t and heads_of(t, 1, slice(0, 3)) is t
    for dim, heads, expected in ((-2, slice(0, 2), t[..., :2, :]), (-2, slice(1, 4), t[..., 1:, :]),
                                 (1, slice(2, 3), t[:, 2:])):
        got = heads_of(t, dim, heads)
        assert got is not t and torch.equal(got, expected) and got.data_ptr() == expected.data_ptr()


# ---- the kernel compiles for sm_90a here (no GPU: ptxas from the triton wheel) ----------------------
def _compile(tile, head_dim, varlen, masks, deterministic=False):
    """The kernel `bwd_ws.launch` runs for `tile` (bwd_ws_split's for a split_d tile), compiled for sm_90a."""
    return compile_spec(bwd_spec(tile, head_dim, varlen, masks, deterministic))


# The tiles of the table, and a head dim padded into each (3/4 of its block: d96 runs in d128's tile).
UNSPLIT = [d for d, tile in sorted(config.BWD_WS_SM90.items()) if not tile.split_d]
SPLIT = [d for d, tile in sorted(config.BWD_WS_SM90.items()) if tile.split_d]
MASKS = {"dense": (False, (False, False, False), False), "causal": (False, (False, False, True), False),
         "varlen-causal": (True, (False, False, True), False), "window": (False, (True, True, True), False),
         "varlen-window-det": (True, (False, True, True), True),
         "varlen-causal-det": (True, (False, False, True), True)}


def _cases(head_dims, masks, padded_masks):
    """(head dim, varlen, masks, deterministic) of `masks` at each head dim and `padded_masks` at a head dim padded
    into each, with readable ids."""
    cases = [(d, m) for d in head_dims for m in masks] + [(d * 3 // 4, m) for d in head_dims for m in padded_masks]
    return pytest.mark.parametrize("head_dim,varlen,masks,deterministic", [(d, *MASKS[m]) for d, m in cases],
                                   ids=[f"d{d}-{m}" for d, m in cases])


@_cases([128], ["window"], [])
def test_the_windowed_d128_kernel_does_not_spill(head_dim, varlen, masks, deterministic):
    """bwd_ws at d128 (its table tile) with a windowed mask keeps the MMA partition within its registers: D is read
    from shared memory after the exp2, so its registers are not live across it (read beside lse, ptxas spilled 20
    bytes here, reloaded every step). Unmasked kernels keep the read beside lse, measured faster though it spills."""
    tile = config.bwd_ws_tile(head_dim, causal=masks[2])
    report = ptxas_report(_compile(tile, head_dim, varlen, masks, deterministic).asm["ptx"])
    assert report["spill_stores"] <= spill_allowance(0) and report["spill_loads"] <= spill_allowance(0), report


@_cases(UNSPLIT, ["dense", "varlen-causal", "window", "varlen-window-det"], ["dense"])
def test_kernel_compiles_to_the_designed_instructions(head_dim, varlen, masks, deterministic):
    tile = config.bwd_ws_tile(head_dim, causal=False)
    kernel = _compile(tile, head_dim, varlen, masks, deterministic)
    assert kernel.metadata.shared <= SM90_SHARED_BYTES   # the tile launches: its buffers fit one SM's shared memory
    ptx = kernel.asm["ptx"]
    # 5 matmuls per step as wgmma (S^T, dP^T, dV, dK: 64-row halves per warpgroup; dQ), TMA loads,
    # the dQ reduce-add through the TMA engine, and register budgets per partition.
    assert ptx.count("wgmma.mma_async") >= 5
    assert "cp.async.bulk.tensor.3d" in ptx   # boxes of one head (a padded head dim reads zeros past d)
    assert "cp.reduce.async.bulk.tensor.3d" in ptx and ".add" in ptx
    # The MMA partition's budget: 240 where one CTA has the SM's registers, 200+ under a two-CTAs cap (d64).
    budget = r"2\d\d" if tile.max_registers else "240"
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{budget};", ptx)
    assert "mbarrier.try_wait" in ptx
    # Two waits leave one group in flight: S^T's (dP^T still running) and dV/dQ's (dK still running while
    # dQ is handed to the writer); the step's last wait retires dK.
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 2
    # deterministic: a full bulk-group wait (not only its shared-memory reads) before the release
    assert ("cp.async.bulk.wait_group 0" in ptx) == deterministic


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), seqlen=st.integers(1, 700), heads_k=st.integers(1, 3), group=st.sampled_from([1, 2, 4]),
       split=st.booleans(), key_major=st.booleans())
def test_the_grid_is_key_major_when_asked(batch, seqlen, heads_k, group, split, key_major):
    """bwd_ws.launch_spec (CPU tensors): the grid is (key tiles, batch, kv heads), or (kv heads, batch, key tiles) with
    WsTile.key_major, and the kernel is told which (KEY_MAJOR)."""
    from flash_attn_ck.backends.triton.gluon import bwd_ws
    from flash_attn_ck.backends.triton.runtime.launch import GluonMask, MaskFlags

    d = 256 if split else 64
    tile = config.WsTile(64, 64 if split else 128, num_warps=4 if split else 8, split_d=split,
                         key_major=key_major)
    q = torch.zeros(batch, seqlen, heads_k * group, d, dtype=torch.bfloat16)
    k = torch.zeros(batch, seqlen, heads_k, d, dtype=torch.bfloat16)
    rows = torch.zeros(batch, heads_k * group, seqlen)
    spec = bwd_ws.launch_spec(q, k, k.clone(), q.clone(), rows, rows.clone(), q.float(), k.clone(), k.clone(), None,
                              None, varlen=False, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, scale=0.1,
                              mask=GluonMask((0, 0), MaskFlags(HAS_RIGHT=True)), tile=tile)
    key_tiles = -(-seqlen // tile.block_n)
    assert spec.kernel is (bwd_ws.attn_bwd_ws_split_kernel if split else bwd_ws.attn_bwd_ws_kernel)
    assert spec.grid == ((heads_k, batch, key_tiles) if key_major else (key_tiles, batch, heads_k))
    assert spec.args["TILE"].key_major is key_major


@pytest.mark.parametrize("head_dim", sorted(config.BWD_WS_SM90))
def test_a_key_major_grid_reads_the_head_count_from_x(head_dim):
    """KEY_MAJOR swaps the axes the kernel reads: the deterministic writer counts the kv heads in the grid's x
    dimension (%nctaid.x) instead of z; the default reads z."""
    tile = config.BWD_WS_SM90[head_dim]
    for key_major, axis in ((False, "z"), (True, "x")):
        kernel = _compile(replace(tile, key_major=key_major), head_dim, True, (False, False, True), True)
        ptx = kernel.asm["ptx"]
        assert f"%nctaid.{axis}" in ptx and f"%nctaid.{'xz'.replace(axis, '')}" not in ptx


@_cases([d for d in UNSPLIT if config.BWD_WS_SM90[d].max_registers], ["dense", "varlen-causal-det"], [])
def test_a_register_cap_fits_two_ctas_on_an_sm(head_dim, varlen, masks, deterministic):
    """WsTile.max_registers: a capped tile (the d64 one: 4 MMA warps, 128 registers a thread at launch) fits two CTAs
    in one SM's registers and shared memory, the MMA partition still gets its budget (setmaxnreg) and nothing
    spills."""
    tile = config.BWD_WS_SM90[head_dim]
    assert tile.max_registers == 128
    kernel = _compile(tile, head_dim, varlen, masks, deterministic)
    report = ptxas_report(kernel.asm["ptx"])
    assert report["registers"] <= 128 and report["spill_stores"] <= spill_allowance(0)
    assert 2 * report["registers"] * kernel.metadata.num_warps * 32 <= 64 * 1024
    assert 2 * kernel.metadata.shared <= SM90_SHARED_BYTES
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+2\d\d;", kernel.asm["ptx"])   # the MMA warps' 200+
    assert config.WsTile.parse(str(tile)) == tile


@_cases(SPLIT, ["dense", "causal", "varlen-causal-det"], ["varlen-window-det"])
def test_split_kernel_compiles_to_the_designed_instructions(head_dim, varlen, masks, deterministic):
    """bwd_ws_split (head dims above 128): its buffers fit one SM, the main path does not spill, dQ goes out by
    TMA reduce-adds."""
    tile = config.bwd_ws_tile(head_dim, causal=False)
    assert tile.split_d
    kernel = _compile(tile, head_dim, varlen, masks, deterministic)
    assert kernel.metadata.shared <= SM90_SHARED_BYTES
    ptx = kernel.asm["ptx"]
    assert ptx.count("wgmma.mma_async") >= 5
    assert "cp.async.bulk.tensor.3d" in ptx
    assert "cp.reduce.async.bulk.tensor.3d" in ptx
    # Each warpgroup passes its wgmma groups in whole (one wait for S^T or dP^T, one for its three gradient halves).
    assert "wgmma.wait_group.sync.aligned 1;" not in ptx
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    if not deterministic and head_dim == 256:
        assert ptxas_report(ptx)["spill_stores"] <= spill_allowance(0)


@pytest.mark.parametrize("term", ["none", "softcap", "alibi"])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("seqlen_q", [1, 64])
def test_a_few_queries_against_long_keys_compile_as_launched(head_dim, seqlen_q, term):
    """The backward runs these (max(s_q, s_k) >= 2048), with the score terms the defaults give it too: at s_q = 1
    lse's head stride is 1, at s_q <= 64 the semaphore rows per head (sem_m_tiles) are 1, and a launch specialises
    both to the constant 1, which has to cross into the worker partitions (bwd_ws_split built its partition list in a
    comprehension, whose plain ints do not: "'int' object has no attribute '_flatten_ir'" for every such d256 call)."""
    from flash_attn_ck.backends.triton.gluon import bwd_ws
    from flash_attn_ck.backends.triton.runtime.launch import GluonMask, MaskFlags
    q, dout = (torch.empty(1, seqlen_q, 4, head_dim, dtype=torch.bfloat16) for _ in range(2))
    k, v, dk, dv = (torch.empty(1, 4096, 4, head_dim, dtype=torch.bfloat16) for _ in range(4))
    lse, delta = torch.empty(1, 4, seqlen_q), torch.empty(1, 4, seqlen_q)
    cu = torch.tensor([0, seqlen_q], dtype=torch.int32)
    tile = config.bwd_ws_tile(head_dim, causal=False)
    spec = bwd_ws.launch_spec(q, k, v, dout, lse, delta, torch.empty(1, seqlen_q, 4, head_dim), dk, dv, cu, cu,
                              varlen=False, batch=1, seqlen_q=seqlen_q, seqlen_k=4096, scale=0.1,
                              mask=GluonMask((0, 0), MaskFlags(False, False, False)), tile=tile,
                              softcap=30.0 if term == "softcap" else 0.0,
                              alibi=(torch.rand(4), 0) if term == "alibi" else None)
    assert spec.args["semaphores"][1] == 1 and (seqlen_q > 1 or spec.args["strides"][0][1] == 1)
    assert "wgmma.mma_async" in compile_as_launched(spec).asm["ptx"]


@settings(max_examples=40, deadline=None)
@given(head_dim=st.sampled_from(tile_head_dims(config.BWD_WS_SM90)),
       heads_k=st.integers(1, 8), group=st.integers(1, 8),
       causal=st.booleans(), deterministic=st.booleans())
def test_causal_gqa_or_deterministic_at_d128_starts_the_longest_key_tiles_first(head_dim, heads_k, group, causal,
                                                                              deterministic):
    """config.bwd_ws_tile: the key-major grid (measured faster on causal GQA 32/8 and on every deterministic causal
    call, slower on causal MHA and on every non-causal call) for causal calls with 4+ query heads per kv head, or
    deterministic, on the d128 tile; the plan says so."""
    p = problem(head_dim=head_dim, heads=(heads_k * group, heads_k), causal=causal, deterministic=deterministic)
    with pretend_capability():
        tile, plan = operators.BwdWs.tile(TritonBackend(), p), TritonBackend().backward_plan(p)
    expected = causal and (group >= 4 or deterministic) and config.head_block(head_dim) == 128
    assert tile.key_major is expected
    assert tile == replace(config.BWD_WS_SM90[config.head_block(head_dim)], key_major=expected)
    assert tile == config.bwd_ws_tile(head_dim, causal, group, deterministic)
    assert ("key-major grid" in plan.kernel) is expected


def test_head_dims_above_128_take_the_split_kernel(sm90):
    """Every head dim padded into a split tile's block (between 129 and 256) runs bwd_ws_split's tile by default
    (measured faster than the one-launch kernel at d192 and d256, which pads the same way); the unsplit tiles serve
    the rest of the table."""
    for block in SPLIT:
        for head_dim in range(block // 2 + 8, block + 1, 8):
            assert ws_reasons(TritonBackend(), problem(head_dim=head_dim)) == []
            assert operators.BwdWs.tile(TritonBackend(), problem(head_dim=head_dim)).split_d
            assert TritonBackend().backward_plan(problem(head_dim=head_dim)).kernel.startswith("bwd_ws_split ")
    for head_dim in UNSPLIT:
        assert not operators.BwdWs.tile(TritonBackend(), problem(head_dim=head_dim)).split_d
        assert TritonBackend().backward_plan(problem(head_dim=head_dim)).kernel.startswith("bwd_ws ")
    assert ws_reasons(TritonBackend(), problem(head_dim=72)) == ["head dim 72: the one-launch kernel measured faster"]


@pytest.mark.parametrize("cap_mib", [64, 40])
def test_a_workspace_cap_bounds_the_dq_accumulator(sm90, cap_mib):
    """Under `max_workspace_bytes`, the warp-specialised plan is chunked by kv-head groups like any other:
    every chunk's dq_accum fits, the chunks cover every kv head once, and each chunk still runs bwd_ws."""
    from flash_attn_ck.pipeline.chunking import plan_chunks
    p = problem(heads=(32, 8), causal=True)
    cap = cap_mib * 2 ** 20
    plan = plan_chunks(p, TritonBackend(), cap)
    assert plan.peak_bytes <= cap < plan.unchunked_bytes
    assert plan.per_chunk.kernel.startswith("bwd_ws")
    acc = next(b for b in plan.per_chunk.buffers if b.name == "dq_accum")
    assert acc.shape[-2] % p.group_size == 0 and acc.nbytes <= cap


@settings(max_examples=30, deadline=None)
@given(cap_mib=st.integers(1, 300))
def test_a_cap_below_its_smallest_chunk_runs_the_one_launch_kernel(cap_mib):
    """Property over caps (GQA 32/8 d128 s8192 causal): where a chunking of bwd_ws fits, bwd_ws runs; below its
    smallest chunk the one-launch kernel (no fp32 dQ accumulator) runs instead, with the other options kept;
    only below the one-launch kernel's own smallest chunk does planning fail. Every plan fits its cap."""
    from flash_attn_ck.core.errors import WorkspaceError
    from flash_attn_ck.pipeline.chunking import _grid, _Planner, _row_sizes, plan_chunks

    def smallest(b, p):
        return _Planner(p, b, None).cost(_grid(p, 1, 1, 1, _row_sizes(p, b)[-1])).peak_bytes

    cap = cap_mib << 20
    with pretend_capability():
        p = problem(heads=(32, 8), causal=True)
        backend = TritonBackend(gqa_epilogue="accumulate", fwd_ws=False)
        ws_min, lean_min = smallest(backend, p), smallest(backend.leaner(), p)
        try:
            plan = plan_chunks(p, backend, cap)
        except WorkspaceError:
            assert cap < lean_min
            return
    assert lean_min < ws_min and plan.peak_bytes <= cap
    if cap >= ws_min:
        assert plan.runner is backend and plan.per_chunk.kernel.startswith("bwd_ws") and not plan.note
    else:
        assert plan.per_chunk.kernel.startswith("bwd_main") and "leaner setup runs" in plan.note
        assert (plan.runner.ws, plan.runner.gqa_epilogue, plan.runner.fwd_ws) == (False, "accumulate", False)


def test_leaner_is_the_one_launch_kernel():
    assert TritonBackend(ws=False).leaner() is None
    lean = TritonBackend(dq_mode="pass", use_tma=True, ws=True).leaner()
    assert (lean.ws, lean.dq_mode, lean.use_tma) == (False, "pass", True)


@pytest.mark.parametrize("heads_k,per_launch", [(3, 2), (5, 2), (4, 2), (3, 1)])
def test_every_deterministic_launch_gets_zeroed_semaphores_in_the_kernels_layout(monkeypatch, heads_k, per_launch):
    """The deterministic backward in several kv-head launches: each launch's semaphores are the dense
    (batch, the launch's query heads, query tiles) tensor the kernel indexes (`(b * heads + head) * tiles + m`), all
    zero when it starts, also when the last launch has fewer heads than the buffer was sized for (a narrowed view
    kept the full head stride: the kernel read the previous launch's counts and its dQ adds waited forever)."""
    from flash_attn_ck.backends.triton import backend as triton_backend
    from flash_attn_ck.backends.triton.gluon import bwd_ws
    from flash_attn_ck.core.inputs import describe_call
    from flash_attn_ck.core.options import AttentionOptions
    from flash_attn_ck.core.problem import AttentionParams

    batch, seqlen, group, d = 2, 64, 2, 128
    seen = []

    def launch(*args, semaphores, **kwargs):
        seen.append((semaphores.shape, semaphores.is_contiguous(), bool((semaphores == 0).all()),
                     args[0].shape[-2]))
        semaphores.fill_(7)             # what a kernel leaves behind: counts

    class Zero:         # launch.zero_flat on the CPU: the buffers it is given, zeroed
        def __init__(self, *buffers):
            assert all(t.is_contiguous() for t in buffers)
            self.buffers = buffers

        def launch(self):
            for t in self.buffers:
                t.zero_()

    monkeypatch.setattr(operators, "_preprocess", lambda *a: None)
    monkeypatch.setattr(operators, "cast", lambda *a: None)
    monkeypatch.setattr(triton_backend.launch, "zero_flat", Zero)
    monkeypatch.setattr(bwd_ws, "launch", launch)
    monkeypatch.setattr(config, "BWD_WS_DQ_ACCUM_BYTES", per_launch * batch * seqlen * group * d * 4)
    q = torch.zeros(batch, seqlen, heads_k * group, d, dtype=torch.bfloat16)
    k = torch.zeros(batch, seqlen, heads_k, d, dtype=torch.bfloat16)
    p = describe_call(q, k, k, AttentionOptions(causal=True, deterministic=True))
    backend, tiles = TritonBackend(), 3
    assert operators.BwdWs.kv_heads_per_launch(backend, p) == per_launch
    workspace = {"softmax_d": torch.zeros(batch, heads_k * group, seqlen),      # as backward_plan sizes them
                 "dq_accum": torch.zeros(batch * seqlen, per_launch * group, d),
                 "dq_semaphore": torch.zeros(batch, per_launch * group, tiles, dtype=torch.int32)}
    lse = torch.zeros(batch, heads_k * group, seqlen)
    operators.BwdWs.run(backend, p, AttentionParams(q, k, k), q, lse, q, q.clone(), k.clone(), k.clone(), workspace)
    launches = -(-heads_k // per_launch)
    assert len(seen) == launches
    for i, (shape, contiguous, zero, launch_heads) in enumerate(seen):
        assert shape == (batch, launch_heads, tiles) and contiguous and zero, (i, shape, contiguous, zero)
