"""One forward + backward step of the shapes training jobs run: ours beside FA4 and cuDNN, in one process.

Families (bf16, causal):
- packed: documents packed into one varlen call (`cu_seqlens`), lengths drawn from a seeded long-tailed
  (log-normal) distribution, median a few hundred tokens, longest up to 8k; 32k and 64k tokens in all,
  d128 MHA 16 heads and GQA 32/8;
- window: sliding windows (causal local, left 1024 and 4096) at s8k-16k, GQA 32/8;
- long: one sequence of 32k-128k tokens;
- short: s512 and s1024 (16k tokens a batch), d64 / d128 / GQA 32/8, causal and not (the backward is the
  column to read against cuDNN);
- deterministic: d128 s8192, ours with `deterministic=True` against FA4's deterministic mode.

Useful work only: FLOPs are counted per sequence over the (query, key) pairs the mask keeps (forward
4·d·h·pairs, backward 2.5x, a step 3.5x: docs/semantics.md's count, whose causal s²/2 is the large-s limit of
the exact s(s+1)/2 used here). Per row and peer: step, forward and backward TFLOP/s, peak extra memory of one step
(beyond inputs and dout, MiB), ratios of ours to FA4 and cuDNN. Timing and peers are scripts/bench_bwd.py's.
FA4 (`flash_attn.cute.interface`) is skipped with a note where it does not import; cuDNN (torch SDPA) runs only
dense, unwindowed, non-deterministic rows.

    python scripts/bench_workloads.py [--families packed,window,...] [--peers fa4,sdpa_cudnn] [--out bench]
Writes bench/<gpu>-<date>-workloads.{json,md,png} (scripts/bench_store.py keeps the current one). Without CUDA it
runs the reference backend at tiny sizes
(`--tiny` is implied) with the peers skipped: that checks the bookkeeping, not speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import platform
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bwd import (
    PEER_TITLES,
    _stem,
    fa4_version,
    guarded,
    leaf,
    make_runner,
    not_measured,
    number,
    ratios,
    time_passes,
)

FAMILIES = ("packed", "window", "long", "short", "deterministic")
PASSES = {"fwd": 1.0, "bwd": 2.5, "step": 3.5}       # FLOPs of a pass, in forwards
DOCUMENT_SIGMA = 1.5     # log-normal spread of document lengths: mean about 3x the median, a long tail


@dataclass(frozen=True)
class Workload:
    family: str
    name: str
    head_dim: int
    heads: int
    kv_heads: int
    lengths: tuple[int, ...]       # one per sequence (packed: per document)
    packed: bool                   # one varlen call over cu_seqlens; else a (len(lengths), s) batch of equal lengths
    causal: bool = True
    window: int | None = None      # left window: query i attends keys i - window .. i; None: unbounded
    deterministic: bool = False

    @property
    def pairs(self) -> int:
        return sum(attended_pairs(n, n, self.causal, self.window) for n in self.lengths)

    def flops(self, kind: str) -> float:
        return PASSES[kind] * 4.0 * self.head_dim * self.heads * self.pairs


@dataclass(frozen=True)
class Sizes:
    """The sizes of every family; FULL is the benchmark, TINY the CPU run of the same code."""
    packed_tokens: tuple[int, ...]
    median_document: int
    longest_document: int
    mha_heads: int
    gqa_heads: tuple[int, int]
    head_dim: int
    windows: tuple[tuple[int, int, int], ...]         # (left window, s, batch)
    long: tuple[tuple[int, int, int], ...]            # (s, heads, kv heads)
    short_seqlens: tuple[int, ...]
    short_tokens: int
    short_shapes: tuple[tuple[int, int, int], ...]    # (d, heads, kv heads)
    deterministic_seqlen: int
    deterministic_batch: int


FULL = Sizes(packed_tokens=(32768, 65536), median_document=300, longest_document=8192, mha_heads=16,
             gqa_heads=(32, 8), head_dim=128,
             windows=((1024, 8192, 2), (4096, 8192, 2), (1024, 16384, 1), (4096, 16384, 1)),
             long=((32768, 16, 16), (65536, 32, 8), (131072, 32, 8)), short_seqlens=(512, 1024), short_tokens=16384,
             short_shapes=((64, 32, 32), (128, 16, 16), (128, 32, 8)), deterministic_seqlen=8192,
             deterministic_batch=2)
TINY = Sizes(packed_tokens=(64, 128), median_document=6, longest_document=32, mha_heads=2, gqa_heads=(4, 2),
             head_dim=32, windows=((16, 64, 2), (8, 96, 1)), long=((128, 2, 2), (160, 4, 2)), short_seqlens=(32,),
             short_tokens=64, short_shapes=((16, 4, 4), (32, 4, 2)), deterministic_seqlen=48, deterministic_batch=2)


def attended_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: int | None) -> int:
    """(query, key) pairs the bottom-right-aligned mask keeps: query i attends keys
    [i + s_k - s_q - window, i + s_k - s_q] under causal (right unbounded otherwise), clipped to [0, s_k)."""
    if not causal and window is None:
        return seqlen_q * seqlen_k
    shift = seqlen_k - seqlen_q
    total = 0
    for i in range(seqlen_q):
        last = seqlen_k - 1 if not causal else min(seqlen_k - 1, i + shift)
        first = 0 if window is None else max(0, i + shift - window)
        total += max(0, last - first + 1)
    return total


def document_lengths(total_tokens: int, median: int, longest: int, seed: int) -> tuple[int, ...]:
    """Lengths of documents packed into `total_tokens`, in draw order: log-normal with this median (spread
    DOCUMENT_SIGMA), each rounded and clipped to [1, longest]; the last is cut to make the sum exact."""
    rng = random.Random(seed)
    lengths, left = [], total_tokens
    while left > 0:
        drawn = round(rng.lognormvariate(math.log(median), DOCUMENT_SIGMA))
        lengths.append(min(max(drawn, 1), longest, left))
        left -= lengths[-1]
    return tuple(lengths)


def workloads(sizes: Sizes, seed: int = 0) -> list[Workload]:
    rows = []
    d, (gqa_h, gqa_kv) = sizes.head_dim, sizes.gqa_heads
    mha_gqa = [(sizes.mha_heads, sizes.mha_heads), (gqa_h, gqa_kv)]
    for tokens in sizes.packed_tokens:
        docs = document_lengths(tokens, sizes.median_document, sizes.longest_document, seed + tokens)
        for h, h_k in mha_gqa:
            rows.append(Workload("packed", f"packed {_tokens(tokens)} tokens, {len(docs)} docs (longest {max(docs)}), "
                                 f"{_heads(h, h_k)}", d, h, h_k, docs, packed=True))
    for window, s, b in sizes.windows:
        rows.append(Workload("window", f"window {window}, s{s} b{b}, {_heads(gqa_h, gqa_kv)}", d, gqa_h, gqa_kv,
                             (s,) * b, packed=False, window=window))
    for s, h, h_k in sizes.long:
        rows.append(Workload("long", f"one {_tokens(s)} sequence, {_heads(h, h_k)}", d, h, h_k, (s,), packed=False))
    for s in sizes.short_seqlens:
        b = max(1, sizes.short_tokens // s)
        for short_d, h, h_k in sizes.short_shapes:
            for causal in (False, True):
                rows.append(Workload("short", f"s{s} b{b} d{short_d} {_heads(h, h_k)}{' causal' if causal else ''}",
                                     short_d, h, h_k, (s,) * b, packed=False, causal=causal))
    s, b = sizes.deterministic_seqlen, sizes.deterministic_batch
    for h, h_k in mha_gqa:
        rows.append(Workload("deterministic", f"deterministic s{s} b{b}, {_heads(h, h_k)}", d, h, h_k, (s,) * b,
                             packed=False, deterministic=True))
    return rows


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _heads(h: int, h_k: int) -> str:
    return f"MHA {h} heads" if h == h_k else f"GQA {h}/{h_k}"


def inputs(w: Workload, device: torch.device, seed: int = 0):
    """(q, k, v) leaves and the runner's varlen argument (None for a dense batch)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = (sum(w.lengths),) if w.packed else (len(w.lengths), w.lengths[0])
    q, k, v = (leaf((*rows, heads, w.head_dim), gen, device) for heads in (w.heads, w.kv_heads, w.kv_heads))
    if not w.packed:
        return (q, k, v), None
    cu = torch.tensor([0, *itertools.accumulate(w.lengths)], dtype=torch.int32, device=device)
    return (q, k, v), (cu, max(w.lengths))


