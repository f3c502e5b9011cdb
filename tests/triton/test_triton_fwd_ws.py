"""CPU tests of the warp-specialised Gluon forward (backends/triton/gluon/fwd_ws.py): its dispatch rule (its
operator's declarations, operators.FwdWs: on by default where measured faster, every unsupported feature named), the
dispatch itself, and that every kernel variant compiles to sm_90a with the instructions the design rests on and
without register spills where ptxas reports none. Its numerics run on the GPU (tests/gpu/test_triton.py,
scripts/lab/fwd_ws_check.py)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from gluon_compile import (  # noqa: E402
    SM90_SHARED_BYTES,
    compile_as_launched,
    compile_spec,
    fwd_spec,
    pretend_capability,
    ptxas_report,
    spill_allowance,
)

from cases import tile_head_dims  # noqa: E402
from flash_attn_ck.backends.triton import backend as triton_backend  # noqa: E402
from flash_attn_ck.backends.triton import config, operators  # noqa: E402
from flash_attn_ck.backends.triton.backend import TritonBackend  # noqa: E402
from flash_attn_ck.core.mask import MaskInfo  # noqa: E402
from flash_attn_ck.core.problem import AttentionParams, AttentionProblem  # noqa: E402


@pytest.fixture
def sm90():
    """Pretend the problem's CUDA device is an sm_90 part (the rule reads only its capability)."""
    with pretend_capability():
        yield


def problem(seqlen=4096, head_dim=128, heads=(16, 16), batch=2, dtype=torch.bfloat16, causal=False,
            window=(-1, -1), scale=None, **features):
    mask = MaskInfo.from_flash_args(causal, window, seqlen, seqlen)
    return AttentionProblem(batch, seqlen, seqlen, *heads, head_dim, dtype, torch.device("cuda"), mask,
                            head_dim ** -0.5 if scale is None else scale, **features)


# ---- where it runs ------------------------------------------------------------------------------
def test_runs_where_it_measured_faster(sm90):
    """fwd_ws=None runs the kernel for the head dims of FWD_WS_DEFAULT_HEAD_DIMS from their FWD_WS_MIN_SEQLEN on;
    fwd_ws=True wherever it can, any length; fwd_ws=False never."""
    for d in sorted(config.FWD_WS_DEFAULT_HEAD_DIMS):
        long = config.FWD_WS_MIN_SEQLEN[config.head_block(d)]
        short = long - 1
        assert TritonBackend().reasons(problem(head_dim=d, seqlen=long), operators.FwdWs) == []
        reasons = TritonBackend().reasons(problem(head_dim=d, seqlen=short), operators.FwdWs)
        assert len(reasons) == 1 and f"shorter than {long}" in reasons[0], reasons
        assert TritonBackend(fwd_ws=True).reasons(problem(head_dim=d, seqlen=short), operators.FwdWs) == []
    for p in (problem(causal=True), problem(heads=(32, 8)), problem(heads=(8, 1), seqlen=100),
              problem(window=(64, 32)), problem(dtype=torch.float16), problem(deterministic=True),
              problem(head_dim=96), problem(head_dim=192), problem(head_dim=256), problem(head_dim=40)):
        assert TritonBackend(fwd_ws=True).reasons(p, operators.FwdWs) == []
    assert TritonBackend(fwd_ws=False).reasons(problem(), operators.FwdWs) == [
        "turned off (TritonBackend(fwd_ws=False))"]


def test_a_measured_head_dim_turns_it_on(sm90, monkeypatch):
    monkeypatch.setattr(operators.FwdWs, "default_head_dims", frozenset({128}))
    assert TritonBackend().reasons(problem(), operators.FwdWs) == []
    assert TritonBackend().reasons(problem(head_dim=64), operators.FwdWs) == [
        "head dim 64: not measured faster than the previous forward (TritonBackend(fwd_ws=True) runs it)"]


