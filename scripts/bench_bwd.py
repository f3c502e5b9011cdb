"""Forward and backward of the Triton backend side by side with peers, on the grid of docs/semantics.md §FLOPs.

Peers (each when it runs here): torch SDPA with the flash (FA2), cuDNN and memory-efficient
backends; FlexAttention (torch.compile(flex_attention)); FA4 (flash_attn.cute) when importable.
Shapes: b = 16384 / s, h = 2048 / d, d in {64, 128, 256}, s in 512..16384, causal and not, plus
GQA 32/8 rows at d128. bf16. TFLOP/s = docs/semantics.md's count (2.5 x 4 b h s_q s_k d for the backward,
halved when causal) over the median of triton.testing.do_bench; peak extra memory = peak
allocated during one backward minus what was allocated before it.

    python scripts/bench_bwd.py [--quick] [--peers sdpa_flash,cudnn,flex,fa4,...] [--out bench]
Writes bench/<gpu>-<date>.{json,md,png} (scripts/bench_store.py keeps one as the current grid). `--warm-only` runs
each forward and backward once and times
nothing: run in another process beforehand, it fills the on-disk compile caches of FlexAttention
(Inductor) and Triton, so that the timed run does not spend its device minutes compiling.
Its runners (varlen, windows, deterministic) and timing (`time_passes`) also serve scripts/bench_workloads.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_attn_ck as fa

MiB = 2 ** 20


def grid(quick: bool):
    seqs = [2048, 8192] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    rows = [(d, 2048 // d, 2048 // d, s, c) for d in (64, 128, 256) for s in seqs for c in (False, True)]
    rows += [(128, 32, 8, s, c) for s in (2048, 8192) for c in (False, True)]
    return rows


def flops(b, h, s, d, causal, backward):
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return 2.5 * f if backward else f


# ---- runners: each returns a forward callable producing an output that backward can use ----------
class Unsupported(Exception):
    """A peer that cannot run this call (the message says why); reported as skipped, not as an error."""


def make_runner(name, q, k, v, causal, *, window=None, deterministic=False, varlen=None):
    """q, k, v: (b, s, h, d) leaves with requires_grad, or (total, h, d) with `varlen` = (cu_seqlens int32
    (b + 1,), max_seqlen), the same lengths for queries and keys. `window`: the left window size (bottom-right,
    right = 0 under causal; None: unbounded). Returns fwd() -> out (any layout). Raises Unsupported."""
    if name in ("triton", "reference", "triton-det") or name in VARIANTS:   # a variant's backend is set by measure()
        return _ours(name, q, k, v, causal, window, deterministic or name == "triton-det", varlen)
    if name == "fa4":
        return _fa4(q, k, v, causal, window, deterministic, varlen)
    if varlen is not None or window is not None:
        raise Unsupported(f"{name}: no varlen or sliding-window call through this runner")
    if deterministic:
        raise Unsupported(f"{name}: no deterministic mode through this runner")
    if name.startswith("sdpa_"):
        return _sdpa(name, q, k, v, causal)
    if name == "flex":
        return _flex_runner(q, k, v, causal)
    raise ValueError(name)


def _ours(name, q, k, v, causal, window, deterministic, varlen):
    backend = "reference" if name == "reference" else "triton"
    window_size = (-1, -1) if window is None else (window, 0 if causal else -1)
    if varlen is not None:
        cu, longest = varlen
        return lambda: fa.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal,
                                                 window_size=window_size, deterministic=deterministic,
                                                 backend=backend)
    return lambda: fa.flash_attn_func(q, k, v, causal=causal, window_size=window_size,
                                      deterministic=deterministic, backend=backend)


def _fa4(q, k, v, causal, window, deterministic, varlen):
    from flash_attn.cute.interface import flash_attn_func as fa4
    from flash_attn.cute.interface import flash_attn_varlen_func as fa4_varlen
    fa4_window = (window, 0 if causal else None) if window is not None else (None, None)

    def first(o):
        return o[0] if isinstance(o, tuple) else o
    if varlen is not None:
        cu, longest = varlen
        return lambda: first(fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                        max_seqlen_k=longest, causal=causal, window_size=fa4_window,
                                        deterministic=deterministic))
    return lambda: first(fa4(q, k, v, causal=causal, window_size=fa4_window, deterministic=deterministic))


def _sdpa(name, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kind = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_mem_eff": SDPBackend.EFFICIENT_ATTENTION}[name]
    gqa = q.shape[-2] != k.shape[-2]

    def run():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(kind):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
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


def measure(name, b, h, h_k, s, d, causal, configs=None, warm_only=False, backend=None):
    """Forward and backward timings and backward peak memory of one runner on one shape. `backend`: the
    TritonBackend instance the "triton" runners use (default: one with `configs` and the variant's options)."""
    from flash_attn_ck.backends.triton import TritonBackend
    with fa.use_backend(backend or TritonBackend(configs=configs, **VARIANTS.get(name, {}))):
        return _measure(name, b, h, h_k, s, d, causal, warm_only)


def _measure(name, b, h, h_k, s, d, causal, warm_only):
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, s, h_k, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, s, h_k, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    timed = time_passes(make_runner(name, q, k, v, causal), (q, k, v), warm_only=warm_only)
    if warm_only:
        return timed
    return dict(timed, fwd_tflops=flops(b, h, s, d, causal, False) / timed["fwd_ms"] / 1e9,
                bwd_tflops=flops(b, h, s, d, causal, True) / timed["bwd_ms"] / 1e9)


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
    `step`, one forward + backward step and its peak extra memory. Each is run once first (compiles)."""
    device = leaves[0].device
    out = fwd()
    dout = torch.randn_like(out)
    bwd = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    step_fn = lambda: torch.autograd.grad(fwd(), leaves, dout)
    bwd()
    if step:
        step_fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if warm_only:
        return dict(warm_only=True)
    timed = dict(bwd_peak_mib=peak_extra_mib(bwd, device))
    if step:
        timed["step_peak_mib"] = peak_extra_mib(step_fn, device)
    with torch.no_grad():
        timed["fwd_ms"] = time_ms(fwd, device)
    timed["bwd_ms"] = time_ms(bwd, device)
    if step:
        timed["step_ms"] = time_ms(step_fn, device)
    return timed


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
    write(stem, meta, results, peers, json_too=bool(args.merge))


def selected_shapes(args) -> list[tuple[int, ...]]:
    """The rows to time: --shapes, else the grid; then --dims and --shard."""
    shapes = [tuple(int(x) for x in spec.split(":")) for spec in args.shapes.split(",")] if args.shapes \
        else grid(args.quick)
    if args.dims:
        shapes = [row for row in shapes if row[0] in {int(x) for x in args.dims.split(",")}]
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        shapes = shapes[i::n]
    return shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--peers", default="triton,sdpa_flash,sdpa_cudnn,sdpa_mem_eff,flex,fa4")
    ap.add_argument("--out", default="bench")
    ap.add_argument("--tag", default="")
    ap.add_argument("--shapes", default="", help="d:h:h_k:s:causal,... instead of the grid (causal 0/1)")
    ap.add_argument("--dims", default="", help="only these head dims of the grid, e.g. 64,128 (GQA rows are d128)")
    ap.add_argument("--shard", default="", help="i/n: every n-th row of the grid from row i (for --warm-only)")
    ap.add_argument("--tuned", default="", help="JSON of scripts/triton_tune.py: backward tiles per head dim")
    ap.add_argument("--replot", default="", help="redraw the PNG and markdown of an earlier JSON and exit")
    ap.add_argument("--merge", default="", help="A.json,B.json,...: one JSON/markdown/PNG of several runs' rows")
    ap.add_argument("--warm-only", action="store_true", help="compile and run each case once, time nothing")
    args = ap.parse_args()
    if args.replot or args.merge:
        rewrite(args)
        return
    names = args.peers.split(",")
    versions = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    if fa4 := fa4_version(names):
        versions["flash_attn_4"] = fa4
    tuned = json.loads(Path(args.tuned).read_text()) if args.tuned and Path(args.tuned).exists() else {}
    shapes = selected_shapes(args)
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), **versions,
                python=platform.python_version(), quick=args.quick, dtype="bf16", tuned_tiles=tuned)
    stem = Path(args.out) / f"{_stem(meta)}{args.tag}"
    results = []
    for d, h, h_k, s, causal in shapes:
        causal = bool(causal)
        b = 16384 // s
        row = dict(d=d, h=h, h_k=h_k, s=s, b=b, causal=causal, peers={})
        for name in names:
            if name == "sdpa_mem_eff" and h != h_k:
                continue
            try:
                row["peers"][name] = measure(name, b, h, h_k, s, d, causal, configs=tuned_configs(tuned, d, causal),
                                             warm_only=args.warm_only)
            except Exception as e:
                row["peers"][name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            torch.cuda.empty_cache()
        cells = " ".join(f"{n}={r['bwd_tflops']:.0f}" if "bwd_tflops" in r
                         else f"{n}={'warm' if 'warm_only' in r else 'ERR'}" for n, r in row["peers"].items())
        print(f"d{d} h{h}/{h_k} s{s} {'causal' if causal else 'full'}: bwd TF/s {cells}", flush=True)
        if not args.warm_only:
            results.append(row)
            stem.parent.mkdir(parents=True, exist_ok=True)   # saved per row: a cut-off run keeps its rows
            stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    if results:
        write(stem, meta, results, names, json_too=False)
        print(markdown(meta, results, names))


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
    import dataclasses

    from flash_attn_ck.backends.triton.config import SM90, Tile
    w = tuned[str(d)]
    return dataclasses.replace(SM90[(d, causal)], bwd_kv=Tile(*w["bwd_kv"]), bwd_dq=Tile(*w["bwd_dq"]))


def markdown(meta, results, names) -> str:
    def cell(r, key, fmt="{:.0f}"):
        return fmt.format(r[key]) if key in r else "-"
    head = ["d", "h/h_k", "s", "causal"] + [f"bwd {n}" for n in names] \
        + ["ours / FA2", "ours / cuDNN", "ours / Flex", "ours / FA4"] \
        + [f"fwd {n}" for n in names] + [f"MiB {n}" for n in names]
    lines = [f"# Attention forward/backward, {meta['gpu']}, {meta['date']}",
             "", f"torch {meta['torch']} (CUDA {meta['cuda']}), triton {meta['triton']}"
             + (f", flash-attn-4 {meta['flash_attn_4']}" if "flash_attn_4" in meta else "") + ", bf16; TFLOP/s "
             "(docs/semantics.md §FLOPs, median of do_bench); MiB = peak extra memory of one backward.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results:
        p = row["peers"]
        ours = p.get("triton", {}).get("bwd_tflops")

        def ratio(peer):
            other = p.get(peer, {}).get("bwd_tflops")
            return f"{ours / other:.2f}" if ours and other else "-"
        cells = [str(row["d"]), f"{row['h']}/{row['h_k']}", str(row["s"]), "yes" if row["causal"] else "no"]
        cells += [cell(p.get(n, {}), "bwd_tflops") for n in names]
        cells += [ratio("sdpa_flash"), ratio("sdpa_cudnn"), ratio("flex"), ratio("fa4")]
        cells += [cell(p.get(n, {}), "fwd_tflops") for n in names]
        cells += [cell(p.get(n, {}), "bwd_peak_mib") for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results, names, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return
    panels = sorted({(r["d"], r["h"], r["h_k"], r["causal"]) for r in results})
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(4 * cols, 3 * math.ceil(len(panels) / cols)),
                             squeeze=False)
    for ax, key in zip(axes.flat, panels):
        rows = [r for r in results if (r["d"], r["h"], r["h_k"], r["causal"]) == key]
        for n in names:
            pts = [(r["s"], r["peers"][n]["bwd_tflops"]) for r in rows if "bwd_tflops" in r["peers"].get(n, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d{key[0]} h{key[1]}/{key[2]} {'causal' if key[3] else 'full'}", fontsize=9)
        ax.set_ylabel("bwd TFLOP/s")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
