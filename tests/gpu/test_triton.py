"""GPU tests of the Triton backend (skipped without CUDA): the feature grid through the public API
(backend="triton") against the float64 oracle of tests/oracle.py under the 2x rule (docs/semantics.md), both GQA
epilogues, both dQ modes, varlen with empty sequences, and bit-identical deterministic repeats."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cases import (
    COMMON_FEATURES,
    HEAD_DIMS,
    check_case,
    check_mask_kind,
    feature_case,
    head_dim_case,
    make_inputs,
    mask_kind_grid,
    run_ours,
    tile_head_dims,
)
from oracle import Config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import flash_attn_ck  # noqa: E402
from flash_attn_ck import use_backend  # noqa: E402
from flash_attn_ck.backends.triton import TritonBackend, config, operators  # noqa: E402
from flash_attn_ck.core.inputs import describe_call, kernel_params  # noqa: E402
from flash_attn_ck.core.mask import MaskInfo  # noqa: E402
from flash_attn_ck.core.options import AttentionOptions  # noqa: E402
from flash_attn_ck.pipeline.backward import run_backward  # noqa: E402


# The test shapes are short (config.SHORT_SEQLEN), where the defaults move tiles by pointers; the
# use_tma=True rows force TMA loads, stores and bulk reduce-adds so that those paths are tested too.
@pytest.fixture(params=[dict(), dict(dq_mode="pass"), dict(gqa_epilogue="accumulate"), dict(dq_mode="atomic"),
                        dict(use_tma=True), dict(use_tma=True, gqa_epilogue="accumulate"), dict(ws=True)],
                ids=["defaults", "loop-pass", "accumulate", "atomic-dq", "tma", "tma-accumulate", "ws"])
def backend_options(request):
    """Install a TritonBackend with the given options as the one the dispatcher hands out."""
    with use_backend(TritonBackend(**request.param)):
        yield request.param


def _check(cfg: Config, seed: int = 0):
    check_case(cfg, backend="triton", device="cuda", seed=seed)


# Both backward kernels and both forward kernels: ws=False the one-launch backward, ws=True the
# warp-specialised one wherever it can run (bwd_ws up to head dim 128, bwd_ws_split above; no dropout/ALiBi/
# softcap; other cases fall back); fwd_ws=True the warp-specialised forward wherever it can run (no
# dropout/ALiBi/softcap), fwd_ws=False the current forward.
KERNELS = {"one-launch": dict(ws=False, fwd_ws=False), "ws": dict(ws=True, fwd_ws=False),
           "fwd_ws": dict(ws=False, fwd_ws=True)}


# Head dims drawn from the warp-specialised tile tables (config), so that a tile added there is tested here.
UNSPLIT = [d for d, tile in sorted(config.BWD_WS_SM90.items()) if not tile.split_d]   # bwd_ws's tiles
# Each backward tile's head dim, and under a split_d tile (bwd_ws_split pads every head dim above 128) one it pads.
BWD_WS_HEAD_DIMS = {f"split-d{d}" if tile.split_d else f"d{d}": d for d, tile in sorted(config.BWD_WS_SM90.items())}
BWD_WS_PADDED = {f"split-d{d * 3 // 4}": d * 3 // 4 for d, tile in sorted(config.BWD_WS_SM90.items()) if tile.split_d}
BOTH_WS_TABLES = sorted(set(config.BWD_WS_SM90) & set(config.FWD_WS_SM90))


@pytest.fixture(params=list(KERNELS.values()), ids=list(KERNELS))
def kernel(request):
    with use_backend(TritonBackend(**request.param)):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims(head_dim, dtype, kernel):
    _check(head_dim_case(head_dim, dtype))


@pytest.mark.parametrize("head_dim", UNSPLIT)
@pytest.mark.parametrize("kind,seqlens", mask_kind_grid(TritonBackend.mask_kinds))
@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_every_declared_mask_kind_matches_the_oracle(kernel_name, kind, seqlens, head_dim):
    """Each mask kind TritonBackend declares, on each of its kernels, called below the public API (which
    makes only flash-attn's kinds)."""
    check_mask_kind(TritonBackend(**KERNELS[kernel_name]), kind, seqlens, device="cuda", head_dim=head_dim)


FEATURES = {
    **COMMON_FEATURES,
    "softcap": dict(softcap=8.0),
    "alibi_softcap_window": dict(alibi=True, softcap=5.0, window=(40, 3)),
    "dropout": dict(dropout_p=0.17),
    "dropout_causal_gqa": dict(dropout_p=0.3, causal=True, heads_q=6, heads_k=2),
}



@pytest.mark.parametrize("head_dim", UNSPLIT)
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_features(name, head_dim, kernel):
    _check(feature_case(FEATURES[name], head_dim))


@pytest.mark.parametrize("head_dim", [*BWD_WS_HEAD_DIMS.values(), *BWD_WS_PADDED.values()],
                         ids=[*BWD_WS_HEAD_DIMS, *BWD_WS_PADDED])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(300, 300), (100, 333), (333, 100)], ids=["square", "sq<sk", "sq>sk"])