@settings(max_examples=40, deadline=None)
@given(head_dim=st.sampled_from([32, *tile_head_dims(config.FWD_WS_SM90)]), causal=st.booleans(), gqa=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       seqlen=st.integers(1, 3 * max(config.FWD_WS_MIN_SEQLEN.values())))
def test_the_default_runs_it_exactly_where_measured(head_dim, causal, gqa, dtype, seqlen):
    """Property: with the default options the forward runs fwd_ws on a supported call exactly when its head
    dim is in FWD_WS_DEFAULT_HEAD_DIMS and its longest sequence reaches its head block's FWD_WS_MIN_SEQLEN."""
    with pretend_capability():
        p = problem(head_dim=head_dim, causal=causal, heads=(16, 4 if gqa else 16), dtype=dtype, seqlen=seqlen)
        runs = not TritonBackend().reasons(p, operators.FwdWs)
    d = p.head_dim_padded
    measured = d in config.FWD_WS_DEFAULT_HEAD_DIMS and seqlen >= config.FWD_WS_MIN_SEQLEN[config.head_block(d)]
    assert runs == measured


FEATURES = {"float32": dict(dtype=torch.float32), "head dim 16": dict(head_dim=16),
            "head dim 32": dict(head_dim=32), "softmax scale": dict(scale=-0.1)}


@settings(max_examples=40, deadline=None)
@given(names=st.sets(st.sampled_from(sorted(FEATURES)), min_size=1), forced=st.booleans(),
       capability=st.sampled_from([(9, 0), (8, 0), (10, 0)]))
def test_every_unsupported_feature_is_named(names, forced, capability):
    """Each feature the kernel does not implement keeps the call on the current forward, with its name;
    so does a GPU other than sm_90."""
    kwargs = {}
    for name in names:
        kwargs.update(FEATURES[name])
    if "head dim 16" in names and "head dim 32" in names:
        names = names - {"head dim 16"}
        kwargs["head_dim"] = 32
    with pretend_capability(capability):
        reasons = TritonBackend(fwd_ws=forced or None).reasons(problem(**kwargs), operators.FwdWs)
    for name in names:
        assert any(name in r for r in reasons), (name, reasons)
    assert any("sm_90" in r for r in reasons) == (capability != (9, 0)), reasons


def test_forward_kernel_names_the_kernel_and_why(sm90):
    assert TritonBackend(fwd_ws=True).forward_kernel(problem()).startswith("fwd_ws")
    assert TritonBackend().forward_kernel(problem()).startswith("fwd_ws")
    short = TritonBackend().forward_kernel(problem(seqlen=config.FWD_WS_MIN_SEQLEN[128] - 1))
    assert short.startswith("forward (") and "fwd_ws not used: sequences shorter than" in short
    assert "dropout" in TritonBackend().forward_kernel(problem(dropout_p=0.1))
    assert TritonBackend(fwd_ws=True).forward_kernel(problem(dropout_p=0.1)).startswith("fwd_ws")


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("forced", [True, None])
def test_forward_dispatches_on_the_reasons(sm90, monkeypatch, forced, causal):
    """forward() launches fwd_ws exactly when operators.FwdWs has no reasons, else the current kernel; with the
    tile of the call's head dim and causality."""
    from flash_attn_ck.backends.triton.gluon import fwd_ws
    from flash_attn_ck.backends.triton.runtime import launch
    calls = []
    monkeypatch.setattr(triton_backend, "_prepare_launch", lambda: None)
    monkeypatch.setattr(fwd_ws, "launch", lambda *a, **kw: calls.append(("fwd_ws", kw)))

    class Spec:
        def launch(self):
            calls.append(("forward", {}))
    monkeypatch.setattr(launch, "forward", lambda *a, **kw: Spec())
    monkeypatch.setattr(TritonBackend, "tma_plan", lambda self, p, role, *t: "none")
    s = config.FWD_WS_MIN_SEQLEN[128] - 1      # the default keeps the current kernel
    p = problem(seqlen=s, heads=(8, 2), causal=causal)
    q = torch.zeros(2, s, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, s, 2, 128, dtype=torch.bfloat16)
    backend = TritonBackend(fwd_ws=forced)
    backend.forward(p, AttentionParams(q, k, k), torch.empty_like(q), torch.empty(2, 8, s))
    assert [c[0] for c in calls] == (["fwd_ws"] if forced else ["forward"])
    if forced:
        kw = calls[0][1]
        flags = kw["mask"].flags
        assert kw["tile"] == config.FWD_WS_SM90[128][causal] and causal == flags.HAS_RIGHT and not flags.HAS_LEFT


