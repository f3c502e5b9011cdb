"""Drive one random attention case through the public API and the naive oracle, and judge it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flash_attn_ck as fa
from flash_attn_ck.core.inputs import describe_call, kernel_params
from flash_attn_ck.core.mask import MaskInfo, MaskKind
from flash_attn_ck.core.options import AttentionOptions
from flash_attn_ck.pipeline.backward import run_backward
from oracle import Config, assert_close_2x, naive_attention

# The head-dim grid of the GPU backends' tests: any d <= 256 (multiples of 8 and not).
HEAD_DIMS = [8, 16, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


def tile_head_dims(table) -> list[int]:
    """The head dims a tile table keyed by config.head_block covers, so that a tile added there is tested: each key
    and a head dim it pads (3/4 of the key)."""
    return sorted({block * f // 4 for block in table for f in (3, 4)})


def head_dim_case(head_dim: int, dtype: torch.dtype) -> Config:
    """The grid's case for one head dim: s_q != s_k, GQA 4/2, causal on every other head dim."""
    return Config(batch=2, seqlen_q=113, seqlen_k=187, heads_q=4, heads_k=2, head_dim=head_dim,
                  causal=HEAD_DIMS.index(head_dim) % 2 == 1, dtype=dtype)


# Features every GPU backend's tests check at d64/d128 (each backend adds its own), on FEATURE_BASE.
COMMON_FEATURES = {
    "mha": dict(heads_q=3, heads_k=3),
    "mqa_causal": dict(heads_q=4, heads_k=1, causal=True),
    "window": dict(window=(32, 8)),
    "window_left_only": dict(window=(17, -1)),
    "sq_gt_sk_causal": dict(seqlen_q=200, seqlen_k=70, causal=True),
    "sq_1": dict(seqlen_q=1, seqlen_k=150, causal=True),
    "alibi": dict(alibi=True, causal=True),
}
FEATURE_BASE = dict(batch=2, seqlen_q=129, seqlen_k=161, heads_q=4, heads_k=2)


def feature_case(features: dict, head_dim: int) -> Config:
    return Config(**{**FEATURE_BASE, **features}, head_dim=head_dim)


def make_inputs(cfg: Config, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=cfg.dtype)

    if cfg.seqlens is None:
        q = rand(cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim)
        k = rand(cfg.batch, cfg.seqlen_k, cfg.heads_k, cfg.head_dim)
        v = rand(cfg.batch, cfg.seqlen_k, cfg.heads_k, cfg.value_head_dim)
        dout = rand(cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.value_head_dim)
    else:
        total_q = sum(s for s, _ in cfg.seqlens)
        total_k = sum(s for _, s in cfg.seqlens)
        q = rand(total_q, cfg.heads_q, cfg.head_dim)
        k = rand(total_k, cfg.heads_k, cfg.head_dim)
        v = rand(total_k, cfg.heads_k, cfg.value_head_dim)
        dout = rand(total_q, cfg.heads_q, cfg.value_head_dim)
    batch = cfg.batch if cfg.seqlens is None else len(cfg.seqlens)
    slopes = (torch.rand(batch, cfg.heads_q, generator=gen) * 0.3).to(device) if cfg.alibi else None
    return q, k, v, dout, slopes


def make_sink(cfg: Config, device="cpu", seed=0) -> torch.Tensor | None:
    """The case's learnable sink (cfg.sink_dtype), or None: logits near a row's lse over the keys, so that the sink
    takes a sizeable share of every row."""
    if cfg.sink_dtype is None:
        return None
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(cfg.heads_q, generator=gen) + 3.0).to(device=device, dtype=cfg.sink_dtype)


def cumulative(values: list[int]) -> list[int]:
    out = [0]
    for n in values:
        out.append(out[-1] + n)
    return out


def seeded_inputs(dtype, b=2, s_q=5, s_k=7, h=4, h_k=2, d=20, seed=0):
    """Random q, k, v, dout in (b, s, h, d) layout, drawn from one seeded generator on the CPU."""
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, s_q, h, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, s_k, h_k, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, dout


def packed_if(varlen: bool, q, k, v):
    """q, k, v of equal batch and length as they are (and no varlen arguments), or each sequence packed into
    (total, h, d) with the cu_seqlens / max_seqlen arguments that say so."""
    if not varlen:
        return q, k, v, {}
    batch, seqlen = q.shape[:2]
    cu = torch.arange(batch + 1, dtype=torch.int32) * seqlen
    packed = (t.flatten(0, 1) for t in (q, k, v))
    return (*packed, dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen, max_seqlen_k=seqlen))


def varlen_meta(cfg: Config, device="cpu"):
    lengths_q = torch.tensor([0] + [s for s, _ in cfg.seqlens])
    lengths_k = torch.tensor([0] + [s for _, s in cfg.seqlens])
    cu_q = lengths_q.cumsum(0).to(torch.int32).to(device)
    cu_k = lengths_k.cumsum(0).to(torch.int32).to(device)
    return cu_q, cu_k, max(s for s, _ in cfg.seqlens), max(s for _, s in cfg.seqlens)