def measure(w: Workload, peer: str, device: torch.device) -> dict:
    """One peer on one workload: times (ms), TFLOP/s and peak extra MiB, or `skipped`/`error` with the reason."""
    if device.type != "cuda" and peer != "reference":
        return dict(skipped="needs CUDA")
    leaves, varlen = inputs(w, device)

    def timing():
        fwd = make_runner(peer, *leaves, w.causal, window=w.window, deterministic=w.deterministic, varlen=varlen)
        return time_passes(fwd, leaves, step=True)
    timed = guarded(timing, device)
    if "step_ms" not in timed:
        return timed
    return dict(timed, **{f"{kind}_tflops": w.flops(kind) / timed[f"{kind}_ms"] / 1e9 for kind in PASSES})


def run(args) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    ours = args.ours or ("triton" if cuda else "reference")
    peers = [p for p in args.peers.split(",") if p and p != ours]
    versions, unavailable = dict(torch=torch.__version__), {}
    if cuda and "fa4" in peers:     # kept as a column whose rows say why it is empty
        if fa4 := fa4_version(list(peers)):
            versions["flash_attn_4"] = fa4
        else:
            unavailable["fa4"] = "flash_attn.cute does not import here"
    sizes = TINY if args.tiny or not cuda else FULL
    families = args.families.split(",")
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name() if cuda else "cpu",
                **versions, python=platform.python_version(), dtype="bf16", ours=ours, peers=[ours, *peers],
                sizes="tiny" if sizes is TINY else "full", seed=args.seed)
    stem = Path(args.out) / f"{_stem(meta)}-workloads{args.tag}"
    results = []
    for w in workloads(sizes, args.seed):
        if w.family not in families:
            continue
        measured = {peer: dict(skipped=unavailable[peer]) if peer in unavailable else measure(w, peer, device)
                    for peer in (ours, *peers)}
        row = dict(dataclasses.asdict(w), pairs=w.pairs, peers=measured, ratios=ratios(measured, ours, PASSES))
        results.append(row)
        cells = " ".join(f"{p}={r['step_tflops']:.0f}" if "step_tflops" in r else f"{p}=-"
                         for p, r in measured.items())
        print(f"{w.name}: step TF/s {cells}", flush=True)
        stem.parent.mkdir(parents=True, exist_ok=True)    # saved per row: a cut-off run keeps its rows
        stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    report = dict(meta=meta, results=results)
    write(stem, report)
    return report


