"""GPU tests of v's own head dim on the Triton backend (skipped without CUDA): the one-launch kernels with
features.HEAD_DIM_V / BLOCK_DV against the float64 oracle under the 2x rule, over the pairs models use (MLA's
192/128 first), d_v narrower, wider and not a multiple of 8, every backward mode (the accumulator epilogue asked for
runs the group loop), TMA, varlen with empty sequences and bit-identical deterministic repeats. Their logic runs on
the CPU in tests/triton/test_triton_interpret.py (TRITON_INTERPRET=1); scripts/triton_compile_check.py compiles them for
sm_90a."""

from __future__ import annotations

import pytest
import torch

from cases import check_case
from oracle import Config

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flash_attn_ck import use_backend  # noqa: E402
from flash_attn_ck.backends.triton import TritonBackend  # noqa: E402

PAIRS = [(192, 128), (128, 64), (64, 128), (40, 21), (256, 8), (96, 200)]
OPTIONS = {"defaults": dict(), "accumulate-asked": dict(gqa_epilogue="accumulate"), "atomic-dq": dict(dq_mode="atomic"),
           "tma": dict(use_tma=True)}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("head_dim", "head_dim_v"), PAIRS, ids=[f"{d}-{d_v}" for d, d_v in PAIRS])
def test_pairs_match_the_oracle(head_dim, head_dim_v, dtype, options):
    cfg = Config(batch=2, seqlen_q=301, seqlen_k=257, heads_q=8, heads_k=2, head_dim=head_dim, head_dim_v=head_dim_v,
                 causal=True, dtype=dtype)
    with use_backend(TritonBackend(**OPTIONS[options])):
        check_case(cfg, backend="triton", device="cuda")


@pytest.mark.parametrize("features", [dict(window=(64, 16)), dict(alibi=True), dict(softcap=20.0),
                                      dict(dropout_p=0.2)], ids=["window", "alibi", "softcap", "dropout"])
def test_features_with_mla_head_dims(features):
    check_case(Config(batch=2, seqlen_q=200, seqlen_k=333, heads_q=4, heads_k=2, head_dim=192, head_dim_v=128,
                      **features), backend="triton", device="cuda")


def test_varlen_with_empty_sequences():
    cfg = Config(seqlens=[(130, 77), (0, 40), (57, 0), (0, 0), (300, 301)], heads_q=6, heads_k=2, head_dim=192,
                 head_dim_v=128, causal=True)
    check_case(cfg, backend="triton", device="cuda")


def test_deterministic_repeats_are_bit_identical():
    cfg = Config(batch=2, seqlen_q=257, seqlen_k=300, heads_q=8, heads_k=2, head_dim=192, head_dim_v=128,
                 deterministic=True, seqlens=None)
    first = check_case(cfg, backend="triton", device="cuda")
    second = check_case(cfg, backend="triton", device="cuda")
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


# Calls with a v narrower than q/k that both warp-specialised directions run (each test adds its own).
NARROWER_V = {
    "mla-causal-gqa": dict(batch=2, seqlen_q=700, seqlen_k=700, heads_q=8, heads_k=2, head_dim=192, head_dim_v=128,
                           causal=True),
    "mla-varlen-empty": dict(seqlens=[(300, 511), (0, 64), (257, 0), (129, 129)], heads_q=4, heads_k=1, head_dim=192,
                             head_dim_v=128, causal=True),
    "d256-v200-window": dict(batch=1, seqlen_q=513, seqlen_k=900, heads_q=4, heads_k=4, head_dim=256, head_dim_v=200,
                             window=(100, 7)),
}


@pytest.mark.parametrize("case", [*NARROWER_V.values(),
    dict(batch=2, seqlen_q=333, seqlen_k=400, heads_q=6, heads_k=3, head_dim=128, head_dim_v=64, causal=True,
         dropout_p=0.2),
    dict(batch=2, seqlen_q=300, seqlen_k=300, heads_q=4, heads_k=2, head_dim=96, head_dim_v=40, softcap=20.0,
         alibi=True, sink_dtype=torch.float32),
], ids=[*NARROWER_V, "d128-v64-dropout", "d96-v40-softcap-alibi-sink"])
def test_fwd_ws_runs_a_narrower_v_at_its_own_head_dim(monkeypatch, case):
    """fwd_ws (forced on) takes calls whose v is narrower than q/k as they are (operators.FwdWs.run): the kernel gets
    v's width for v and out (its V and O tiles of v's head block), and the result is the d_v attention."""
    from flash_attn_ck.backends.triton.gluon import fwd_ws
    widths, real = [], fwd_ws.launch
    monkeypatch.setattr(fwd_ws, "launch", lambda q, k, v, out, *args, **kwargs: (
        widths.append((q.shape[-1], v.shape[-1], out.shape[-1])), real(q, k, v, out, *args, **kwargs)))
    with use_backend(TritonBackend(fwd_ws=True)):
        check_case(Config(**case, dtype=torch.bfloat16), backend="triton", device="cuda")
    padded = (case["head_dim"] + 7) // 8 * 8, (case["head_dim_v"] + 7) // 8 * 8
    assert widths and all(w == (padded[0], padded[1], padded[1]) for w in widths), widths