@pytest.mark.parametrize("head_dims", [(192, 128), (256, 200), (128, 64), (64, 128), (96, 96), (96, 40), (64, 40)])
@pytest.mark.parametrize("forced", [False, True], ids=["defaults", "forced"])
def test_a_value_head_dim_no_wider_than_q_k_s_runs_on_fwd_ws(sm90, monkeypatch, head_dims, forced):
    """fwd_ws takes a v no wider than q/k (MLA's (192, 128)) at v's own head dim, never a wider one: forced on, or by
    default in the head blocks of its narrower_value_head_blocks (config.FWD_WS_NARROWER_VALUE_HEAD_BLOCKS; a
    stand-in here: 256), the plan line saying so; else the reasons say why."""
    monkeypatch.setattr(operators.FwdWs, "narrower_value_head_blocks", frozenset({256}))
    d, d_v = head_dims
    p = problem(head_dim=d, heads=(8, 2), causal=True, head_dim_v=d_v)
    backend = TritonBackend(fwd_ws=forced or None)
    runs = d_v <= d and (forced or d_v == d or config.head_block(d) == 256)
    line = backend.forward_kernel(p)
    assert (backend.operator(p, "forward") is operators.FwdWs) is runs, line
    if d_v > d:
        assert "value head dim 128 above q/k's 64: its O leaves through q's shared-memory tile" in line
    elif not runs:
        assert f"value head dim {d_v} below q/k's {d}: not measured faster" in line
    elif d_v < d:
        assert f"v at v's own head block {config.head_block(d_v)}" in line, line


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_a_narrower_v_and_its_out_reach_the_kernel_as_they_are(sm90, monkeypatch, varlen):
    """FwdWs.run, forced on, on a (192, 128) call hands fwd_ws.launch the call's own v and out (no padded copies: the
    kernel's V and O tiles have v's head block)."""
    from flash_attn_ck.backends.triton.gluon import fwd_ws
    seen = []
    monkeypatch.setattr(fwd_ws, "launch", lambda q, k, v, out, *args, **kwargs: seen.append((v, out)))
    shape = (300,) if varlen else (1, 300)
    q, k = torch.zeros(*shape, 8, 192, dtype=torch.bfloat16), torch.zeros(*shape, 2, 192, dtype=torch.bfloat16)
    v, out = torch.zeros(*shape, 2, 128, dtype=torch.bfloat16), torch.empty(*shape, 8, 128, dtype=torch.bfloat16)
    lse = torch.empty(8, 300) if varlen else torch.empty(1, 8, 300)
    p = problem(seqlen=300, head_dim=192, heads=(8, 2), batch=1, causal=True, head_dim_v=128)
    operators.FwdWs.run(TritonBackend(fwd_ws=True), p, AttentionParams(q, k, v), out, lse)
    assert len(seen) == 1 and seen[0][0] is v and seen[0][1] is out