def test_ws_kernel_runs_and_matches(group, causal, seqlens, head_dim):
    """The warp-specialised kernel itself (the plan names it; bwd_ws_split above head dim 128) on GQA ratios 1-8
    and s_q != s_k."""
    backend = TritonBackend(ws=True)
    cfg = Config(batch=2, seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=8, heads_k=8 // group,
                 head_dim=head_dim, causal=causal)
    q, k, v, _, _ = make_inputs(cfg, "cuda", seed=group)
    plan = backend.backward_plan(describe_call(q, k, v, AttentionOptions(causal=causal)))
    assert plan.kernel.startswith("bwd_ws"), plan.kernel
    with use_backend(backend):
        _check(cfg, seed=group)


@pytest.mark.parametrize("head_dim", BWD_WS_HEAD_DIMS.values(), ids=BWD_WS_HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 64])
def test_a_few_queries_against_long_keys(seqlen_q, causal, group, head_dim):
    """The default backend runs these on the warp-specialised kernels (max(s_q, s_k) >= 2048) with launch constants
    of 1 (lse's head stride at s_q = 1, one semaphore row per head at s_q <= 64): bwd_ws_split failed to compile."""
    cfg = Config(batch=2, seqlen_q=seqlen_q, seqlen_k=4096, heads_q=8, heads_k=8 // group, head_dim=head_dim,
                 causal=causal)
    q, k, v, _, _ = make_inputs(cfg, "cuda", seed=group)
    plan = TritonBackend().backward_plan(describe_call(q, k, v, AttentionOptions(causal=causal)))
    assert plan.kernel.startswith("bwd_ws"), plan.kernel
    with use_backend(TritonBackend()):
        _check(cfg, seed=group)


@pytest.mark.parametrize("head_dim", [40, 64, 80, 128])
@pytest.mark.parametrize("heads", [(9, 3), (12, 3), (8, 2)], ids=["9-3", "12-3", "8-2"])
@pytest.mark.parametrize("feature", [dict(alibi=True), dict(softcap=15.0)], ids=["alibi", "softcap"])
@pytest.mark.parametrize("ws", [False, None], ids=["one_launch", "default"])
def test_one_query_row_against_long_keys_on_the_one_launch_kernels(ws, feature, heads, head_dim):
    """GQA at s_q = 1 with s_k >= 2048 on the one-launch backward (TMA loads): the group loop is the innermost loop
    there and failed the MLIR pipeliner ('PassManager::run failed'); it compiles and matches the oracle. With the
    default settings the same calls at d64/d128 run where the defaults send the term (the warp-specialised backward
    takes the softcap, and ALiBi under config.WS_ALIBI_TRITON_RELEASES)."""
    cfg = Config(batch=2, seqlen_q=1, seqlen_k=2049, heads_q=heads[0], heads_k=heads[1], head_dim=head_dim, **feature)
    q, k, v, _, _ = make_inputs(cfg, "cuda", seed=head_dim)
    options = AttentionOptions(alibi_slopes=torch.ones(heads[0], device="cuda") if cfg.alibi else None,
                               softcap=cfg.softcap)
    backend = TritonBackend(ws=ws)
    plan = backend.backward_plan(describe_call(q, k, v, options))
    if ws is False or head_dim not in config.BWD_WS_DEFAULT_HEAD_DIMS:
        assert plan.kernel.startswith("bwd_main"), plan.kernel
    with use_backend(backend):
        _check(cfg, seed=head_dim)


# The reliability grid of one to three query rows against long keys: every head-dim class of the one-launch
# tables (each block and one head dim it pads), each feature that moves a call off the warp-specialised kernels,
# and the deterministic mode; GQA ratio and lengths drawn.
FEW_ROWS_FEATURES = {"plain": dict(), "alibi": dict(alibi=True), "softcap": dict(softcap=15.0),
                     "dropout": dict(dropout_p=0.2), "deterministic": dict(deterministic=True),
                     "alibi_causal": dict(alibi=True, causal=True)}


@pytest.mark.parametrize("head_dim", tile_head_dims({block for block, _causal in config.SM90}))
@pytest.mark.parametrize("feature", list(FEW_ROWS_FEATURES))
@settings(max_examples=3, deadline=None, derandomize=True)
@given(group=st.integers(2, 8), seqlen_q=st.integers(1, 3),
       seqlen_k=st.sampled_from([1024, 2048, 2049, 3001, 4096, 8192]))
def test_few_query_rows_against_long_keys_grid(feature, head_dim, group, seqlen_q, seqlen_k):
    """GQA 2-8, s_q 1-3, s_k 1024-8192 on the default backend compile and match the float64 oracle (issue class:
    the one-launch backward's group loop failed the MLIR pipeliner at s_q = 1)."""
    cfg = Config(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=2 * group, heads_k=2, head_dim=head_dim,
                 **FEW_ROWS_FEATURES[feature])
    _check(cfg, seed=seqlen_k + group)


def test_ws_kernel_varlen_empty_sequences():
    seqlens = [(37, 80), (0, 50), (130, 9), (64, 0), (1, 1), (0, 0), (200, 211), (257, 129)]
    cfg = Config(seqlens=seqlens, heads_q=8, heads_k=2, head_dim=128, causal=True)
    with use_backend(TritonBackend(ws=True)):
        out, (dq, dk, dv) = check_case(cfg, backend="triton", device="cuda")
    assert dk[80:130].abs().max() == 0 and dv[80:130].abs().max() == 0