def run_ours(cfg: Config, q, k, v, dout, slopes, backend="reference", sink=None):
    """Forward with probs (for lse and rng_state) + backward through autograd; with a sink, the gradients end
    with dsink."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    sink = None if sink is None else sink.detach().clone().requires_grad_()
    common = dict(dropout_p=cfg.dropout_p, causal=cfg.causal, window_size=cfg.window, softcap=cfg.softcap,
                  alibi_slopes=slopes, deterministic=cfg.deterministic, learnable_sink=sink, backend=backend)
    if cfg.seqlens is None:
        out, lse, rng_state = fa.flash_attn_fwd(q, k, v, **common)
        out_autograd = fa.flash_attn_func(q, k, v, **{**common, "dropout_p": 0.0}) if cfg.dropout_p == 0 else None
    else:
        cu_q, cu_k, max_q, max_k = varlen_meta(cfg, q.device)
        varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
        out, lse, rng_state = fa.flash_attn_fwd(q, k, v, **varlen, **common)
        out_autograd = None
    if out_autograd is not None:
        # The autograd path must reproduce the low-level forward exactly and give the same gradients.
        assert torch.equal(out_autograd, out)
        out_autograd.backward(dout)
        grads = (q.grad, k.grad, v.grad) + (() if sink is None else (sink.grad,))
    else:
        varlen = {} if cfg.seqlens is None else varlen
        grads = fa.flash_attn_bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, **varlen, **common,
                                  rng_state=rng_state)
        grads = grads[:3] + grads[4:]
    return out.detach(), lse, rng_state, grads


def run_oracle(cfg: Config, q, k, v, dout, slopes, rng_state, compute_dtype, sink=None):
    """Per sequence naive attention; gradients by autograd. Returns out, lse, dq, dk, dv (and dsink with a sink)."""
    q, k, v = (t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v))
    sink = None if sink is None else sink.detach().to(compute_dtype).requires_grad_()
    outs, lses = [], []
    if cfg.seqlens is None:
        pieces = [(b, q[b], k[b], v[b]) for b in range(cfg.batch)]
        max_q, max_k = cfg.seqlen_q, cfg.seqlen_k
    else:
        cu_q, cu_k, max_q, max_k = varlen_meta(cfg)
        pieces = [(b, q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]])
                  for b in range(len(cfg.seqlens))]
    for b, qb, kb, vb in pieces:
        o, lse = naive_attention(qb, kb, vb, causal=cfg.causal, window=cfg.window, diagonal=cfg.diagonal,
                                 softcap=cfg.softcap,
                                 alibi_slopes=None if slopes is None else slopes[b], dropout_p=cfg.dropout_p,
                                 rng_state=rng_state, batch_index=b, heads=cfg.heads_q, max_seqlen_q=max_q,
                                 max_seqlen_k=max_k, sink=sink, compute_dtype=compute_dtype)
        outs.append(o)
        lses.append(lse)
    out = torch.stack(outs) if cfg.seqlens is None else torch.cat(outs)
    lse = torch.stack(lses) if cfg.seqlens is None else torch.cat(lses, dim=1)
    out.backward(dout.to(compute_dtype))
    return (out.detach(), lse.detach(), q.grad, k.grad, v.grad) + (() if sink is None else (sink.grad,))


def check_case(cfg: Config, backend="reference", device="cpu", seed=0):
    q, k, v, dout, slopes = make_inputs(cfg, device, seed)
    sink = make_sink(cfg, device, seed)
    out, lse, rng_state, grads = run_ours(cfg, q, k, v, dout, slopes, backend, sink)
    return judge(cfg, (q, k, v, dout, slopes), out, lse, rng_state, grads, sink)


def judge(cfg: Config, inputs, out, lse, rng_state, grads, sink=None):
    """Our outputs against the float64 oracle under the 2x rule (the same-precision oracle is the yardstick),
    lse exactly +inf on the rows that see no key (with a sink: none); returns out and dq, dk, dv. With a sink,
    `grads` ends with dsink, judged by the same rule (the same-precision oracle's sink in the inputs' dtype)."""
    q, k, v, dout, slopes = inputs
    dq, dk, dv = grads[:3]
    cpu = [t.cpu() for t in (q, k, v, dout)]
    slopes_cpu = None if slopes is None else slopes.cpu()
    rng_cpu = None if rng_state is None else rng_state.cpu()
    sink_cpu = None if sink is None else sink.cpu()
    ref = run_oracle(cfg, *cpu, slopes_cpu, rng_cpu, torch.float64, sink_cpu)
    pt = run_oracle(cfg, *cpu, slopes_cpu, rng_cpu, cfg.dtype, sink_cpu)
    # Scale of a gradient entry, for the degenerate case of assert_close_2x.
    unit = max([t.abs().max().item() for t in cpu if t.numel()] or [1.0]) ** 3 / (1 - cfg.dropout_p)
    for name, ours, r, p in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref[0], *ref[2:]), (pt[0], *pt[2:])):
        assert ours.shape == r.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(r.shape)}"
        # dK/dV of GQA: each of the group's per-head gradients may be rounded to the input dtype (CK contract)
        roundings = 1 + (cfg.heads_q // cfg.heads_k if name in ("dk", "dv") and cfg.heads_q != cfg.heads_k else 0)
        assert_close_2x(name, ours.cpu(), r, p, unit=unit, roundings=roundings)
    if sink is not None:
        assert grads[3].dtype == sink.dtype, "dsink: in the sink's dtype"
        assert_close_2x("dsink", grads[3].cpu(), ref[5], pt[5], unit=unit)
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "lse: +inf exactly on the rows with no key"
    assert (lse.cpu()[~finite] == float("inf")).all()
    assert torch.allclose(lse.cpu()[finite].double(), ref[1][finite], atol=1e-4, rtol=1e-5), "lse"
    return out, (dq, dk, dv)


# ---- one mask of each kind (core/mask.py MaskKind): the test grids are each backend's declared kinds ----

@dataclass(frozen=True)
class MaskCase:
    """A mask of one kind as the package builds it (from the lengths), and the same keep rule as the
    oracle's arguments (Config's causal / window / diagonal)."""
    build: Callable[[int, int], MaskInfo]
    oracle: dict


MASK_KIND_CASES = {
    MaskKind.NONE: MaskCase(MaskInfo.no_mask, {}),
    MaskKind.CAUSAL: MaskCase(lambda s_q, s_k: MaskInfo.from_flash_args(True, (-1, -1), s_q, s_k), dict(causal=True)),
    MaskKind.CAUSAL_TOP_LEFT: MaskCase(lambda s_q, s_k: MaskInfo.top_left(-1, 0, s_q, s_k),
                                       dict(causal=True, diagonal=0)),
    MaskKind.WINDOW: MaskCase(lambda s_q, s_k: MaskInfo.from_flash_args(False, (9, 4), s_q, s_k), dict(window=(9, 4))),
    MaskKind.WINDOW_TOP_LEFT: MaskCase(lambda s_q, s_k: MaskInfo.top_left(9, 4, s_q, s_k),
                                       dict(window=(9, 4), diagonal=0)),
    # Row i keeps keys i + 3 .. i + 11: no top-left or bottom-right window is that (its left side is
    # past the diagonal), and the last rows see no key.
    MaskKind.GENERIC: MaskCase(lambda s_q, s_k: MaskInfo.generic(-2, 12, s_q, s_k), dict(window=(0, 8), diagonal=3)),
}
# Lengths the mask cases run on: the two alignments differ only where s_q != s_k.
MASK_KIND_SHAPES = {"sq<sk": (37, 61), "sq>sk": (61, 37)}


def mask_kind_grid(kinds) -> list:
    """pytest parameters (kind, lengths): every kind of `kinds` (a backend's declaration) on both shapes."""
    return [pytest.param(kind, shape, id=f"{kind.name.lower()}-{name}")
            for kind in MaskKind if kind in kinds for name, shape in MASK_KIND_SHAPES.items()]


def check_mask_kind(backend, kind: MaskKind, seqlens: tuple[int, int], device="cpu", dtype=torch.bfloat16,
                    head_dim=32, seed=0, alibi=False):
    """Forward and backward of `backend` itself (an instance, below the public API, which makes only
    flash-attn's kinds) on one mask of `kind`, judged against the oracle; with `alibi`, ALiBi slopes too (their
    distance is from the bottom-right diagonal whatever the mask's alignment), or, where the backend declares
    ALiBi not to run with `kind`, its refusal in words."""
    case = MASK_KIND_CASES[kind]
    cfg = Config(seqlen_q=seqlens[0], seqlen_k=seqlens[1], head_dim=head_dim, dtype=dtype, alibi=alibi, **case.oracle)
    q, k, v, dout, slopes = make_inputs(cfg, device, seed)
    options = AttentionOptions(alibi_slopes=slopes)
    problem = replace(describe_call(q, k, v, options), mask=case.build(*seqlens))
    assert problem.mask.kind == kind
    reasons = backend.not_supported_reasons(problem)
    if alibi and backend.alibi_mask_kinds is not None and kind not in backend.alibi_mask_kinds:
        assert any("ALiBi" in r and kind.value in r for r in reasons), reasons     # refused in words, not run
        return None
    assert not reasons, reasons
    out = torch.empty_like(q)
    lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=device)
    params = kernel_params(problem, q, k, v, options, None)
    backend.forward(problem, params, out, lse)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    run_backward(backend, problem, params, out, lse, dout, *grads, None)
    return judge(cfg, (q, k, v, dout, slopes), out, lse, None, grads)


class OpRecorder(TorchDispatchMode):
    """Passes every torch operation through, noting its name. While it is active an eager call goes through the
    `torch.library` ops (ops.py's `_direct` steps aside for a dispatch mode), as under torch.compile."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))