@pytest.mark.parametrize("case", [*NARROWER_V.values(),
    dict(batch=2, seqlen_q=333, seqlen_k=333, heads_q=6, heads_k=3, head_dim=128, head_dim_v=64, causal=True,
         deterministic=True),
    dict(batch=2, seqlen_q=300, seqlen_k=300, heads_q=4, heads_k=2, head_dim=96, head_dim_v=40, dropout_p=0.2,
         softcap=20.0),
], ids=[*NARROWER_V, "d128-v64-deterministic", "d96-v40-dropout-softcap"])
def test_the_ws_backward_runs_a_narrower_v(monkeypatch, case):
    """bwd_ws / bwd_ws_split (forced on) take calls whose v is narrower than q/k as they are
    (operators._WarpSpecialisedBackward.run): the kernel gets v's width for v, dout and dV (V, dO and dV tiles of v's
    head block), and the gradients are the d_v attention's."""
    from flash_attn_ck.backends.triton.gluon import bwd_ws
    widths, real = [], bwd_ws.launch
    monkeypatch.setattr(bwd_ws, "launch", lambda q, k, v, dout, lse, delta, dq, dk, dv, *args, **kwargs: (
        widths.append((q.shape[-1], v.shape[-1], dout.shape[-1], dv.shape[-1])),
        real(q, k, v, dout, lse, delta, dq, dk, dv, *args, **kwargs)))
    with use_backend(TritonBackend(ws=True)):
        check_case(Config(**case, dtype=torch.bfloat16), backend="triton", device="cuda")
    padded = (case["head_dim"] + 7) // 8 * 8, (case["head_dim_v"] + 7) // 8 * 8
    assert widths and all(w == (padded[0], padded[1], padded[1], padded[1]) for w in widths), widths


@pytest.mark.parametrize("case", [
    dict(batch=2, seqlen_q=700, seqlen_k=700, heads_q=8, heads_k=2, head_dim=192, head_dim_v=128, causal=True),
    dict(seqlens=[(300, 511), (0, 64), (257, 0), (129, 129), (1, 1)], heads_q=4, heads_k=1, head_dim=192,
         head_dim_v=128, causal=True),
    dict(batch=1, seqlen_q=513, seqlen_k=900, heads_q=4, heads_k=4, head_dim=160, head_dim_v=128, window=(100, 7)),
    dict(batch=2, seqlen_q=300, seqlen_k=333, heads_q=6, heads_k=3, head_dim=136, head_dim_v=64, dropout_p=0.2,
         softcap=20.0, alibi=True, sink_dtype=torch.float32),
], ids=["mla-causal-gqa", "mla-varlen-empty", "d160-v128-window", "d136-v64-dropout-softcap-alibi-sink"])
def test_fwd_ws_with_a_q_k_tail_block(monkeypatch, case):
    """fwd_ws with config.FWD_WS_QK_TAIL on (forced on: TritonBackend(fwd_ws=True)) loads q/k as a 128-column block
    and a tail block, one matmul each into S (config.fwd_ws_qk_tail), and the result is the attention's."""
    from flash_attn_ck.backends.triton import config
    from flash_attn_ck.backends.triton.gluon import fwd_ws
    monkeypatch.setattr(config, "FWD_WS_QK_TAIL", True)
    tails, real = [], fwd_ws.launch
    monkeypatch.setattr(fwd_ws, "launch", lambda *args, **kwargs: (tails.append(kwargs["qk_tail"]),
                                                                   real(*args, **kwargs)))
    with use_backend(TritonBackend(fwd_ws=True)):
        check_case(Config(**case, dtype=torch.bfloat16), backend="triton", device="cuda")
    assert tails and all(t > 0 for t in tails), tails


@pytest.mark.parametrize("case", [
    dict(batch=2, seqlen_q=700, seqlen_k=700, heads_q=8, heads_k=2, head_dim=192, head_dim_v=128, causal=True),
    dict(seqlens=[(300, 511), (0, 64), (257, 0), (129, 129), (1, 1)], heads_q=4, heads_k=1, head_dim=192,
         head_dim_v=128, causal=True),
    dict(batch=1, seqlen_q=513, seqlen_k=900, heads_q=4, heads_k=4, head_dim=160, head_dim_v=128, window=(100, 7)),
    dict(batch=2, seqlen_q=333, seqlen_k=333, heads_q=6, heads_k=3, head_dim=192, head_dim_v=192, causal=True,
         deterministic=True),
    dict(batch=2, seqlen_q=300, seqlen_k=333, heads_q=6, heads_k=3, head_dim=136, head_dim_v=64, dropout_p=0.2,
         alibi=True),
], ids=["mla-causal-gqa", "mla-varlen-empty", "d160-v128-window", "d192-deterministic", "d136-v64-dropout-alibi"])
def test_bwd_ws_split_with_a_q_k_tail_block(monkeypatch, case):
    """bwd_ws_split with config.BWD_WS_QK_TAIL on (forced on: TritonBackend(ws=True)) loads q/k as a 128-column block
    and a tail block, its warpgroups owning those columns of dK and dQ (config.bwd_ws_qk_tail), and the gradients are
    the attention's (deterministic repeats bit-identical where asked)."""
    from flash_attn_ck.backends.triton import config
    from flash_attn_ck.backends.triton.gluon import bwd_ws
    monkeypatch.setattr(config, "BWD_WS_QK_TAIL", True)
    tails, real = [], bwd_ws.launch
    monkeypatch.setattr(bwd_ws, "launch", lambda *args, **kwargs: (tails.append(kwargs["qk_tail"]),
                                                                   real(*args, **kwargs)))
    cfg = Config(**case, dtype=torch.bfloat16)
    with use_backend(TritonBackend(ws=True)):
        first = check_case(cfg, backend="triton", device="cuda")
        if cfg.deterministic:
            second = check_case(cfg, backend="triton", device="cuda")
            assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
    assert tails and all(t > 0 for t in tails), tails