@pytest.mark.parametrize("head_dim", sorted(config.FWD_WS_SM90))
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("mask", [dict(causal=False), dict(causal=True), dict(window=(64, 32)), dict(window=(17, -1))],
                         ids=["dense", "causal", "window", "window_left_only"])
@pytest.mark.parametrize("seqlens", [(300, 300), (100, 333), (333, 100), (256, 256)],
                         ids=["square", "sq<sk", "sq>sk", "full-tiles"])
def test_fwd_ws_kernel_runs_and_matches(head_dim, group, mask, seqlens):
    """The warp-specialised forward itself (forward_kernel names it) on GQA ratios 1-8, s_q != s_k, causal and
    windows: out and lse under the 2x rule (the backward reads that lse)."""
    backend = TritonBackend(fwd_ws=True)
    cfg = Config(batch=2, seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=8, heads_k=8 // group, head_dim=head_dim,
                 **mask)
    q, k, v, _, _ = make_inputs(cfg, "cuda", seed=group)
    options = AttentionOptions(causal=cfg.causal, window_size=cfg.window)
    assert backend.forward_kernel(describe_call(q, k, v, options)).startswith("fwd_ws")
    with use_backend(backend):
        _check(cfg, seed=group)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_ws_kernel_varlen_empty_sequences(causal, dtype):
    seqlens = [(37, 80), (0, 50), (130, 9), (64, 0), (1, 1), (0, 0), (200, 211), (257, 129)]
    cfg = Config(seqlens=seqlens, heads_q=8, heads_k=2, head_dim=128, causal=causal, dtype=dtype)
    with use_backend(TritonBackend(fwd_ws=True)):
        out, _ = check_case(cfg, backend="triton", device="cuda")
    # the query rows of the sequence without keys (rows 167..231) see no key: out = 0
    assert out[167:231].abs().max() == 0


@pytest.mark.parametrize("tile", ["192x128x2x0x0", "192x128x2x0x1"], ids=["free", "pingpong"])
@pytest.mark.parametrize("case", [
    dict(head_dim=64, seqlens=[(37, 80), (0, 50), (130, 9), (64, 0), (200, 211), (420, 429)], heads_k=2, causal=True),
    dict(head_dim=64, batch=2, seqlen_q=333, seqlen_k=500, heads_k=1, window=(70, 30)),
    dict(head_dim=128, batch=2, seqlen_q=700, seqlen_k=640, heads_k=4, causal=True),
], ids=["d64-varlen-causal-gqa", "d64-mqa-window", "d128-causal"])
def test_three_consumer_forward_matches(tile, case):
    """fwd_ws with three consumer warpgroups (FwdWsTile(192, ...), FA3's d64 shape; at d128 with 64 key rows): varlen
    with empty sequences, s_q != s_k, windows, GQA/MQA; out and lse under the 2x rule."""
    from dataclasses import replace

    from flash_attn_ck.backends.triton import config
    fwd_tile = config.FwdWsTile.parse(tile)
    if case["head_dim"] == 128:
        fwd_tile = replace(fwd_tile, block_n=64)   # 128 key rows at d128 spill at 160 registers
    cfg = Config(heads_q=8, **case)
    with use_backend(TritonBackend(fwd_ws=True, fwd_ws_tile=fwd_tile)):
        check_case(cfg, backend="triton", device="cuda", seed=3)


def _given_to_launches(monkeypatch, kernel: str, keyword: str) -> list:
    """The `keyword` argument of each launch of the Gluon kernel module `kernel` (fwd_ws, bwd_ws) during the test."""
    module = importlib.import_module(f"flash_attn_ck.backends.triton.gluon.{kernel}")
    given, real = [], module.launch
    monkeypatch.setattr(module, "launch",
                        lambda *args, **kwargs: (given.append(kwargs[keyword]), real(*args, **kwargs)))
    return given


# fwd_ws and bwd_ws with the softcap in their kernels (forced on: by default fwd_ws takes it in the head blocks of
# config.FWD_WS_SOFTCAP_HEAD_BLOCKS): caps small and large (tanh's series branch), causal GQA, a window, varlen with
# empty sequences, with a learnable sink.
WS_SOFTCAP_CASES = {
    "causal_gqa": dict(batch=2, seqlen_q=700, seqlen_k=700, heads_q=8, heads_k=2, softcap=8.0, causal=True),
    "window_large_cap": dict(batch=1, seqlen_q=513, seqlen_k=900, heads_q=4, heads_k=4, softcap=2e4, window=(100, 7)),
    "varlen_sink": dict(seqlens=[(300, 511), (0, 64), (257, 0), (129, 129)], heads_q=4, heads_k=1, softcap=30.0,
                        causal=True, sink_dtype=torch.float32),
}


