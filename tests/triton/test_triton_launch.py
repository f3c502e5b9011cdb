"""CPU tests of the Triton backend's launch specs (flash_attn_ck/backends/triton/runtime/launch.py): every spec
names exactly its kernel's parameters, in order, and types them from its own values (what
scripts/triton_compile_check.py compiles); backend.py's named values all land in ScoreArgs or Features."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import flash_attn_ck

pytest.importorskip("triton")

from flash_attn_ck.backends.triton import config
from flash_attn_ck.backends.triton.runtime import launch
from flash_attn_ck.backends.triton.runtime.launch import Features, ScoreArgs, Sizes


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
    seq = launch.SequenceArgs(cu, cu, _meta(h, dtype=torch.float32), _meta(2, dtype=torch.int64))
    sizes, scores = Sizes(h, 1, s, s, d), ScoreArgs(0.125, 0.0, 0.0, 0, 0)
    features = Features(VARLEN=varlen, HAS_RIGHT=True, DQ_ATOMIC=True, BLOCK_DV=d)   # v's block, as backend.py
    tiles = config.INTERPRETER
    specs = [
        launch.forward(q, q, q, q, lse, seq, sizes, scores, features, tiles.forward, d, (1, 1)),
        launch.bwd_preprocess(q, q, lse, (acc, None, None, None), b, sizes, varlen, d),
        launch.bwd_main(q, q, q, q, lse, lse, acc, q, q, None, None, None, seq, b, sizes, scores, features,
                        tiles.bwd_kv, tiles.bwd_dq, d, (1, 1)),
        launch.cast_rows(acc, q, launch.bhr(acc, varlen), launch.bhr(q, varlen), h, 1, b * s, d, d),
        launch.zero_flat(acc, _meta(b, h, 4, dtype=torch.int32)),
    ]
    for spec in specs:
        sig, constexprs = spec.signature()   # asserts that the spec names the kernel's parameters in order
        assert list(sig) == spec.kernel.arg_names
        # a None argument (the forward's Sink without a sink) is specialised as a constant too
        assert set(constexprs) == {p.name for p in spec.kernel.params if p.is_constexpr or spec.args[p.name] is None}
    fwd_sig = specs[0].signature()[0]
    # flat: no int two tuple levels down (Triton 3.6 loses one specialised to 1 there: launch.ForwardStrides)
    assert fwd_sig["strides"] == launch.ForwardStrides(*["i32"] * len(launch.ForwardStrides._fields))
    assert specs[2].signature()[0]["strides"] == launch.BackwardStrides(*["i32"] * len(launch.BackwardStrides._fields))
    assert fwd_sig["score_args"] == ScoreArgs("fp32", "fp32", "fp32", "i32", "i32")
    bwd_sig, bwd_constexprs = specs[2].signature()
    assert bwd_sig["grads"] == launch.Gradients("*fp32", "*bf16", "*bf16")   # the atomic mode's fp32 dQ buffer
    assert bwd_sig["kv_acc"] == launch.KVAccumulators("*fp32", "*fp32", "*fp32")   # none: lse (Delta) stands in
    assert bwd_constexprs["features"] is features


def test_split_named_refuses_unknown_names():
    named = dict(scale=0.5, softcap=0.0, dropout_p=0.0, window_left=0, window_right=0, HAS_ALIBI=True)
    scores, features = launch.split_named(named, VARLEN=True)
    assert scores == ScoreArgs(0.5, 0.0, 0.0, 0, 0) and features.HAS_ALIBI and features.VARLEN
    with pytest.raises(AssertionError, match="HAS_NEW_THING"):
        launch.split_named(dict(named, HAS_NEW_THING=True))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_gluon_specs_match_their_kernels(varlen):
    """fwd_ws.launch_spec and bwd_ws.launch_spec name exactly their kernel's parameters, in order, for every tile
    of the tables (bwd_ws_split's kernel for a split tile), with the compile-time values the tile and the mask
    give and the head dim padded as config.head_block pads it."""
    from gluon_compile import bwd_spec, fwd_spec

    from flash_attn_ck.backends.triton.gluon import bwd_ws, bwd_ws_split, fwd_ws
    masks = (False, True, True)
    for block, causal_tiles in config.FWD_WS_SM90.items():
        for tile in causal_tiles.values():
            spec = fwd_spec(tile, block * 3 // 4, varlen, masks)
            sig, constexprs = spec.signature()
            assert spec.kernel is fwd_ws.attn_fwd_ws_kernel and list(sig) == spec.kernel.arg_names
            assert (constexprs["TILE"], constexprs["CALL"]) == (tile, launch.GluonCall(block, varlen,
                                                                                       launch.MaskFlags(*masks)))
    for block, tile in config.BWD_WS_SM90.items():
        for deterministic in (False, True):
            spec = bwd_spec(tile, block * 3 // 4, varlen, masks, deterministic)
            sig, constexprs = spec.signature()
            kernel = bwd_ws_split.attn_bwd_ws_split_kernel if tile.split_d else bwd_ws.attn_bwd_ws_kernel
            assert spec.kernel is kernel and list(sig) == kernel.arg_names
            assert (constexprs["TILE"], constexprs["CALL"]) == (
                tile, launch.GluonCall(block, varlen, launch.MaskFlags(*masks), deterministic))
            assert spec.num_warps == tile.num_warps and spec.options == (
                {"maxnreg": tile.max_registers} if tile.max_registers else {})


# ---- parameter lists stay short enough to read ------------------------------------------------------
MAX_PARAMETERS = 20


def _is_jit(decorator) -> bool:
    """@triton.jit, @gluon.jit, @jit, with or without arguments."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)) == "jit"


def jit_parameter_counts(package: Path) -> dict[str, int]:
    """{"path/file.py:function": parameter count} of every @jit function (kernels, helpers, methods of aggregates)
    defined in the modules of `package` (a directory) and its subpackages, read from their source."""
    counts = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                args = node.args
                counts[f"{path.relative_to(package)}:{node.name}"] = (
                    len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) + (args.vararg is not None)
                    + (args.kwarg is not None))
    return counts


def test_no_jit_function_takes_more_than_twenty_parameters():
    """Kernels and their helpers take grouped arguments (launch specs, tuples, Gluon aggregates) instead of long flat
    lists: none of the package's @jit functions has more than MAX_PARAMETERS."""
    counts = jit_parameter_counts(Path(flash_attn_ck.__file__).parent)
    assert len(counts) > 50   # the parse found the kernels (triton.jit and gluon.jit alike)
    assert {f"backends/triton/{kernel}" for kernel in ("gluon/fwd_ws.py:attn_fwd_ws_kernel",
                                                      "one_launch/forward.py:attn_fwd_kernel",
                                                      "one_launch/bwd_main.py:attn_bwd_kernel")} <= set(counts)
    wide = {name: n for name, n in counts.items() if n > MAX_PARAMETERS}
    assert not wide, f"@jit functions with more than {MAX_PARAMETERS} parameters: {wide}"
