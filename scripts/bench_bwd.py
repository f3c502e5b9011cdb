"""Forward and backward of the Triton backend side by side with peers, row by row, every peer in the same process.

Peers (each when it runs here): torch SDPA with the flash (FA2), cuDNN and memory-efficient
backends; FlexAttention (torch.compile(flex_attention)); FA4 (flash_attn.cute) when importable.
Rows are data (`Row`: d, d_v, h, h_k, s, causal and one feature), in named sets (`--rows`, comma-separated):
- default: b = 16384 / s, h = 2048 / d, d in {64, 128, 256}, s in 512..16384 (--quick: 2048 and 8192), causal
  and not, plus GQA 32/8 rows at d128;
- grid: d in {64, 96, 128, 192, 256} (h = 2048 / d) and GQA 32/8 and 64/8 at d128, s as above, causal and not,
  and each of those shapes at s8192 again in the deterministic mode;
- features: causal rows at s2048 and s8192: (d, d_v) = (192, 128) MHA and GQA; a learnable sink on GQA 64/8 at
  d64 and d128; softcap at d128 and d256; ALiBi at d128, dropout at d64, d128 and d256; each feature row beside its
  shape without the feature.
bf16. TFLOP/s = the package's count (docs/semantics.md §FLOPs: `AttentionProblem.forward_flops` /
`backward_flops`, d_v included) over the median of triton.testing.do_bench; peak extra memory = peak allocated
during one backward minus what was allocated before it. The markdown gives ours over each peer (forward and
backward) and, for a feature row, what the feature costs ours against the same shape without it.
A feature reaches every runner that has it (ours: all; FA4: sink, softcap, d_v, deterministic; SDPA: d_v,
dropout); a peer without it is skipped with the reason (`Unsupported`).

    python scripts/bench_bwd.py [--rows default|grid|features,...] [--quick] [--peers triton,fa4,...] [--out bench]
Writes bench/<gpu>-<date>.{json,md,png} (scripts/bench_store.py keeps one as the current grid). `--plan` lists
the rows and estimates how long they take, running nothing. `--warm-only` runs each forward and backward once and
times nothing: run in other processes beforehand (`--shard i/n` each), it fills the on-disk compile caches of
Triton, FA4 (with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1) and FlexAttention (Inductor), so that the timed run
does not spend its device minutes compiling. `--budget-s` starts no row after that many seconds (the rows left
are listed in the json). Without CUDA it runs ours through the reference backend at tiny sizes with the other
peers skipped: that checks the bookkeeping, not speed.
Its runners (varlen, windows, deterministic, features) and timing (`time_passes`) also serve
scripts/bench_workloads.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_attn_ck as fa
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.options import AttentionOptions

MiB = 2 ** 20
TOKENS = 16384                 # b = TOKENS / s
FEATURES = ("none", "sink", "softcap", "alibi", "dropout", "deterministic")
SOFTCAP = 50.0
DROPOUT_P = 0.1


@dataclass(frozen=True)
class Row:
    """One benchmark row: the shape, the mask and the one feature every runner gets ("none": plain attention)."""
    d: int
    h: int
    h_k: int
    s: int
    causal: bool
    feature: str = "none"
    d_v: int = 0                   # v's head dim; 0: d
    tokens: int = TOKENS           # b = tokens / s
    row_set: str = ""              # the named set it was built for (one markdown table each)

    def __post_init__(self):
        if self.feature not in FEATURES:
            raise ValueError(f"Row.feature: expected one of {FEATURES}, got {self.feature!r}")
        if self.d_v == 0:
            object.__setattr__(self, "d_v", self.d)

    @property
    def b(self) -> int:
        return max(1, self.tokens // self.s)

    @property
    def shape(self) -> tuple:
        """What a feature row shares with the row it is measured against."""
        return self.d, self.d_v, self.h, self.h_k, self.s, self.causal, self.tokens

    def plain(self) -> Row:
        return dataclasses.replace(self, feature="none")

    def compile_key(self) -> tuple:
        """What decides which kernels a call compiles (lengths aside): warm-up shards split the rows by it."""
        return self.d, self.d_v, self.h != self.h_k, self.causal, self.feature

    def tiny(self) -> Row:
        """The CPU run's row: the same head dims, feature and mask; 1/256 of the length, 64 tokens, 2 kv heads (1
        with GQA, keeping the group size up to 8 query heads)."""
        h_k = 1 if self.h != self.h_k else 2
        return dataclasses.replace(self, h=min(8, h_k * (self.h // self.h_k)), h_k=h_k, s=max(8, self.s // 256),
                                   tokens=64)

    def problem(self):
        """The package's description of this call (its FLOP count: docs/semantics.md §FLOPs)."""
        def meta(heads, head_dim):
            return torch.empty(self.b, self.s, heads, head_dim, device="meta", dtype=torch.bfloat16)
        return describe_call(meta(self.h, self.d), meta(self.h_k, self.d), meta(self.h_k, self.d_v),
                             AttentionOptions(causal=self.causal))

    @property
    def label(self) -> str:
        dims = f"d{self.d}" if self.d_v == self.d else f"d{self.d}/{self.d_v}"
        feature = "" if self.feature == "none" else f" {self.feature}"
        return f"{dims} h{self.h}/{self.h_k} s{self.s} {'causal' if self.causal else 'full'}{feature}"

    @classmethod
    def from_result(cls, result: dict) -> Row:
        """The row of a json result (results written before rows had features, d_v or tokens included)."""
        given = {f.name: result[f.name] for f in dataclasses.fields(cls) if f.name in result}
        given.setdefault("tokens", result["b"] * result["s"])
        return cls(**given)