# fwd_ws with dropout in its softmax step (forced on: by default it takes it in the head blocks of
# config.FWD_WS_DROPOUT_HEAD_BLOCKS): the same pattern as the reference, so out and lse match it.
WS_DROPOUT_CASES = {
    "causal_gqa": dict(batch=2, seqlen_q=700, seqlen_k=700, heads_q=8, heads_k=2, dropout_p=0.2, causal=True),
    "window_unaligned": dict(batch=1, seqlen_q=513, seqlen_k=901, heads_q=4, heads_k=4, dropout_p=0.5, window=(101, 7)),
    "varlen_sink_softcap": dict(seqlens=[(300, 511), (0, 64), (257, 0), (129, 129)], heads_q=4, heads_k=1,
                                dropout_p=0.1, softcap=30.0, causal=True, sink_dtype=torch.float32),
}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", sorted(WS_DROPOUT_CASES))
def test_fwd_ws_dropout_matches(monkeypatch, name, head_dim):
    given_dropout = _given_to_launches(monkeypatch, "fwd_ws", "dropout")
    cfg = Config(**WS_DROPOUT_CASES[name], head_dim=head_dim, dtype=torch.bfloat16)
    with use_backend(TritonBackend(fwd_ws=True)):
        check_case(cfg, backend="triton", device="cuda")
    assert given_dropout and all(d is not None and d[1] == cfg.dropout_p for d in given_dropout), given_dropout


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("launches", [1, 2], ids=["one_launch", "two_launches"])
@pytest.mark.parametrize("name", sorted(WS_DROPOUT_CASES))
def test_bwd_ws_dropout_matches(monkeypatch, name, head_dim, launches):
    """bwd_ws (bwd_ws_split above d128) with dropout in its P^T step (forced on), after fwd_ws's: gradients of the
    reference's pattern; with two launches (kv heads split by the dQ accumulator budget) the second launch's heads
    draw their own planes. bwd_ws_split takes no dropout with a softcap: that case runs the one-launch backward."""
    given_dropout = _given_to_launches(monkeypatch, "bwd_ws", "dropout")
    cfg = Config(**WS_DROPOUT_CASES[name], head_dim=head_dim, dtype=torch.bfloat16)
    if launches > 1:
        rows = sum(s_q for s_q, _ in cfg.seqlens) if cfg.seqlens else cfg.batch * cfg.seqlen_q
        per_kv_head = rows * (cfg.heads_q // cfg.heads_k) * config.head_block(head_dim) * 4
        monkeypatch.setattr(config, "BWD_WS_DQ_ACCUM_BYTES", per_kv_head * max(cfg.heads_k // 2, 1))
    with use_backend(TritonBackend(ws=True, fwd_ws=True)):
        check_case(cfg, backend="triton", device="cuda")
    if head_dim > 128 and cfg.softcap:
        assert not given_dropout, "bwd_ws_split ran dropout with a softcap"
        return
    assert given_dropout and all(d is not None and d[1] == cfg.dropout_p for d in given_dropout), given_dropout
    if launches > 1 and cfg.heads_k > 1:
        assert len({d[3] for d in given_dropout}) > 1, "the launches start at different query heads"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", sorted(WS_SOFTCAP_CASES))
def test_fwd_ws_softcap_matches(monkeypatch, name, head_dim):
    caps = _given_to_launches(monkeypatch, "fwd_ws", "softcap")
    cfg = Config(**WS_SOFTCAP_CASES[name], head_dim=head_dim, dtype=torch.bfloat16)
    with use_backend(TritonBackend(fwd_ws=True)):
        check_case(cfg, backend="triton", device="cuda")
    assert caps and all(cap == cfg.softcap for cap in caps), "fwd_ws ran the forward with the cap"


def test_the_hardware_tanh_is_within_half_a_bf16_rounding():
    """gluon_common.hardware_tanh (the warp-specialised kernels' softcap) against float64 tanh, relative error under
    2^-10 (a bf16 score rounds to 2^-9) over the arguments a softcap sees: tiny, around 1, and saturated, both signs,
    and exactly 0 and +-inf."""
    import triton
    from gluon_compile import hardware_tanh_kernel
    gen = torch.Generator(device="cuda").manual_seed(0)
    magnitudes = torch.cat([torch.logspace(-12, 2, 200_000, device="cuda"),
                            torch.rand(200_000, device="cuda", generator=gen) * 4])
    x = torch.cat([magnitudes, -magnitudes, torch.tensor([0.0, float("inf"), -float("inf")], device="cuda")])
    y = torch.empty_like(x)
    hardware_tanh_kernel()[(triton.cdiv(x.numel(), 512),)](x, y, x.numel(), BLOCK=512, num_warps=4)
    exact = torch.tanh(x.double())
    relative = ((y.double() - exact).abs() / exact.abs().clamp_min(1e-300))[exact != 0]
    assert relative.max().item() < 2 ** -10, relative.max().item()
    assert y[-3].item() == 0.0 and y[-2].item() == 1.0 and y[-1].item() == -1.0


@pytest.mark.parametrize("keys_first", [False, True], ids=["rows_keys", "keys_rows"])
@pytest.mark.parametrize("rows,block_n", [(64, 128), (128, 64)])
@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(-(2 ** 63), 2 ** 63 - 1), offset=st.integers(0, 2 ** 32 - 1), b=st.integers(0, 5),
       head=st.integers(0, 7), m0=st.integers(0, 2 ** 20), group=st.integers(0, 2 ** 18), p=st.floats(0.05, 0.95))
def test_the_gluon_keep_mask_is_core_dropouts(keys_first, rows, block_n, seed, offset, b, head, m0, group, p):
    """gluon/dropout.Dropout.keep in the wgmma accumulator layout, both orientations, equals core/dropout.keep_mask
    element for element (the pattern the reference and the one-launch kernels draw)."""
    from gluon_compile import dropout_keep_kernel

    from flash_attn_ck.core.dropout import keep_mask
    heads, n0 = 8, 4 * group
    rng_state = torch.tensor([seed, offset], dtype=torch.int64, device="cuda")
    out = torch.empty((block_n, rows) if keys_first else (rows, block_n), dtype=torch.int8, device="cuda")
    dropout_keep_kernel()[(1,)](rng_state, p, heads, out, b, head, m0, n0, ROWS=rows, BLOCK_N=block_n,
                                KEYS_FIRST=keys_first, num_warps=4)
    expected = keep_mask((seed, offset), p, b, heads, torch.tensor([head]), torch.arange(m0, m0 + rows),
                         torch.arange(n0, n0 + block_n))[0]
    got = out.cpu().bool()
    assert torch.equal(got.T if keys_first else got, expected)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", sorted(WS_SOFTCAP_CASES))
def test_bwd_ws_softcap_matches(monkeypatch, name, head_dim):
    """dq, dk, dv (and dsink) of bwd_ws (bwd_ws_split at d256: the slope handed between its warpgroups) with the
    cap's tanh in P and its slope in dS, under the 2x rule (on a fresh backend: the registered one may hold a replay
    of the same shape recorded without the cap)."""
    caps = _given_to_launches(monkeypatch, "bwd_ws", "softcap")
    cfg = Config(**WS_SOFTCAP_CASES[name], head_dim=head_dim, dtype=torch.bfloat16)
    with use_backend(TritonBackend(ws=True)):
        check_case(cfg, backend="triton", device="cuda")
    assert caps and all(cap == cfg.softcap for cap in caps), "bwd_ws ran the backward with the cap"


@pytest.mark.parametrize("head_dim", [128, 256])
def test_bwd_ws_softcap_deterministic_is_bit_identical(monkeypatch, head_dim):
    caps = _given_to_launches(monkeypatch, "bwd_ws", "softcap")
    cfg = Config(**WS_SOFTCAP_CASES["causal_gqa"], head_dim=head_dim, dtype=torch.bfloat16, deterministic=True)
    with use_backend(TritonBackend(ws=True)):
        (out_a, grads_a), (out_b, grads_b) = (check_case(cfg, backend="triton", device="cuda") for _ in range(2))
    assert caps and torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.parametrize("name", ["mqa_causal", "window", "alibi_softcap_window", "dropout_causal_gqa"])
def test_features_other_modes(name, backend_options):
    _check(feature_case(FEATURES[name], 80))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_empty_sequences(causal, backend_options):
    seqlens = [(37, 80), (0, 50), (130, 9), (64, 0), (1, 1), (0, 0), (200, 211)]
    cfg = Config(seqlens=seqlens, heads_q=4, heads_k=2, head_dim=96, causal=causal)
    out, (dq, dk, dv) = check_case(cfg, backend="triton", device="cuda")
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    # the keys of the sequence without queries (rows 80..130) get zero gradients
    assert dk[80:130].abs().max() == 0 and dv[80:130].abs().max() == 0


def _assert_bit_identical(cfg: Config, seed: int, runs: int = 20):
    """dq, dk, dv of `runs` backward calls on the same inputs equal the first call's bit for bit."""
    q, k, v, dout, slopes = make_inputs(cfg, "cuda", seed=seed)
    first = run_ours(cfg, q, k, v, dout, slopes, backend="triton")[3]
    for _ in range(runs):
        again = run_ours(cfg, q, k, v, dout, slopes, backend="triton")[3]
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("options", [dict(), dict(gqa_epilogue="accumulate"),
                                     dict(gqa_epilogue="accumulate", use_tma=True), dict(ws=True)],
                         ids=["loop", "accumulate", "accumulate-tma", "ws"])
def test_deterministic_bit_identical(options, varlen):
    with use_backend(TritonBackend(**options)):
        seqlens = [(700, 900), (0, 64), (1024, 1024)] if varlen else None
        cfg = Config(batch=2, seqlen_q=1024, seqlen_k=1024, heads_q=16, heads_k=2, head_dim=128, causal=False,
                     deterministic=True, seqlens=seqlens)
        _assert_bit_identical(cfg, seed=3)


def test_plan_names_every_buffer():
    from flash_attn_ck.core.mask import MaskInfo
    from flash_attn_ck.core.problem import AttentionProblem
    mask = MaskInfo.from_flash_args(True, (-1, -1), 8192, 8192)
    p = AttentionProblem(2, 8192, 8192, 32, 8, 128, torch.bfloat16, torch.device("cuda"), mask, 0.088,
                         deterministic=True)
    loop = TritonBackend(ws=False).backward_plan(p)   # the one-launch kernel's plan (bwd_ws: test_triton_ws.py)
    assert [b.name for b in loop.buffers] == ["softmax_d"] and not loop.reduce_expanded_kv
    acc = TritonBackend(gqa_epilogue="accumulate", ws=False).backward_plan(p)
    assert [b.name for b in acc.buffers] == ["softmax_d", "dk_accum", "dv_accum", "dkv_semaphore"]
    assert acc.buffers[1].shape == (2, 8, 8192, 128)


@pytest.mark.parametrize("head_dim", BWD_WS_HEAD_DIMS.values(), ids=BWD_WS_HEAD_DIMS)
@pytest.mark.parametrize("window,causal", [((200, 50), False), ((-1, -1), True)], ids=["window", "causal"])
def test_ws_deterministic_matches_and_repeats(window, causal, head_dim):
    """The ordered dQ adds of the warp-specialised kernel: within the 2x rule and bit-identical over 20 runs,
    with a left window bound (key tiles start past 0, so the ordering's first tile moves)."""
    seqlens = [(700, 900), (0, 64), (1024, 1024), (300, 129)]
    cfg = Config(seqlens=seqlens, heads_q=8, heads_k=2, head_dim=head_dim, causal=causal, window=window,
                 deterministic=True)
    with use_backend(TritonBackend(ws=True)):
        check_case(cfg, backend="triton", device="cuda", seed=5)
        _assert_bit_identical(cfg, seed=5)


def test_ws_kernel_under_a_workspace_cap():
    """A cap below the warp-specialised kernel's dq_accum chunks the call by kv-head groups: deterministic
    results equal the unchunked call's bit for bit."""
    cfg = Config(batch=2, seqlen_q=512, seqlen_k=512, heads_q=8, heads_k=4, head_dim=128, causal=True,
                 deterministic=True)
    q, k, v, dout, _ = make_inputs(cfg, "cuda", seed=11)
    with use_backend(TritonBackend(ws=True)):
        out, lse, _ = flash_attn_ck.flash_attn_fwd(q, k, v, causal=True, backend="triton")
        whole = flash_attn_ck.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True,
                                             backend="triton", max_workspace_bytes=-1)
        capped = flash_attn_ck.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True,
                                              backend="triton", max_workspace_bytes=2 << 20)
    for a, b in zip(whole[:3], capped[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("batch,seqlen,group,heads_k,per_launch",
                         [(1, 2048, 4, 2, 1), (2, 1536, 2, 2, 1), (2, 2048, 4, 2, 1), (2, 2048, 2, 3, 2)])
def test_ws_kernel_in_several_launches_matches(monkeypatch, deterministic, batch, seqlen, group, heads_k, per_launch):
    """A call whose fp32 dQ accumulator exceeds config.BWD_WS_DQ_ACCUM_BYTES runs one launch per group of kv heads,
    zero_kernel zeroing the accumulator for the next: every head's gradients within the 2x rule (a cast that zeroed
    its source read back its own zeros: the first launches' dQ came out wrong), deterministic runs bit-identical, also
    when the last launch has fewer kv heads than the others (its semaphores once kept the full head stride)."""
    from flash_attn_ck.backends.triton import config
    monkeypatch.setattr(config, "BWD_WS_DQ_ACCUM_BYTES", per_launch * seqlen * batch * group * 128 * 4)
    cfg = Config(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, heads_q=heads_k * group, heads_k=heads_k,
                 head_dim=128, causal=True, deterministic=deterministic)
    backend = TritonBackend(ws=True)
    q, k, v, _, _ = make_inputs(cfg, "cuda", seed=3)
    p = describe_call(q, k, v, AttentionOptions(causal=True))
    assert operators.BwdWs.kv_heads_per_launch(backend, p) == per_launch
    with use_backend(backend):
        check_case(cfg, backend="triton", device="cuda", seed=3)
        if deterministic:
            _assert_bit_identical(cfg, seed=3, runs=3)


@pytest.mark.parametrize("rows,heads", [(64, 1), (2048, 4), (1536, 3), (4096, 8)])
def test_the_dq_cast_copies_its_whole_source(rows, heads):
    """bwd_postprocess.cast_rows_kernel, compiled: the output is the whole source, which is left as it was; then
    zero_kernel zeroes it and a semaphore prefix, and nothing past that."""
    from flash_attn_ck.backends.triton.runtime import launch
    src = torch.randn(2, rows, heads, 128, device="cuda")
    before = src.clone()
    dst = torch.empty(2, rows, heads, 128, device="cuda", dtype=torch.bfloat16)
    launch.cast_rows(src, dst, launch.bhr(src, False), launch.bhr(dst, False), heads, 2, rows, 128, 128).launch()
    assert torch.equal(dst, before.bfloat16()) and torch.equal(src, before)
    sems = torch.arange(1, 2 * heads * 37 + 1, device="cuda", dtype=torch.int32)
    launch.zero_flat(src, sems[:2 * heads * 33]).launch()     # what several launches zero between them
    assert not src.any() and not sems[:2 * heads * 33].any() and sems[2 * heads * 33:].all()


@pytest.mark.parametrize("head_dim", BOTH_WS_TABLES)
def test_longest_first_grids_match(head_dim):
    """The key-major backward and query-major forward grids (WsTile.key_major / FwdWsTile.query_major) on every head
    dim's tile: varlen with empty sequences, causal GQA, within the 2x rule, and the deterministic mode
    bit-identical over its repeats (its ordered dQ adds rely on each head's key tiles starting in ascending order)."""
    ws_tile = replace(config.BWD_WS_SM90[head_dim], key_major=True)
    fwd_tile = replace(config.FWD_WS_SM90[head_dim][True], query_major=True)
    backend = TritonBackend(ws=True, ws_tile=ws_tile, fwd_ws=True, fwd_ws_tile=fwd_tile)
    seqlens = [(700, 900), (0, 64), (1024, 1024), (300, 129), (64, 0)]
    cfg = Config(seqlens=seqlens, heads_q=8, heads_k=2, head_dim=head_dim, causal=True, deterministic=True)
    with use_backend(backend):
        check_case(cfg, backend="triton", device="cuda", seed=7)
        _assert_bit_identical(cfg, seed=7)


# ---- the varlen schedule (TritonBackend(varlen_schedule=True)) against the grid over every (batch, tile) -----------
# Backend calls below the public API (top-left masks are not flash-attn's); a pack with an empty sequence, queries
# without keys and keys without queries, a 1-token sequence and a long one.
SCHEDULE_PACK = [(300, 300), (0, 0), (1, 1), (1600, 1500), (0, 50), (77, 0), (129, 200), (700, 700)]
SCHEDULE_MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "window_left": dict(window_size=(96, 0)),
    "right_only": dict(window_size=(-1, 20)),
    "top_left_causal": lambda s_q, s_k: MaskInfo.top_left(-1, 0, s_q, s_k),
    "top_left_window": lambda s_q, s_k: MaskInfo.top_left(80, 16, s_q, s_k),
}
GRID = dict(ws=True, fwd_ws=True, varlen_schedule=False)
SCHEDULED = dict(ws=True, fwd_ws=True, varlen_schedule=True)


def _schedule_call(mask: str, head_dim: int, heads: tuple[int, int], deterministic: bool, seed: int):
    """(problem, params, dout) of a bf16 varlen call on SCHEDULE_PACK with `mask` (SCHEDULE_MASKS)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = [[0], [0]]
    for pair in SCHEDULE_PACK:
        for side in (0, 1):
            offsets[side].append(offsets[side][-1] + pair[side])
    cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device="cuda") for o in offsets)

    def rand(rows, h):
        return torch.randn(rows, h, head_dim, generator=gen).to("cuda", torch.bfloat16)

    q, k, v, dout = rand(offsets[0][-1], heads[0]), rand(offsets[1][-1], heads[1]), rand(offsets[1][-1], heads[1]), \
        rand(offsets[0][-1], heads[0])
    made = SCHEDULE_MASKS[mask]
    max_q, max_k = max(n for n, _ in SCHEDULE_PACK), max(n for _, n in SCHEDULE_PACK)
    options = AttentionOptions(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                               deterministic=deterministic, **(made if isinstance(made, dict) else {}))
    p = describe_call(q, k, v, options)
    if not isinstance(made, dict):
        p = replace(p, mask=made(max_q, max_k))
    return p, kernel_params(p, q, k, v, options, None), dout


def _forward(backend, p, params):
    out = torch.zeros_like(params.q)
    lse = torch.zeros(p.lse_shape, dtype=torch.float32, device="cuda")
    backend.forward(p, params, out, lse)
    return out, lse


def _backward(backend, p, params, out, lse, dout):
    grads = tuple(torch.zeros_like(t) for t in (params.q, params.k, params.v))
    run_backward(backend, p, params, out, lse, dout, *grads, None)
    torch.cuda.synchronize()
    return grads


def _assert_dq_close(ours, grid):
    """dQ of non-deterministic backwards: the same fp32 terms added in another order, rounded to bf16: within two bf16
    roundings (2^-7 relative) of the grid's, or 1e-3 of its largest entry where the terms cancel."""
    a, b = ours.float(), grid.float()
    diff = (a - b).abs()
    assert (diff <= 2 ** -7 * b.abs() + 1e-3 * b.abs().max()).all(), f"dq: max abs diff {diff.max().item()}"


def _compare_schedule(p, params, dout, deterministic: bool, scheduled_backward: bool = True):
    """The scheduled kernels against the grid's on one call: out and lse bit-identical, dK/dV bit-identical, dQ
    bit-identical in the deterministic mode (and a second scheduled run bit-identical), else within _assert_dq_close.
    Each backend says which grid it runs."""
    grid, sched = TritonBackend(**GRID), TritonBackend(**SCHEDULED)
    assert "varlen schedule" in sched.forward_kernel(p) and "varlen schedule" not in grid.forward_kernel(p)
    plan = sched.backward_plan(p).kernel
    assert plan.startswith("bwd_ws") and ("varlen schedule" in plan) == scheduled_backward, plan
    out, lse = _forward(grid, p, params)
    out_s, lse_s = _forward(sched, p, params)
    assert torch.equal(out_s, out) and torch.equal(lse_s, lse)
    dq, dk, dv = _backward(grid, p, params, out, lse, dout)
    dq_s, dk_s, dv_s = _backward(sched, p, params, out, lse, dout)
    assert torch.equal(dk_s, dk) and torch.equal(dv_s, dv)
    if deterministic:
        assert torch.equal(dq_s, dq)
        for a, b in zip(_backward(sched, p, params, out, lse, dout), (dq_s, dk_s, dv_s)):
            assert torch.equal(a, b)
    else:
        _assert_dq_close(dq_s, dq)
    assert dq.abs().max() > 0 and dk.abs().max() > 0 and out.abs().max() > 0


@pytest.mark.parametrize("head_dim,heads,mask", [
    *[(128, heads, mask) for heads in ((8, 8), (8, 4)) for mask in sorted(SCHEDULE_MASKS)],
    *[(256, (8, 2), mask) for mask in sorted(SCHEDULE_MASKS)]],
    ids=[f"{kernel}-{mask}" for kernel in ("d128-mha", "d128-gqa", "d256-gqa") for mask in sorted(SCHEDULE_MASKS)])
def test_varlen_schedule_matches_the_grid(head_dim, heads, mask):
    """fwd_ws, bwd_ws (d128, MHA and GQA 8/4) and bwd_ws_split (d256, GQA 8/2) on the schedule's grid (heads, items)
    give the grid's results: every (sequence, tile) of the pack is run once, as today's program for it runs it."""
    p, params, dout = _schedule_call(mask, head_dim, heads, False, seed=head_dim + heads[1])
    _compare_schedule(p, params, dout, deterministic=False)


@pytest.mark.parametrize("mask", sorted(SCHEDULE_MASKS))
@pytest.mark.parametrize("head_dim", [128, 256], ids=["bwd_ws", "bwd_ws_split"])
def test_varlen_schedule_deterministic_is_the_grids_bit_for_bit(head_dim, mask):
    """The deterministic backward on the schedule (no left window bound: each sequence's key tiles start in ascending
    order, so the ordered dQ adds neither hang nor change order) equals the grid's bit for bit and repeats bit for bit;
    with a left bound it keeps the grid (the plan says which)."""
    p, params, dout = _schedule_call(mask, head_dim, (8, 2), True, seed=3)
    _compare_schedule(p, params, dout, deterministic=True,
                      scheduled_backward=mask not in ("window_left", "top_left_window"))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_schedule_in_several_kv_head_launches(monkeypatch, deterministic):
    """A dQ accumulator budget (config.BWD_WS_DQ_ACCUM_BYTES) of one kv head: three launches share the call's one
    schedule, each on grid (its kv head, items)."""
    from flash_attn_ck.backends.triton import config
    rows_q, heads, group, d = sum(n for n, _ in SCHEDULE_PACK), (12, 3), 4, 128
    monkeypatch.setattr(config, "BWD_WS_DQ_ACCUM_BYTES", rows_q * group * d * 4)
    p, params, dout = _schedule_call("causal", d, heads, deterministic, seed=11)
    assert operators.BwdWs.kv_heads_per_launch(TritonBackend(**SCHEDULED), p) == 1
    _compare_schedule(p, params, dout, deterministic)


# fwd_ws and the warp-specialised backward with ALiBi in their scores (forced on: by default only under the Triton
# releases of config.WS_ALIBI_TRITON_RELEASES): causal GQA, s_q != s_k with a window, varlen with empty sequences, with
# a softcap and a sink too.
WS_ALIBI_CASES = {
    "causal_gqa": dict(batch=2, seqlen_q=700, seqlen_k=700, heads_q=8, heads_k=2, causal=True),
    "window_sq_ne_sk": dict(batch=2, seqlen_q=513, seqlen_k=900, heads_q=4, heads_k=4, window=(100, 7)),
    "varlen_empty": dict(seqlens=[(300, 511), (0, 64), (257, 0), (129, 129)], heads_q=4, heads_k=1, causal=True),
    "softcap_sink": dict(batch=1, seqlen_q=640, seqlen_k=640, heads_q=4, heads_k=2, causal=True, softcap=20.0,
                         sink_dtype=torch.float32),
}


def _alibi_given_to_the_ws_kernels(monkeypatch) -> dict:
    """The ALiBi arguments the launches of fwd_ws and the warp-specialised backward were given, by kernel."""
    from flash_attn_ck.backends.triton.gluon import bwd_ws, fwd_ws
    given: dict = {"fwd_ws": [], "bwd_ws": []}
    for name, module in (("fwd_ws", fwd_ws), ("bwd_ws", bwd_ws)):
        real = module.launch
        monkeypatch.setattr(module, "launch", lambda *args, _real=real, _name=name, **kwargs: (
            given[_name].append(kwargs["alibi"]), _real(*args, **kwargs))[1])
    return given


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", sorted(WS_ALIBI_CASES))
def test_ws_alibi_matches(monkeypatch, name, head_dim):
    """out, lse, dq, dk, dv (and dsink) of fwd_ws and bwd_ws / bwd_ws_split with ALiBi against the float64 oracle under
    the 2x rule, on a fresh backend that forces both kernels (the registered one may replay a launch of the same
    shape recorded without ALiBi)."""
    given = _alibi_given_to_the_ws_kernels(monkeypatch)
    cfg = Config(**WS_ALIBI_CASES[name], head_dim=head_dim, alibi=True, dtype=torch.bfloat16)
    with use_backend(TritonBackend(ws=True, fwd_ws=True)):
        check_case(cfg, backend="triton", device="cuda")
    for kernel, launched in given.items():
        assert launched and all(alibi is not None for alibi in launched), f"{kernel} ran with the slopes"


def test_ws_alibi_takes_head_slopes_as_the_batch_of_them(monkeypatch):
    """(h,) slopes (batch stride 0) give what the same slopes repeated per batch entry give, bit for bit."""
    _alibi_given_to_the_ws_kernels(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    slopes = torch.rand(8, device="cuda", generator=gen) * 0.3
    results = []
    with use_backend(TritonBackend(ws=True, fwd_ws=True)):
        for given in (slopes, slopes.expand(2, 8).contiguous()):
            out = flash_attn_ck.flash_attn_func(q, k, v, causal=True, alibi_slopes=given)
            results.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(*results))
