"""CPU tests of the Triton backend's launch specs (flash_attn_ck/backends/triton/launch.py): every spec
names exactly its kernel's parameters, in order, and types them from its own values (what
scripts/triton_compile_check.py compiles); backend.py's named values all land in ScoreArgs or Features."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from flash_attn_ck.backends.triton import config, launch
from flash_attn_ck.backends.triton.launch import Features, ScoreArgs, Sizes


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_specs_match_their_kernels(varlen):
    b, s, h, d = 2, 64, 4, 64
    rows = (b * s,) if varlen else (b, s)
    q = _meta(*rows, h, d)
    lse = _meta(h, b * s, dtype=torch.float32) if varlen else _meta(b, h, s, dtype=torch.float32)
    acc = _meta(*rows, h, d, dtype=torch.float32)
    cu = _meta(b + 1, dtype=torch.int32)
    seq = launch.SequenceArgs(cu, cu, _meta(h, dtype=torch.float32), _meta(2, dtype=torch.int64), 0)
    sizes, scores = Sizes(h, 1, s, s, d), ScoreArgs(0.125, 0.0, 0.0, 0, 0)
    features = Features(VARLEN=varlen, HAS_RIGHT=True, DQ_ATOMIC=True)
    tiles = config.INTERPRETER
    specs = [
        launch.forward(q, q, q, q, lse, seq, sizes, scores, features, tiles.forward, d, (1, 1)),
        launch.bwd_preprocess(q, q, lse, cu, (acc, None, None, None), b, sizes, varlen, d),
        launch.bwd_main(q, q, q, q, lse, lse, acc, q, q, None, None, None, seq, b, sizes, scores, features,
                        tiles.bwd_kv, tiles.bwd_dq, d, (1, 1)),
        launch.cast_rows(acc, q, launch.bhr(acc, varlen), launch.bhr(q, varlen), h, 1, b * s, d, d),
    ]
    for spec in specs:
        sig, constexprs = spec.signature()   # asserts that the spec names the kernel's parameters in order
        assert list(sig) == spec.kernel.arg_names
        assert set(constexprs) == {p.name for p in spec.kernel.params if p.is_constexpr}
    fwd_sig = specs[0].signature()[0]
    assert fwd_sig["stride_q"] == ("i32", "i32", "i32")
    assert fwd_sig["S"] == ScoreArgs("fp32", "fp32", "fp32", "i32", "i32")
    assert specs[2].signature()[0]["dQ"] == "*fp32"   # the atomic mode's fp32 dQ buffer
    assert specs[2].signature()[1]["F"] is features


def test_split_named_refuses_unknown_names():
    named = dict(scale=0.5, softcap=0.0, dropout_p=0.0, window_left=0, window_right=0, HAS_ALIBI=True)
    scores, features = launch.split_named(named, VARLEN=True)
    assert scores == ScoreArgs(0.5, 0.0, 0.0, 0, 0) and features.HAS_ALIBI and features.VARLEN
    with pytest.raises(AssertionError, match="HAS_NEW_THING"):
        launch.split_named(dict(named, HAS_NEW_THING=True))