def write(stem: Path, report: dict) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(markdown(report))
    plot(report, stem.with_suffix(".png"))


def markdown(report: dict) -> str:
    meta, results = report["meta"], report["results"]
    everyone, peers = meta["peers"], [p for p in meta["peers"] if p != meta["ours"]]
    titles = {p: PEER_TITLES.get(p, p) for p in meta["peers"]}
    head = ["family", "workload"] + [f"step {titles[p]}" for p in meta["peers"]] \
        + [f"step ours / {titles[p]}" for p in peers] + [f"fwd {titles[p]}" for p in meta["peers"]] \
        + [f"bwd {titles[p]}" for p in meta["peers"]] + [f"bwd ours / {titles[p]}" for p in peers] \
        + [f"MiB {titles[p]}" for p in meta["peers"]]
    lines = [f"# Training-shaped attention steps, {meta['gpu']}, {meta['date']}", "",
             f"torch {meta['torch']}" + (f", flash-attn-4 {meta['flash_attn_4']}" if "flash_attn_4" in meta else "")
             + f", bf16, {meta['sizes']} sizes, seed {meta['seed']}. TFLOP/s of useful work: FLOPs counted per "
             "sequence over the attended (query, key) pairs (forward 4·d·h·pairs, backward 2.5x, step 3.5x); "
             "step = one forward + backward; MiB = peak extra memory of one step (beyond inputs and dout).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results:
        p, rat = row["peers"], row["ratios"]
        cells = [row["family"], row["name"]] + [number(p[x].get("step_tflops")) for x in everyone] \
            + [number(rat.get(f"step_{x}"), "{:.2f}") for x in peers] \
            + [number(p[x].get("fwd_tflops")) for x in everyone] + [number(p[x].get("bwd_tflops")) for x in everyone] \
            + [number(rat.get(f"bwd_{x}"), "{:.2f}") for x in peers] \
            + [number(p[x].get("step_peak_mib")) for x in everyone]
        lines.append("| " + " | ".join(cells) + " |")
    lines += not_measured([(row["name"], row["peers"]) for row in results], titles)
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return
    meta, results = report["meta"], report["results"]
    if not results:
        return
    fig, axes = plt.subplots(1, 2, figsize=(16, 0.35 * len(results) * len(meta["peers"]) + 1.5), sharey=True)
    bar = 0.8 / len(meta["peers"])
    for ax, kind in zip(axes, ("step", "bwd")):
        for i, peer in enumerate(meta["peers"]):
            ys = [n - 0.4 + (i + 0.5) * bar for n in range(len(results))]
            xs = [r["peers"][peer].get(f"{kind}_tflops") or 0 for r in results]
            ax.barh(ys, xs, height=bar, label=PEER_TITLES.get(peer, peer))
        ax.set_xlabel(f"{kind} TFLOP/s (useful work)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(results)), [r["name"] for r in results], fontsize=7)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{meta['gpu']} {meta['date']}: forward + backward step and backward", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"some of {','.join(FAMILIES)}")
    ap.add_argument("--ours", default="", help="our runner (bench_bwd.py name): triton with CUDA, else reference")
    ap.add_argument("--peers", default="fa4,sdpa_cudnn", help="bench_bwd.py peer names")
    ap.add_argument("--out", default="bench")
    ap.add_argument("--tag", default="")
    ap.add_argument("--seed", type=int, default=0, help="seed of the document lengths")
    ap.add_argument("--tiny", action="store_true", help="the CPU sizes (implied without CUDA)")
    ap.add_argument("--merge", default="", help="A.json,B.json,...: one JSON/markdown/PNG of several runs' rows")
    args = ap.parse_args(argv)
    if unknown := set(args.families.split(",")) - set(FAMILIES):
        ap.error(f"--families: unknown {sorted(unknown)}; expected some of {FAMILIES}")
    if args.merge:
        runs = [json.loads(Path(x).read_text()) for x in args.merge.split(",")]
        meta = dict(runs[0]["meta"], merged_from=[Path(x).name for x in args.merge.split(",")])
        report = dict(meta=meta, results=[r for run_ in runs for r in run_["results"]])
        write(Path(args.out) / f"{_stem(meta)}-workloads{args.tag}", report)
    else:
        report = run(args)
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