def _lengths(quick: bool) -> list[int]:
    return [2048, 8192] if quick else [512, 1024, 2048, 4096, 8192, 16384]


def default_rows(quick: bool) -> list[Row]:
    rows = [Row(d, 2048 // d, 2048 // d, s, c) for d in (64, 128, 256) for s in _lengths(quick) for c in (False, True)]
    return rows + [Row(128, 32, 8, s, c) for s in (2048, 8192) for c in (False, True)]


GRID_SHAPES = [(d, 2048 // d, 2048 // d) for d in (64, 96, 128, 192, 256)] + [(128, 32, 8), (128, 64, 8)]


def grid_rows(quick: bool) -> list[Row]:
    rows = [Row(d, h, h_k, s, c) for d, h, h_k in GRID_SHAPES for s in _lengths(quick) for c in (False, True)]
    return rows + [Row(d, h, h_k, 8192, c, "deterministic") for d, h, h_k in GRID_SHAPES for c in (False, True)]


def feature_rows(quick: bool) -> list[Row]:
    """Causal, s2048 and s8192; `quick` changes nothing (these are the quick lengths)."""
    rows = []
    for s in (2048, 8192):
        rows += [Row(192, 16, 16, s, True, d_v=128), Row(192, 32, 8, s, True, d_v=128)]
        for d in (64, 128):
            rows += [Row(d, 64, 8, s, True), Row(d, 64, 8, s, True, "sink")]
        for d in (128, 256):
            rows += [Row(d, 2048 // d, 2048 // d, s, True), Row(d, 2048 // d, 2048 // d, s, True, "softcap")]
        rows += [Row(128, 16, 16, s, True, feature) for feature in ("alibi", "dropout")]
        rows += [Row(64, 32, 32, s, True), Row(64, 32, 32, s, True, "dropout"), Row(256, 8, 8, s, True, "dropout")]
    return rows


ROW_SETS: dict[str, Callable[[bool], list[Row]]] = {"default": default_rows, "grid": grid_rows,
                                                     "features": feature_rows}


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes: 2^(-8 i / heads), i = 1..heads."""
    return torch.tensor([2.0 ** (-8.0 * i / heads) for i in range(1, heads + 1)])


# ---- runners: each returns a forward callable producing an output that backward can use ----------
class Unsupported(Exception):
    """A peer that cannot run this call (the message says why); reported as skipped, not as an error."""


@dataclass(frozen=True)
class CallFeatures:
    """What a call passes beyond q, k, v and the mask (flash_attn_ck's names; the defaults: none of it)."""
    learnable_sink: torch.Tensor | None = None
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0

    def kinds(self) -> frozenset[str]:
        """The features this call has, by `Row.feature`'s names."""
        on = dict(sink=self.learnable_sink is not None, softcap=bool(self.softcap),
                  alibi=self.alibi_slopes is not None, dropout=bool(self.dropout_p))
        return frozenset(kind for kind, present in on.items() if present)


OURS = ("triton", "reference", "triton-det")


# What a peer's runner cannot pass, per feature (FA4's passes the sink, softcap, d_v and the deterministic mode;
# SDPA's d_v and dropout).
MISSING = {"fa4": dict(alibi="no ALiBi (flash_attn.cute takes no alibi_slopes)",
                       dropout="no dropout (flash_attn.cute takes no dropout_p)"),
           "sdpa": dict(sink="no learnable sink", softcap="no softcap",
                        alibi="ALiBi only as a materialised bias mask, not as a kernel feature"),
           "flex": dict(sink="no learnable sink through this runner", softcap="no score_mod through this runner",
                        alibi="no score_mod through this runner", dropout="no dropout")}


def refusal(name: str, features: frozenset[str] = frozenset(), *, deterministic=False, varlen=None, window=None,
            gqa=False) -> str | None:
    """Why peer `name` cannot run a call with these `features` (of "sink", "softcap", "alibi", "dropout") through
    its runner, or None. Ours runs everything."""
    if name in OURS or name in VARIANTS:
        return None
    if name != "fa4":
        if varlen is not None or window is not None:
            return f"{name}: no varlen or sliding-window call through this runner"
        if deterministic:
            return f"{name}: no deterministic mode through this runner"
        if name == "sdpa_mem_eff" and gqa:
            return f"{name}: no GQA"
    missing = MISSING["sdpa" if name.startswith("sdpa_") else name]
    return next((f"{name}: {missing[kind]}" for kind in FEATURES if kind in features and kind in missing), None)


def row_refusal(name: str, row: Row) -> str | None:
    """`refusal` of a row's call."""
    features = frozenset({row.feature} - {"none", "deterministic"})
    return refusal(name, features, deterministic=row.feature == "deterministic", gqa=row.h != row.h_k)


def make_runner(name, q, k, v, causal, *, window=None, deterministic=False, varlen=None,
                features: CallFeatures = CallFeatures()):
    """q, k, v: (b, s, h, d) leaves with requires_grad (v: its own head dim d_v), or (total, h, d) with `varlen` =
    (cu_seqlens int32 (b + 1,), max_seqlen), the same lengths for queries and keys. `window`: the left window size
    (bottom-right, right = 0 under causal; None: unbounded). `features`: the sink, softcap, ALiBi slopes and
    dropout of the call. Returns fwd() -> out (any layout). Raises Unsupported (`refusal`'s reason)."""
    why = refusal(name, features.kinds(), deterministic=deterministic, varlen=varlen, window=window,
                  gqa=q.shape[-2] != k.shape[-2])
    if why:
        raise Unsupported(why)
    if name in OURS or name in VARIANTS:   # a variant's backend is set by the caller (measure_peer, measure)
        return _ours(name, q, k, v, causal, window, deterministic or name == "triton-det", varlen, features)
    if name == "fa4":
        return _fa4(q, k, v, causal, window, deterministic, varlen, features)
    if name.startswith("sdpa_"):
        return _sdpa(name, q, k, v, causal, features.dropout_p)
    if name == "flex":
        return _flex_runner(q, k, v, causal)
    raise ValueError(name)


def _ours(name, q, k, v, causal, window, deterministic, varlen, features: CallFeatures):
    backend = "reference" if name == "reference" else "triton"
    window_size = (-1, -1) if window is None else (window, 0 if causal else -1)
    options = dict(causal=causal, window_size=window_size, deterministic=deterministic, backend=backend,
                   learnable_sink=features.learnable_sink, softcap=features.softcap,
                   alibi_slopes=features.alibi_slopes, dropout_p=features.dropout_p)
    if varlen is not None:
        cu, longest = varlen
        return lambda: fa.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, **options)
    return lambda: fa.flash_attn_func(q, k, v, **options)


def _fa4(q, k, v, causal, window, deterministic, varlen, features: CallFeatures):
    from flash_attn.cute.interface import flash_attn_func as fa4
    from flash_attn.cute.interface import flash_attn_varlen_func as fa4_varlen
    fa4_window = (window, 0 if causal else None) if window is not None else (None, None)
    options = dict(causal=causal, window_size=fa4_window, deterministic=deterministic,
                   learnable_sink=features.learnable_sink, softcap=features.softcap)

    def first(o):
        return o[0] if isinstance(o, tuple) else o
    if varlen is not None:
        cu, longest = varlen
        return lambda: first(fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                        max_seqlen_k=longest, **options))
    return lambda: first(fa4(q, k, v, **options))


def _sdpa(name, q, k, v, causal, dropout_p):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kind = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_mem_eff": SDPBackend.EFFICIENT_ATTENTION}[name]
    gqa = q.shape[-2] != k.shape[-2]

    def run():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(kind):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa,
                                                                    dropout_p=dropout_p)
    return run


def _flex_runner(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask
    compiled = _flex()
    s = q.shape[1]
    mask = create_block_mask(lambda b_, h_, i, j: i >= j, None, None, s, s) if causal else None
    return lambda: compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                            enable_gqa=q.shape[-2] != k.shape[-2])


_flex_fn = None


def _flex():
    global _flex_fn
    if _flex_fn is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
        torch._dynamo.config.recompile_limit = 1000
        torch._dynamo.config.cache_size_limit = 1000
        _flex_fn = torch.compile(flex_attention, dynamic=False)
    return _flex_fn


# Backend options timed as extra peers (`--peers triton,triton-pointers,...`): "triton-pointers" moves
# every tile by pointers (forward included), "triton-tma" every tile through TMA descriptors,
# "triton-one-launch" the kernels before the warp-specialised ones (forward and backward), "triton-ws" the
# warp-specialised ones wherever they can run (their length thresholds in config.py are measured this way).
VARIANTS = {"triton-accum": dict(gqa_epilogue="accumulate"), "triton-atomic-dq": dict(dq_mode="atomic"),
            "triton-dq-pass": dict(dq_mode="pass"), "triton-pointers": dict(use_tma=False),
            "triton-tma": dict(use_tma=True), "triton-one-launch": dict(ws=False, fwd_ws=False),
            "triton-ws": dict(ws=True, fwd_ws=True)}


def leaf(shape, generator: torch.Generator, device: torch.device, dtype=torch.bfloat16) -> torch.Tensor:
    """A seeded standard-normal leaf that requires grad (drawn in fp32: CPU generators draw no bf16)."""
    t = torch.randn(*shape, generator=generator, device=device, dtype=torch.float32)
    return t.to(dtype).requires_grad_()


def row_inputs(row: Row, device: torch.device, seed: int = 0) -> tuple[tuple[torch.Tensor, ...], CallFeatures]:
    """The leaves a backward differentiates (q, k, v, and the sink of a sink row: fp32, as a model keeps it) and
    the call's features."""
    gen = torch.Generator(device=device).manual_seed(seed)
    leaves = [leaf((row.b, row.s, heads, dim), gen, device) for heads, dim in ((row.h, row.d), (row.h_k, row.d),
                                                                               (row.h_k, row.d_v))]
    sink = leaf((row.h,), gen, device, torch.float32) if row.feature == "sink" else None
    features = CallFeatures(learnable_sink=sink, softcap=SOFTCAP if row.feature == "softcap" else 0.0,
                            alibi_slopes=alibi_slopes(row.h).to(device) if row.feature == "alibi" else None,
                            dropout_p=DROPOUT_P if row.feature == "dropout" else 0.0)
    return (*leaves, *([sink] if sink is not None else [])), features


def time_row(row: Row, name: str, device: torch.device, warm_only=False) -> dict:
    """time_passes of runner `name` on `row` (raises what the runner raises)."""
    leaves, features = row_inputs(row, device)
    fwd = make_runner(name, *leaves[:3], row.causal, deterministic=row.feature == "deterministic", features=features)
    return time_passes(fwd, leaves, warm_only=warm_only)


def with_tflops(row: Row, timed: dict) -> dict:
    problem = row.problem()
    return dict(timed, fwd_tflops=problem.forward_flops() / timed["fwd_ms"] / 1e9,
                bwd_tflops=problem.backward_flops() / timed["bwd_ms"] / 1e9)


@contextlib.contextmanager
def _backend_of(name: str, configs=None, backend=None):
    """Within the block our runners use the TritonBackend of `name` (a variant's options, tuned tiles)."""
    from flash_attn_ck.backends.triton import TritonBackend
    with fa.use_backend(backend or TritonBackend(configs=configs, **VARIANTS.get(name, {}))):
        yield


def measure(name, b, h, h_k, s, d, causal, configs=None, warm_only=False, backend=None):
    """Forward and backward timings and backward peak memory of one runner on one plain shape (CUDA). `backend`: the
    TritonBackend instance the "triton" runners use (default: one with `configs` and the variant's options)."""
    row = Row(d, h, h_k, s, causal, tokens=b * s)
    with _backend_of(name, configs, backend):
        timed = time_row(row, name, torch.device("cuda"), warm_only)
    return timed if warm_only else with_tflops(row, timed)


def guarded(timing: Callable[[], dict], device: torch.device) -> dict:
    """timing()'s result, or `skipped` with the reason (Unsupported) or `error` (any other exception: a peer failing
    on one row is a result, not the end of the run); the allocator's cache is emptied after it."""
    try:
        return timing()
    except Unsupported as e:
        return dict(skipped=str(e))
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure_peer(row: Row, name: str, device: torch.device, *, warm_only=False, configs=None) -> dict:
    """Raw timings of one runner on one row (`time_passes`' keys), or `skipped`/`error` with why. Without CUDA only
    the reference runs; the others say why they would not run the row, or else that they need CUDA."""
    def timing():
        if why := row_refusal(name, row):
            raise Unsupported(why)
        if device.type != "cuda" and name != "reference":
            raise Unsupported("needs CUDA")
        with _backend_of(name, configs) if device.type == "cuda" else contextlib.nullcontext():
            return time_row(row, name, device, warm_only)
    return guarded(timing, device)


def time_ms(fn, device: torch.device) -> float:
    """Median milliseconds of fn(): triton's do_bench on CUDA, the wall clock of one run elsewhere (CPU runs
    check the benchmark's bookkeeping, not speed)."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def peak_extra_mib(fn, device: torch.device) -> float | None:
    """Peak memory allocated while fn() runs (its result included) beyond what was allocated before it, MiB;
    None where the allocator keeps no statistics (CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / MiB
    del result
    return peak


def time_passes(fwd, leaves, *, step=False, warm_only=False) -> dict:
    """Times fwd() (no autograd), the backward of one forward's graph (its peak extra memory too) and, with
    `step`, one forward + backward step and its peak extra memory. Each is run once first (compiles): the seconds
    of that first forward and backward are `first_call_s`."""
    device = leaves[0].device
    start = time.perf_counter()
    out = fwd()
    dout = torch.randn_like(out)
    bwd = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    step_fn = lambda: torch.autograd.grad(fwd(), leaves, dout)
    bwd()
    if step:
        step_fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    if warm_only:
        return dict(warm_only=True, first_call_s=first_call_s)
    timed = dict(first_call_s=first_call_s, bwd_peak_mib=peak_extra_mib(bwd, device))
    if step:
        timed["step_peak_mib"] = peak_extra_mib(step_fn, device)
    with torch.no_grad():
        timed["fwd_ms"] = time_ms(fwd, device)
    timed["bwd_ms"] = time_ms(bwd, device)
    if step:
        timed["step_ms"] = time_ms(step_fn, device)
    return timed


def ratios(peers: dict, ours: str, kinds=("fwd", "bwd")) -> dict:
    """ours / peer in TFLOP/s per pass kind, for every peer with a number."""
    mine = peers.get(ours, {})
    return {f"{kind}_{peer}": mine[f"{kind}_tflops"] / r[f"{kind}_tflops"]
            for peer, r in peers.items() if peer != ours for kind in kinds
            if f"{kind}_tflops" in r and f"{kind}_tflops" in mine}


def feature_costs(results: list[dict], ours: str) -> None:
    """Each feature row's `cost`: ours' time with the feature over ours' time on the same shape without it (in the
    same row set), minus one, per pass ({} where either is missing)."""
    def twin(r):
        return r.get("row_set", ""), Row.from_result(r).shape
    plain = {twin(r): r["peers"].get(ours, {}) for r in results if r.get("feature", "none") == "none"}
    for r in results:
        if r.get("feature", "none") == "none":
            continue
        mine, base = r["peers"].get(ours, {}), plain.get(twin(r), {})
        r["cost"] = {kind: mine[f"{kind}_ms"] / base[f"{kind}_ms"] - 1 for kind in ("fwd", "bwd")
                     if f"{kind}_ms" in mine and f"{kind}_ms" in base}


def annotate(results: list[dict], ours: str) -> None:
    """The ratio and cost columns, from the measured numbers (again after a merge: a feature's plain row may come
    from another part)."""
    for r in results:
        r["ratios"] = ratios(r["peers"], ours)
    feature_costs(results, ours)


def fa4_version(names: list[str]) -> str | None:
    """flash-attn-4's version when "fa4" is asked for and importable; otherwise "fa4" is removed from `names`
    (a note says why)."""
    if "fa4" not in names:
        return None
    try:
        from importlib.metadata import version

        import flash_attn.cute.interface  # noqa: F401
        return version("flash-attn-4")
    except Exception as e:
        print(f"FA4 not importable ({type(e).__name__}: {e}); skipped")
        names.remove("fa4")
        return None


def rewrite(args):
    """--replot (redraw one run's PNG and markdown) or --merge (one JSON/markdown/PNG of several runs' rows)."""
    paths = [Path(x) for x in (args.replot or args.merge).split(",")]
    runs = [json.loads(x.read_text()) for x in paths]
    meta = dict(runs[0]["meta"], merged_from=[x.name for x in paths]) if args.merge else runs[0]["meta"]
    results = [r for run in runs for r in run["results"]]
    stem = paths[0].with_suffix("") if args.replot else Path(args.out) / f"{_stem(meta)}{args.tag}"
    peers = list(dict.fromkeys(n for r in results for n in r["peers"]))
    annotate(results, meta.get("ours", "triton"))
    write(stem, meta, results, peers, json_too=bool(args.merge))


def selected_rows(args) -> list[Row]:
    """The rows to time: --shapes, else the named sets; then --dims, --features, --skip-done and --shard (by compile
    key: a shard compiles what no other shard does)."""
    if args.shapes:
        rows = [Row(d, h, h_k, s, bool(c), row_set="shapes")
                for d, h, h_k, s, c in (map(int, spec.split(":")) for spec in args.shapes.split(","))]
    else:
        rows = [dataclasses.replace(row, row_set=name) for name in args.rows.split(",")
                for row in ROW_SETS[name](args.quick)]
    if args.dims:
        rows = [row for row in rows if row.d in {int(x) for x in args.dims.split(",")}]
    if args.features:
        wanted = set(args.features.split(","))
        shapes = {row.shape for row in rows if row.feature in wanted}
        rows = [row for row in rows if row.feature in wanted or (row.feature == "none" and row.shape in shapes)]
    if args.skip_done:
        done = {Row.from_result(r) for path in args.skip_done.split(",")
                for r in json.loads(Path(path).read_text())["results"]}
        rows = [row for row in rows if row not in done]
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        keys = list(dict.fromkeys(row.compile_key() for row in rows))
        rows = [row for row in rows if keys.index(row.compile_key()) % n == i]
    return rows


# Assumed seconds behind --plan's estimate (a run records first_call_s per peer and wall_s per row to check them):
# the first call of a new kernel specialisation, forward and backward (SDPA: cuDNN builds a graph per shape);
# one (row, peer) once compiled (do_bench's 25 + 100 ms of forward and of backward, the peak-memory pass, inputs);
# a process's start (imports, CUDA context).
ASSUMED_COMPILE_S = {"ours": 10.0, "fa4": 30.0, "sdpa": 2.0, "flex": 60.0}
ASSUMED_TIMED_S = 1.0
ASSUMED_START_S = 30.0


def _cache_kind(name: str) -> str:
    return "ours" if name in OURS or name in VARIANTS else "sdpa" if name.startswith("sdpa_") else name


def _assumed_compile_s(kind: str) -> float:
    return ASSUMED_COMPILE_S.get(kind, ASSUMED_COMPILE_S["ours"])


def plan(rows: list[Row], names: list[str], warm_shards: int) -> dict:
    """Seconds a run of `rows` should take under the ASSUMED_* costs: compiling, timing, in all; and with the
    compiling done first by `warm_shards` processes side by side (`--shard i/n`: peers with an on-disk cache, ours,
    FA4 and Flex, compile there; the slowest shard sets the warm-up's length)."""
    compiles: dict[str, set] = {}
    cached_by_key: dict[tuple, set] = {}       # compile key -> the cached kinds that compile it
    timed = 0
    for row in rows:
        for name in names:
            if row_refusal(name, row):
                continue
            timed += 1
            kind = _cache_kind(name)
            compiles.setdefault(kind, set()).add(row.shape if kind == "sdpa" else row.compile_key())
            if kind != "sdpa":
                cached_by_key.setdefault(row.compile_key(), set()).add(kind)
    compile_s = {kind: len(keys) * _assumed_compile_s(kind) for kind, keys in compiles.items()}
    timed_s = timed * ASSUMED_TIMED_S
    estimate = dict(rows=len(rows), runs=timed, compile_keys={k: len(v) for k, v in compiles.items()},
                    compile_s=compile_s, timed_s=timed_s,
                    one_process_s=ASSUMED_START_S + sum(compile_s.values()) + timed_s)
    if warm_shards:
        keys = list(dict.fromkeys(row.compile_key() for row in rows))
        shards = [sum(_assumed_compile_s(kind) for key in keys[i::warm_shards] for kind in cached_by_key.get(key, ()))
                  for i in range(warm_shards)]
        estimate["warm_s"] = ASSUMED_START_S + max(shards)
        estimate["after_warm_s"] = ASSUMED_START_S + compile_s.get("sdpa", 0.0) + timed_s
        estimate["warmed_total_s"] = estimate["warm_s"] + estimate["after_warm_s"]
    return estimate


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="default", help=f"named row sets, comma-separated: {','.join(ROW_SETS)}")
    ap.add_argument("--quick", action="store_true", help="s2048 and s8192 only")
    ap.add_argument("--peers", default="triton,sdpa_flash,sdpa_cudnn,sdpa_mem_eff,flex,fa4")
    ap.add_argument("--out", default="bench")
    ap.add_argument("--tag", default="")
    ap.add_argument("--shapes", default="", help="d:h:h_k:s:causal,... instead of the row sets (causal 0/1)")
    ap.add_argument("--dims", default="", help="only the rows of these head dims (q's), e.g. 64,128")
    ap.add_argument("--features", default="", help="only the rows of these features and their plain twins, e.g. "
                    "dropout,softcap")
    ap.add_argument("--skip-done", default="", help="A.json,...: leave out the rows these runs hold (then --merge)")
    ap.add_argument("--shard", default="", help="i/n: the rows of every n-th compile key from key i (--warm-only)")
    ap.add_argument("--tuned", default="", help="JSON of scripts/triton_tune.py: backward tiles per head dim")
    ap.add_argument("--replot", default="", help="redraw the PNG and markdown of an earlier JSON and exit")
    ap.add_argument("--merge", default="", help="A.json,B.json,...: one JSON/markdown/PNG of several runs' rows")
    ap.add_argument("--warm-only", action="store_true",
                    help="compile and run each case once, time nothing (SDPA peers left out: nothing cached on disk)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no row after this many seconds (0: no limit)")
    ap.add_argument("--plan", type=int, default=None, metavar="WARM_SHARDS", nargs="?", const=0,
                    help="list the rows and the estimated seconds (with WARM_SHARDS warm-up processes) and exit")
    args = ap.parse_args(argv)
    if unknown := set(args.rows.split(",")) - set(ROW_SETS):
        ap.error(f"--rows: unknown {sorted(unknown)}; expected some of {sorted(ROW_SETS)}")
    if args.replot or args.merge:
        rewrite(args)
        return None
    if args.plan is not None:
        rows = selected_rows(args)
        for row in rows:
            print(f"{row.row_set}: {row.label}")
        estimate = plan(rows, args.peers.split(","), args.plan)
        print(json.dumps(estimate, indent=1))
        return estimate
    return run(args)


def run(args) -> dict:
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    names = args.peers.split(",")
    if args.warm_only:      # SDPA keeps nothing on disk for a later process
        names = [n for n in names if not n.startswith("sdpa_")]
    if not cuda:    # ours through the reference backend; the others say why they did not run
        names = list(dict.fromkeys("reference" if n == "triton" else n for n in names))
    ours = next((n for n in names if n in OURS or n in VARIANTS), names[0])   # the ratio and cost columns' ours
    versions = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    if cuda and (fa4 := fa4_version(names)):
        versions["flash_attn_4"] = fa4
    tuned = json.loads(Path(args.tuned).read_text()) if args.tuned and Path(args.tuned).exists() else {}
    rows = selected_rows(args) if cuda else [row.tiny() for row in selected_rows(args)]
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name() if cuda else "cpu",
                **versions, python=platform.python_version(), quick=args.quick, dtype="bf16", tuned_tiles=tuned,
                rows="shapes" if args.shapes else args.rows, ours=ours, peers=names,
                sizes="full" if cuda else "tiny")
    stem = Path(args.out) / f"{_stem(meta)}{args.tag}"
    results, not_reached = [], []
    for row in rows:
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            not_reached.append(f"{row.row_set}: {row.label}")
            continue
        row_started = time.perf_counter()
        peers = {}
        for name in names:
            timed = measure_peer(row, name, device, warm_only=args.warm_only,
                                 configs=tuned_configs(tuned, row.d, row.causal))
            peers[name] = with_tflops(row, timed) if "fwd_ms" in timed else timed
        cells = " ".join(f"{n}={r['bwd_tflops']:.0f}" if "bwd_tflops" in r
                         else f"{n}={'warm' if 'warm_only' in r else 'skip' if 'skipped' in r else 'ERR'}"
                         for n, r in peers.items())
        print(f"{row.row_set} {row.label}: bwd TF/s {cells}", flush=True)
        if args.warm_only:
            continue
        results.append(dict(dataclasses.asdict(row), b=row.b, peers=peers, wall_s=time.perf_counter() - row_started))
        meta.update(wall_s=time.perf_counter() - started, not_reached=not_reached)
        stem.parent.mkdir(parents=True, exist_ok=True)   # saved per row: a cut-off run keeps its rows
        stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    meta.update(wall_s=time.perf_counter() - started, not_reached=not_reached)
    if not_reached:
        print(f"--budget-s {args.budget_s:.0f} spent: {len(not_reached)} rows not reached")
    if results:
        annotate(results, ours)
        write(stem, meta, results, names, json_too=True)
        print(markdown(meta, results, names))
    return dict(meta=meta, results=results)


def _stem(meta) -> str:
    return f"{meta['gpu'].replace(' ', '-').lower()}-{meta['date']}"


def write(stem: Path, meta, results, names, json_too: bool):
    stem.parent.mkdir(parents=True, exist_ok=True)
    if json_too:
        stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    stem.with_suffix(".md").write_text(markdown(meta, results, names))
    plot(results, names, stem.with_suffix(".png"))


def tuned_configs(tuned: dict, d: int, causal: bool):
    """config.SM90 with the backward tiles replaced by the tuning winners for this head dim, if any."""
    if str(d) not in tuned:
        return None
    from flash_attn_ck.backends.triton.config import SM90, Tile
    w = tuned[str(d)]
    return dataclasses.replace(SM90[(d, causal)], bwd_kv=Tile(*w["bwd_kv"]), bwd_dq=Tile(*w["bwd_dq"]))


PEER_TITLES = {"triton": "ours", "reference": "ours (reference)", "fa4": "FA4", "sdpa_cudnn": "cuDNN",
               "sdpa_flash": "FA2", "sdpa_mem_eff": "SDPA efficient", "flex": "Flex"}


def number(value, fmt=None) -> str:
    """A table cell: '-' for none, whole numbers from 10 up, two significant digits below (CPU runs)."""
    if value is None:
        return "-"
    return (fmt or ("{:.0f}" if abs(value) >= 10 else "{:.2g}")).format(value)


def not_measured(labelled: list[tuple[str, dict]], titles: dict) -> list[str]:
    """The markdown lines that say which peer did not run which rows and why (skipped or error), once per reason."""
    notes: dict[str, list[str]] = {}
    for label, peers in labelled:
        for name, r in peers.items():
            if why := r.get("skipped") or r.get("error"):
                notes.setdefault(f"{titles.get(name, name)}: {why}", []).append(label)
    if not notes:
        return []
    return ["", "Not measured:"] + [f"- {why} ({'all rows' if len(rows) == len(labelled) else '; '.join(rows)})"
                                    for why, rows in notes.items()]


ROW_SET_TITLES = {"default": "Dense grid", "grid": "Head dims, GQA and the deterministic mode",
                  "features": "Features beside the same shape without them", "shapes": "Shapes"}


def markdown(meta, results, names) -> str:
    ours = meta.get("ours", "triton")
    others = [n for n in names if n != ours]
    titles = {n: PEER_TITLES.get(n, n) for n in names}
    head = ["d", "h/h_k", "s", "causal", "feature"] + [f"bwd {titles[n]}" for n in names] \
        + [f"bwd ours / {titles[n]}" for n in others] + [f"fwd {titles[n]}" for n in names] \
        + [f"fwd ours / {titles[n]}" for n in others] + ["feature cost fwd", "feature cost bwd"] \
        + [f"MiB {titles[n]}" for n in names]
    lines = [f"# Attention forward/backward, {meta['gpu']}, {meta['date']}",
             "", f"torch {meta['torch']} (CUDA {meta['cuda']}), triton {meta['triton']}"
             + (f", flash-attn-4 {meta['flash_attn_4']}" if "flash_attn_4" in meta else "") + ", bf16, "
             f"{meta.get('sizes', 'full')} sizes; TFLOP/s (docs/semantics.md §FLOPs, median of do_bench); ours / peer "
             "in TFLOP/s; feature cost = ours' time with the feature over ours' time on the same shape without it, "
             "minus one; MiB = peak extra memory of one backward."]
    if meta.get("not_reached"):
        lines += ["", f"Not reached within the time budget: {'; '.join(meta['not_reached'])}."]
    for row_set in dict.fromkeys(r.get("row_set", "") for r in results):
        lines += ["", f"## {ROW_SET_TITLES.get(row_set, row_set)}" if row_set else "", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in (r for r in results if r.get("row_set", "") == row_set):
            row, p, rat, cost = Row.from_result(r), r["peers"], r.get("ratios", {}), r.get("cost", {})
            cells = [str(row.d) if row.d_v == row.d else f"{row.d}/{row.d_v}", f"{row.h}/{row.h_k}", str(row.s),
                     "yes" if row.causal else "no", row.feature]
            cells += [number(p.get(n, {}).get("bwd_tflops")) for n in names]
            cells += [number(rat.get(f"bwd_{n}"), "{:.2f}") for n in others]
            cells += [number(p.get(n, {}).get("fwd_tflops")) for n in names]
            cells += [number(rat.get(f"fwd_{n}"), "{:.2f}") for n in others]
            cells += [number(None if k not in cost else 100 * cost[k], "{:+.0f}%") for k in ("fwd", "bwd")]
            cells += [number(p.get(n, {}).get("bwd_peak_mib")) for n in names]
            lines.append("| " + " | ".join(cells) + " |")
    lines += not_measured([(Row.from_result(r).label, r["peers"]) for r in results], titles)
    return "\n".join(lines) + "\n"


def plot(results, names, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return
    rows = [(Row.from_result(r), r) for r in results]
    panels = list(dict.fromkeys(dataclasses.replace(row, s=0, tokens=0) for row, _ in rows))
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(4 * cols, 3 * math.ceil(len(panels) / cols)),
                             squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        mine = [(row, r) for row, r in rows if dataclasses.replace(row, s=0, tokens=0) == panel]
        for n in names:
            pts = [(row.s, r["peers"][n]["bwd_tflops"]) for row, r in mine if "bwd_tflops" in r["peers"].get(n, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=PEER_TITLES.get(n, n))
        ax.set_xscale("log", base=2)
        ax.set_title(mine[0][0].label.replace(f" s{mine[0][0].s}", ""), fontsize=9)
        ax.set_ylabel("bwd TFLOP/s")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