@pytest.mark.parametrize("head_dims", [(192, 128), (128, 64)])
def test_a_narrower_v_compiles_with_v_s_own_tiles(head_dims):
    """fwd_ws for a (d, d_v) call compiles for sm_90a with the K/V ring's V half and the P V matmul at v's head block:
    shared memory smaller than the (d, d) kernel's by exactly NUM_STAGES V tiles' narrower columns, and each P V
    wgmma's N (the O accumulator's width) v's head block."""
    d, d_v = head_dims
    tile = config.fwd_ws_tile(d, True)
    same, narrower = (compile_spec(fwd_spec(tile, d, False, (False, False, True), head_dim_v=width))
                      for width in (None, d_v))
    saved = tile.num_stages * tile.block_n * (config.head_block(d) - config.head_block(d_v)) * 2   # bf16
    assert same.metadata.shared - narrower.metadata.shared == saved
    widths = {int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", narrower.asm["ptx"])}
    assert widths == {tile.block_n, config.head_block(d_v)}


@pytest.mark.parametrize("head_dims,tail", [((192, 128), 64), ((160, 128), 32), ((136, 64), 32), ((192, 192), 0),
                                             ((128, 64), 0), ((256, 128), 0)])
def test_q_k_take_a_tail_block_where_config_turns_it_on(sm90, monkeypatch, head_dims, tail):
    """With config.FWD_WS_QK_TAIL on, fwd_ws loads q/k of a head dim in 129-192 beside a v of at most 128 as a
    128-column block and a tail block of the rest (a power of two of columns), and runs the d128 tile; other calls,
    and every call with it off, take the head block whole."""
    from flash_attn_ck.backends.triton.gluon import fwd_ws
    d, d_v = head_dims
    p = problem(head_dim=d, heads=(8, 2), causal=True, head_dim_v=d_v)
    for on in (False, True):
        monkeypatch.setattr(config, "FWD_WS_QK_TAIL", on)
        seen = []
        monkeypatch.setattr(fwd_ws, "launch", lambda *args, **kwargs: seen.append(kwargs))
        q = torch.zeros(2, 2048, 8, d, dtype=torch.bfloat16)
        k, v = torch.zeros(2, 2048, 2, d, dtype=torch.bfloat16), torch.zeros(2, 2048, 2, d_v, dtype=torch.bfloat16)
        operators.FwdWs.run(TritonBackend(fwd_ws=True), p, AttentionParams(q, k, v), q.new_empty(2, 2048, 8, d_v),
                            torch.empty(2, 8, 2048))
        want = tail if on else 0
        assert seen[0]["qk_tail"] == want
        assert seen[0]["tile"] == (config.FWD_WS_SM90[128][True] if want else config.fwd_ws_tile(d, True))
        spec = fwd_spec(seen[0]["tile"], d, False, (False, False, True), head_dim_v=d_v, qk_tail=want)
        boxes = [spec.args[name].block_shape[-1] if spec.args[name] is not None else 0
                 for name in ("q_desc", "k_desc", "q_tail_desc", "k_tail_desc")]
        assert boxes == ([128, 128, want, want] if want else [config.head_block(d)] * 2 + [0, 0])
        assert spec.args["CALL"] == replace(spec.args["CALL"], QK_TAIL=want)
        assert (f"q/k as 128 + {want} columns" in operators.FwdWs.describe(TritonBackend(fwd_ws=True), p)) is bool(want)


def test_a_tail_block_takes_exactly_its_columns_of_shared_memory():
    """fwd_ws at (192, 128) compiles for sm_90a with q/k in a 128-column block and a 64-column tail: shared memory
    smaller than with the 256-column head block by 64 columns of the Q tiles and the K ring (to the allocator's
    alignment of its two more buffers), on the same tile."""
    tile = config.fwd_ws_tile(256, True)      # a tile both fit
    whole, split = (compile_spec(fwd_spec(tile, 192, False, (False, False, True), head_dim_v=128, qk_tail=tail))
                    for tail in (0, 64))
    saved = (tile.block_m + tile.num_stages * tile.block_n) * 64 * 2      # bf16
    assert saved - 1024 < whole.metadata.shared - split.metadata.shared <= saved


# ---- the kernel compiles for sm_90a here (no GPU: ptxas from the triton wheel) ------------------------
def _compile(tile, head_dim, varlen, masks, overlap, pingpong=False):
    """The kernel fwd_ws.launch runs for `tile` with `overlap` and `pingpong`, compiled for sm_90a."""
    return compile_spec(fwd_spec(replace(tile, overlap=overlap, pingpong=pingpong), head_dim, varlen, masks))


# A 3-D TMA load into shared memory: its destination is spelt shared::cluster up to Triton 3.6, shared::cta from 3.7
# (the same copy into this CTA's shared memory).
TMA_LOAD_3D = r"cp\.async\.bulk\.tensor\.3d\.shared::(?:cluster|cta)\.global"

MASKS = {"dense": (False, (False, False, False)), "causal": (False, (False, False, True)),
         "window": (False, (False, True, True)), "varlen": (True, (False, False, False)),
         "varlen-causal": (True, (False, False, True)), "top-left-window": (True, (True, True, True))}
# Every mask variant (each is a separate kernel) at each head dim of the table; at a head dim padded into each
# (3/4 of its block: d96 runs in d128's tiles, d192 in d256's) the dense and varlen-causal ones. GQA is the runtime
# `group`: no variant.
VARIANTS = [(d, mask) for d in sorted(config.FWD_WS_SM90) for mask in sorted(MASKS)] + \
           [(d * 3 // 4, mask) for d in sorted(config.FWD_WS_SM90) for mask in ("dense", "varlen-causal")]


@pytest.mark.parametrize("head_dim,mask", VARIANTS)
@pytest.mark.parametrize("overlap,pingpong", [(True, False), (False, False), (True, True)],
                         ids=["overlap", "no-overlap", "overlap-pingpong"])
def test_kernel_compiles_to_the_designed_instructions(head_dim, overlap, pingpong, mask):
    tile = config.fwd_ws_tile(head_dim, causal=False)
    varlen, masks = MASKS[mask]
    kernel = _compile(tile, head_dim, varlen, masks, overlap, pingpong)
    assert kernel.metadata.shared <= SM90_SHARED_BYTES   # the tile launches: its buffers fit one SM's shared memory
    ptx = kernel.asm["ptx"]
    # S = Q K^T from shared memory and P V with P from registers, per consumer warpgroup: 2 x (d/16 + block_n/16)
    # wgmma per key tile (the overlapped loop has a prologue S and an epilogue P V besides).
    wgmmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, (\{|%rd)", ptx)
    register_a = sum(1 for operand in wgmmas if operand == "{")
    per_tile = config.head_block(head_dim) // 16 + tile.block_n // 16
    assert len(wgmmas) == 2 * per_tile * (2 if overlap else 1)
    assert register_a == 2 * (tile.block_n // 16) * (2 if overlap else 1)
    # TMA loads (boxes of one head: 3-D) behind mbarriers, the output's TMA store, the K/V ring's waits and
    # releases, and the register budgets: two consumer warpgroups at 240 (+ the default's rest), the loader at 24.
    assert re.search(TMA_LOAD_3D + r"\.mbarrier::complete_tx::bytes", ptx)
    assert "cp.async.bulk.tensor.3d.global.shared::cta" in ptx
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive.shared::cta.b64" in ptx
    assert "mbarrier.arrive.expect_tx" in ptx
    # Waits: the loader's two ring slots; per consumer Q, the K/V ring at each matmul-issue site and, with
    # ping-pong, its turn at each of those sites (prologue, loop, epilogue with the overlap; S and P V without).
    issue_sites = 3 if overlap else 2
    ring_waits = 4 if overlap else 2
    assert ptx.count("mbarrier.try_wait") == 2 + 2 * (1 + ring_waits + (issue_sites if pingpong else 0))
    assert re.search(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    # The consumers fit their 240 registers: the overlap variants at d >= 96 hold the next S beside P and O and
    # spill a few words (4-12 bytes), no variant more.
    assert ptxas_report(ptx)["spill_stores"] <= spill_allowance(16)


@pytest.mark.parametrize("head_dim,block_n", [(64, 128), (128, 64)])
@pytest.mark.parametrize("mask", ["dense", "varlen-causal", "top-left-window"])
@pytest.mark.parametrize("pingpong", [False, True], ids=["free", "pingpong"])
def test_three_consumers_compile_to_the_designed_instructions(head_dim, block_n, mask, pingpong):
    """Three consumer warpgroups (FA3's d64 shape: 192 query rows per CTA): each issues its own S and P V per key tile,
    the loader fills three Q tiles behind one barrier, the consumers get 160 registers each and do not spill."""
    tile = config.FwdWsTile(192, block_n, overlap=False, pingpong=pingpong, consumers=3)
    assert tile.consumer_regs == 160
    varlen, masks = MASKS[mask]
    kernel = _compile(tile, head_dim, varlen, masks, overlap=False, pingpong=pingpong)
    assert kernel.metadata.shared <= SM90_SHARED_BYTES
    ptx = kernel.asm["ptx"]
    wgmmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, (\{|%rd)", ptx)
    assert len(wgmmas) == 3 * (head_dim // 16 + block_n // 16)
    assert sum(1 for operand in wgmmas if operand == "{") == 3 * (block_n // 16)   # P from registers
    # three Q tiles, K and V per key tile; a box row wider than the 128-byte swizzle goes as one copy per 128 bytes
    copies_per_tile = head_dim * 2 // 128
    assert len(re.findall(TMA_LOAD_3D, ptx)) == (3 + 2) * copies_per_tile
    # Waits: the loader's two ring slots; per consumer Q, K and V and, with ping-pong, its turn before S and P V.
    assert ptx.count("mbarrier.try_wait") == 2 + 3 * (3 + (2 if pingpong else 0))
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+160;", ptx)
    assert ptxas_report(ptx)["spill_stores"] <= spill_allowance(0)
    assert config.FwdWsTile.parse(str(tile)) == tile


@settings(max_examples=60, deadline=None)
@given(block_m=st.integers(1, 512), consumers=st.integers(-1, 6))
@example(block_m=128, consumers=2)
@example(block_m=192, consumers=3)
@example(block_m=128, consumers=3)
@example(block_m=256, consumers=4)
def test_a_tile_needs_64_query_rows_per_consumer(block_m, consumers):
    """FwdWsTile takes two or three consumer warpgroups of 64 query rows each (a wgmma's M) and nothing else."""
    if consumers in (2, 3) and block_m == 64 * consumers:
        assert config.FwdWsTile(block_m, 128, consumers=consumers).consumer_regs == {2: 240, 3: 160}[consumers]
    else:
        with pytest.raises(ValueError, match=f"{consumers} consumers with block_m {block_m}.*64 query rows each"):
            config.FwdWsTile(block_m, 128, consumers=consumers)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), seqlen=st.integers(1, 700), heads=st.integers(1, 4), query_major=st.booleans())
def test_the_grid_is_query_major_when_asked(batch, seqlen, heads, query_major):
    """fwd_ws.launch_spec (CPU tensors): the grid is (query tiles, batch, heads), or (heads, batch, query tiles) with
    FwdWsTile.query_major, and the kernel is told which (QUERY_MAJOR)."""
    from flash_attn_ck.backends.triton.gluon import fwd_ws
    from flash_attn_ck.backends.triton.runtime.launch import GluonMask, MaskFlags

    tile = config.FwdWsTile(128, 128, query_major=query_major)
    q = torch.zeros(batch, seqlen, heads, 64, dtype=torch.bfloat16)
    spec, _ = fwd_ws.launch_spec(q, q.clone(), q.clone(), torch.empty_like(q), torch.empty(batch, heads, seqlen), None,
                                 None, varlen=False, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, scale=0.1,
                                 mask=GluonMask((0, 0), MaskFlags(HAS_RIGHT=True)), tile=tile)
    tiles = -(-seqlen // tile.block_m)
    assert spec.grid == ((heads, batch, tiles) if query_major else (tiles, batch, heads))
    assert spec.args["TILE"].query_major is query_major
    assert config.FwdWsTile.parse(str(tile)) == tile


def test_a_query_major_grid_counts_query_tiles_in_z():
    """QUERY_MAJOR swaps the axes the kernel reads: the last-tile-first order counts the query tiles in the grid's z
    dimension (%nctaid.z) instead of x."""
    tile = config.FWD_WS_SM90[128][True]
    for query_major, axis in ((False, "x"), (True, "z")):
        ptx = _compile(replace(tile, query_major=query_major), 128, True, (False, False, True), True).asm["ptx"]
        assert f"%nctaid.{axis}" in ptx and f"%nctaid.{'xz'.replace(axis, '')}" not in ptx


@pytest.mark.parametrize("term", ["none", "softcap sink", "alibi"])
@pytest.mark.parametrize("head_dim", sorted(config.FWD_WS_SM90))
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_a_few_queries_against_long_keys_compile_as_launched(head_dim, seqlen_q, term):
    """The defaults run fwd_ws on these (the longest sequence decides), with the sink, the softcap and ALiBi: at
    s_q = 1 lse's head stride is 1 and a launch specialises it to the constant 1, which reaches the consumer
    partitions (the class of compile failures the one-launch backward had at one query row)."""
    from flash_attn_ck.backends.triton.gluon import fwd_ws
    from flash_attn_ck.backends.triton.runtime.launch import GluonMask, MaskFlags
    q, out = (torch.empty(2, seqlen_q, 8, head_dim, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.empty(2, 4096, 2, head_dim, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.empty(2, 8, seqlen_q)
    cu = torch.tensor([0, seqlen_q], dtype=torch.int32)
    spec, _ = fwd_ws.launch_spec(q, k, v, out, lse, cu, cu, varlen=False, batch=2, seqlen_q=seqlen_q, seqlen_k=4096,
                                 scale=0.1, mask=GluonMask((0, 0), MaskFlags(False, False, True)),
                                 tile=config.fwd_ws_tile(head_dim, causal=True),
                                 softcap=30.0 if "softcap" in term else 0.0,
                                 sink=torch.zeros(8) if "sink" in term else None,
                                 alibi=(torch.rand(8), 0) if term == "alibi" else None)
    assert seqlen_q > 1 or spec.args["strides"][-1] == 1, spec.args["strides"]
    assert "wgmma.mma_async" in compile_as_launched(spec).asm["ptx"]
