"""The varlen schedule on the GPU: TritonBackend(varlen_schedule=True) against the grid over every (batch, tile) on
packed documents (scripts/bench_workloads.py's packed family: its document generator, FLOP count and timing), the
same packs under sliding windows, and a deterministic pack (docs/workloads.md §Packed documents).

Per workload: the largest difference of each output between the two grids (out, lse, dq, dk, dv from the same
inputs; the backward of both from the grid's out and lse: out, lse, dk, dv are expected bit-identical, dq too in the
deterministic mode, else within atomic-add rounding), the kernels each backend runs, and forward, backward and step
times of both (bench_bwd.time_passes: each pass run once first, which also compiles the schedule builder for the
bound's power of two; then the median of triton.testing.do_bench) with TFLOP/s of useful work and scheduled / grid.
One table row per workload; the JSON is rewritten after each row (a cut-off run keeps its rows).

    PYTHONPATH=$PWD python scripts/lab/varlen_schedule_check.py --out $OUT/sched.json [--only packed,window,det]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_workloads as bw

import flash_attn_ck as fa
from flash_attn_ck.backends.triton import TritonBackend
from flash_attn_ck.core.inputs import describe_call
from flash_attn_ck.core.options import AttentionOptions

GRIDS = {"grid": False, "schedule": True}     # name -> TritonBackend(varlen_schedule=...)


def check_workloads(seed: int) -> list[bw.Workload]:
    """bench_workloads' packed rows (32k and 64k tokens, MHA 16 and GQA 32/8, causal), the 32k and 64k packs under
    causal windows of 1024 and 4096 (GQA 32/8, MHA 16), and the 32k pack deterministic (MHA 16: the schedule runs its
    backward; GQA 32/8 with a window of 1024: its backward keeps the grid)."""
    packed = [w for w in bw.workloads(bw.FULL, seed) if w.family == "packed"]
    by_name = {(len(w.lengths), w.heads): w for w in packed}
    small, large = sorted({len(w.lengths) for w in packed})
    rows = [dataclasses.replace(w, family="packed") for w in packed]
    for docs, heads, window in ((small, 32, 1024), (small, 16, 1024), (large, 32, 4096)):
        w = by_name[(docs, heads)]
        rows.append(dataclasses.replace(w, family="window", name=f"{w.name}, window {window}", window=window))
    for docs, heads, window in ((small, 16, None), (small, 32, 1024)):
        w = by_name[(docs, heads)]
        name = f"{w.name}{f', window {window}' if window else ''}, deterministic"
        rows.append(dataclasses.replace(w, family="det", name=name, window=window, deterministic=True))
    return rows


def call_options(w: bw.Workload, cu: torch.Tensor, longest: int) -> dict:
    window_size = (-1, -1) if w.window is None else (w.window, 0 if w.causal else -1)
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=w.causal,
                window_size=window_size, deterministic=w.deterministic)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in fp32, equal entries (+inf lse of a row without keys included) counting 0."""
    diff = (a.float() - b.float()).abs()
    return float(torch.where(a == b, torch.zeros_like(diff), diff).max()) if a.numel() else 0.0


def compare(w: bw.Workload, device: torch.device) -> dict:
    """Both grids on the same inputs: max |scheduled - grid| per output, and the kernels each runs."""
    leaves, (cu, longest) = bw.inputs(w, device)
    q, k, v = (t.detach() for t in leaves)
    options = call_options(w, cu, longest)
    dout = torch.randn_like(q)
    backends = {name: TritonBackend(varlen_schedule=flag) for name, flag in GRIDS.items()}
    problem = describe_call(q, k, v, AttentionOptions(**options))
    kernels = {name: dict(forward=b.forward_kernel(problem), backward=b.backward_plan(problem).kernel)
               for name, b in backends.items()}
    fwd = {name: fa.flash_attn_fwd(q, k, v, **options, backend=b)[:2] for name, b in backends.items()}
    out, lse = fwd["grid"]
    bwd = {name: fa.flash_attn_bwd(dout, q, k, v, out, lse, **options, backend=b)[:3] for name, b in backends.items()}
    torch.cuda.synchronize()
    outputs = dict(zip(("out", "lse"), zip(fwd["schedule"], fwd["grid"])))
    outputs.update(zip(("dq", "dk", "dv"), zip(bwd["schedule"], bwd["grid"])))
    diffs = {name: max_diff(a, b) for name, (a, b) in outputs.items()}
    identical = {name: bool(torch.equal(a, b)) for name, (a, b) in outputs.items()}
    del fwd, bwd, outputs, out, lse
    torch.cuda.empty_cache()
    return dict(max_abs_diff=diffs, bit_identical=identical, kernels=kernels)


def timings(w: bw.Workload, device: torch.device) -> dict:
    """bench_workloads.measure of the "triton" runner under each grid's backend: ms, TFLOP/s, peak MiB."""
    result = {}
    for name, flag in GRIDS.items():
        with fa.use_backend(TritonBackend(varlen_schedule=flag)):
            result[name] = bw.measure(w, "triton", device)
    return result


def row_text(w: bw.Workload, row: dict) -> str:
    t = row["timings"]
    cells = []
    for kind in bw.PASSES:
        grid, sched = t["grid"].get(f"{kind}_tflops"), t["schedule"].get(f"{kind}_tflops")
        cells.append(f"{grid:.0f} -> {sched:.0f} ({sched / grid:.3f}x)" if grid and sched else "-")
    diffs = " ".join(f"{k}={v:.2g}" for k, v in row["max_abs_diff"].items())
    errors = "; ".join(f"{name}: {r.get('error') or r.get('skipped')}" for name, r in t.items()
                       if "error" in r or "skipped" in r)
    kernels = row["kernels"]["schedule"]
    used = "+".join(role for role in ("forward", "backward") if "varlen schedule" in kernels[role]) or "none"
    text = f"| {w.family} | {w.name} | {used} | " + " | ".join(cells) + f" | {diffs} |"
    return text + (f" {errors}" if errors else "")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--only", default="packed,window,det", help="families of the rows: packed, window, det")
    ap.add_argument("--seed", type=int, default=0, help="seed of the document lengths (bench_workloads)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (the warp-specialised kernels are sm_90)")
    device = torch.device("cuda")
    import triton
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, seed=args.seed, dtype="bf16", head_dim=bw.FULL.head_dim,
                passes_flops=bw.PASSES)
    families = args.only.split(",")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    print("TFLOP/s of useful work (bench_workloads' count), grid -> scheduled (scheduled / grid); max |scheduled - "
          "grid| per output", flush=True)
    print("| family | workload | scheduled passes | fwd | bwd | step | max abs diff |", flush=True)
    print("|---|---|---|---|---|---|---|", flush=True)
    start = time.time()
    for w in check_workloads(args.seed):
        if w.family not in families:
            continue
        row = dict(dataclasses.asdict(w), documents=len(w.lengths), longest=max(w.lengths), pairs=w.pairs)
        row.update(compare(w, device))
        row["timings"] = timings(w, device)
        row["ratio"] = {kind: row["timings"]["schedule"][f"{kind}_tflops"] / row["timings"]["grid"][f"{kind}_tflops"]
                        for kind in bw.PASSES if f"{kind}_tflops" in row["timings"]["schedule"]
                        and f"{kind}_tflops" in row["timings"]["grid"]}
        row["seconds"] = round(time.time() - start, 1)
        rows.append(row)
        print(row_text(w, row), flush=True)
        out.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    print(f"wrote {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
