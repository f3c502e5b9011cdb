"""Host cost per call of flash_attn_ck beside FA2 (torch SDPA flash), SDPA cuDNN and FA4, in one process.

Two tables (bench/nvidia-h200.md §Host path records them):

1. Host µs per call, eager, for three calls — forward without grad, forward recording autograd,
   forward + backward (`torch.autograd.grad`) — at b1 s128 h16 d128 and b2 s512 h16 d64, causal and not,
   dense and varlen (equal lengths packed, so the work matches the dense row). Host time per call = wall
   time of `--calls` back-to-back calls without a sync, over the calls (median of `--repeats`); "wall" adds
   the final sync. Where wall/host stays near 1 the GPU waited on the host, so host is the call's cost;
   where wall is much larger the GPU was the bottleneck and the row says so (`gpu_bound`).
   `--gaps`: torch.profiler over the same calls, GPU busy µs per call and the idle gaps between kernels.
2. Throughput of the short rows, where host cost shows: forward and backward TFLOP/s end to end
   (back-to-back calls, synced at the end) at s512/1024/2048, d64/128/256, causal and not, b = tokens / s,
   h = hidden / d (docs/semantics.md §FLOPs: 16384 and 2048), FLOPs = 4 b h s^2 d (halved when causal), x2.5 backward.
   With `--gaps` also the kernels' own TFLOP/s (profiler), which says whether a row is host-bound.

Peers are skipped with a note where they cannot run (no CUDA: everything but ours on the reference
backend; FA4 not importable; a peer refusing a row). Writes bench/<gpu>-<date>-host-cost{tag}.{json,md,png}
(scripts/bench_store.py keeps the current one).

    python scripts/host_cost.py [--calls 200] [--repeats 5] [--gaps] [--no-throughput] [--tag -before]
    python scripts/host_cost.py --device cpu --calls 20 --tokens 128 --hidden 64 --seqs 32 --dims 16   # on the CPU
    python scripts/host_cost.py --replot bench/X.json                              # redraw md/png from JSON
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_attn_ck as fa

PEERS = ("ours", "sdpa_flash", "sdpa_cudnn", "fa4")
LABELS = dict(ours="ours", sdpa_flash="FA2", sdpa_cudnn="cuDNN", fa4="FA4")
CALLS = ("fwd_nograd", "fwd_grad", "fwd_bwd")
CALL_LABELS = dict(fwd_nograd="forward, no grad", fwd_grad="forward recording autograd",
                   fwd_bwd="forward + backward")
HOST_SHAPES = "1:128:16:128,2:512:16:64"        # b:s:h:d
# On the CPU the reference backend's arithmetic would dominate those shapes: tiny ones keep the rows host-bound.
CPU_HOST_SHAPES = "1:16:2:16,2:32:2:8"
# wall / host above this: the GPU, not the host, set the pace of the back-to-back calls.
GPU_BOUND_RATIO = 1.25


def flops(b: int, h: int, s: int, d: int, causal: bool, backward: bool) -> float:
    """docs/semantics.md §FLOPs: forward 4 b h s_q s_k d, halved when causal; backward 2.5 x forward."""
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return 2.5 * f if backward else f


# ---- runners: a forward callable per implementation, and the context it runs in --------------------

class Skip(Exception):
    """This implementation cannot run this row here (the message says why)."""


def fa4_module():
    try:
        from flash_attn.cute import interface
    except Exception as error:      # not installed, or its import fails on this machine
        raise Skip(f"FA4 not importable ({type(error).__name__}: {error})") from None
    return interface


def make_runner(name: str, q, k, v, causal: bool, varlen: dict | None, backend: str | None):
    """(context, fwd): `fwd()` -> the output tensor; the loop runs inside `context` (SDPA's backend
    choice is set once around the loop, not per call, so it is not counted as the peer's host cost)."""
    device_type = q.device.type
    if name == "ours":
        if varlen:
            return contextlib.nullcontext(), lambda: fa.flash_attn_varlen_func(
                q, k, v, varlen["cu"], varlen["cu"], varlen["max"], varlen["max"], causal=causal, backend=backend)
        return contextlib.nullcontext(), lambda: fa.flash_attn_func(q, k, v, causal=causal, backend=backend)
    if device_type != "cuda":
        raise Skip("needs CUDA")
    if name == "fa4":
        interface = fa4_module()
        if varlen:
            def run():
                o = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=varlen["cu"], cu_seqlens_k=varlen["cu"],
                                                     max_seqlen_q=varlen["max"], max_seqlen_k=varlen["max"],
                                                     causal=causal)
                return o[0] if isinstance(o, tuple) else o
        else:
            def run():
                o = interface.flash_attn_func(q, k, v, causal=causal)
                return o[0] if isinstance(o, tuple) else o
        return contextlib.nullcontext(), run
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kind = dict(sdpa_flash=SDPBackend.FLASH_ATTENTION, sdpa_cudnn=SDPBackend.CUDNN_ATTENTION)[name]
    if varlen:
        # SDPA has no varlen signature; its nested-tensor path calls these ops on the packed (total, h, d)
        # buffers with cumulative offsets, and so do we (without the nested-tensor wrapping).
        cu, longest = varlen["cu"], varlen["max"]
        if name == "sdpa_flash":
            return contextlib.nullcontext(), lambda: torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, longest, longest, 0.0, causal, False)[0]
        return contextlib.nullcontext(), lambda: torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, longest, longest, True, 0.0, causal, False)[0]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return sdpa_kernel(kind), lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


def inputs(b: int, s: int, h: int, d: int, varlen: bool, device: torch.device, dtype: torch.dtype):
    """Leaves q, k, v requiring grad ((b, s, h, d), or varlen (b s, h, d)), and the varlen offsets."""
    gen = torch.Generator(device="cpu").manual_seed(b * 7919 + s * 31 + d)
    shape = (b * s, h, d) if varlen else (b, s, h, d)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dtype).requires_grad_()
               for _ in range(3))
    offsets = dict(cu=torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device), max=s) if varlen else None
    return q, k, v, offsets


def call_of(kind: str, fwd, q, k, v, dout):
    if kind == "fwd_nograd":
        def call():
            with torch.no_grad():
                fwd()
    elif kind == "fwd_grad":
        call = fwd
    else:
        def call():
            torch.autograd.grad(fwd(), (q, k, v), dout)
    return call


# ---- timing ----------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SLOW_CALL_S = 0.2      # a measurement's budget of back-to-back calls, for peers slower than the rest


def host_and_wall_us(call, calls: int, repeats: int, device: torch.device,
                     summary=statistics.median) -> tuple[float, float]:
    """(host, wall) µs per call over `calls` back-to-back calls, `summary` (median) of `repeats`: host stops the clock
    when the last call returns, wall after the device has finished them too. A call slower than
    SLOW_CALL_S (cuDNN's varlen op builds its graph on every call) is timed over fewer calls."""
    call()
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    calls = max(3, min(calls, int(SLOW_CALL_S / max(time.perf_counter() - start, 1e-9))))
    hosts, walls = [], []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        issued = time.perf_counter()
        synchronize(device)
        done = time.perf_counter()
        hosts.append((issued - start) / calls * 1e6)
        walls.append((done - start) / calls * 1e6)
    return summary(hosts), summary(walls)


def kernel_gaps(call, calls: int, device: torch.device) -> dict | None:
    """GPU busy µs per call (kernels and copies, overlaps merged) and idle µs per call between the first
    and the last kernel, from torch.profiler. None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    call()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        synchronize(device)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return dict(busy_us=0.0, idle_us=0.0, kernels=0.0)
    busy, (lo, hi) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > hi:
            busy += hi - lo
            lo, hi = start, end
        else:
            hi = max(hi, end)
    busy += hi - lo
    whole = spans[-1][1] - spans[0][0]
    return dict(busy_us=busy / calls, idle_us=(whole - busy) / calls, kernels=len(spans) / calls)


# ---- the two tables --------------------------------------------------------------------------------

def host_rows(args, device, dtype, backend) -> list[dict]:
    rows = []
    for b, s, h, d in args.host_shapes:
        for causal in (False, True):
            for varlen in (False, True):
                q, k, v, offsets = inputs(b, s, h, d, varlen, device, dtype)
                for kind in CALLS:
                    row = dict(call=kind, b=b, s=s, h=h, d=d, causal=causal, layout="varlen" if varlen else "dense",
                               peers={})
                    for name in args.peers:
                        row["peers"][name] = measure_host(name, kind, q, k, v, causal, offsets, backend, args)
                    rows.append(row)
                    print(host_line(row), flush=True)
    return rows


def measure_host(name, kind, q, k, v, causal, offsets, backend, args) -> dict:
    try:
        context, fwd = make_runner(name, q, k, v, causal, offsets, backend)
        with context:
            dout = torch.randn_like(fwd().detach())
            call = call_of(kind, fwd, q, k, v, dout)
            host, wall = host_and_wall_us(call, args.calls, args.repeats, q.device)
            cell = dict(host_us=host, wall_us=wall, gpu_bound=wall > GPU_BOUND_RATIO * host)
            gaps = kernel_gaps(call, args.calls, q.device) if args.gaps else None
            if gaps:
                cell.update(gaps)
        return cell
    except Skip as why:
        return dict(skipped=str(why))
    except Exception as error:      # a peer refusing a row is a result, not the end of the run
        return dict(error=f"{type(error).__name__}: {str(error)[:200]}")


def throughput_rows(args, device, dtype, backend) -> list[dict]:
    rows = []
    for d in args.dims:
        for s in args.seqs:
            for causal in (False, True):
                b, h = max(1, args.tokens // s), max(1, args.hidden // d)
                q, k, v, _ = inputs(b, s, h, d, False, device, dtype)
                row = dict(b=b, s=s, h=h, d=d, causal=causal, peers={})
                for name in args.throughput_peers:
                    row["peers"][name] = measure_throughput(name, q, k, v, causal, backend, args)
                rows.append(row)
                print(throughput_line(row), flush=True)
                del q, k, v
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def measure_throughput(name, q, k, v, causal, backend, args) -> dict:
    b, s, h, d = q.shape
    calls = max(1, args.calls // 10)
    try:
        context, fwd = make_runner(name, q, k, v, causal, None, backend)
        with context:
            out = fwd()
            dout = torch.randn_like(out.detach())
            cell = {}
            for direction, call in (("fwd", call_of("fwd_nograd", fwd, q, k, v, dout)),
                                    ("bwd", lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))):
                _, wall = host_and_wall_us(call, calls, args.repeats, q.device)
                work = flops(b, h, s, d, causal, direction == "bwd")
                cell[f"{direction}_ms"] = wall / 1e3
                cell[f"{direction}_tflops"] = work / (wall * 1e-6) / 1e12
                gaps = kernel_gaps(call, calls, q.device) if args.gaps else None
                if gaps and gaps["busy_us"] > 0:
                    cell[f"{direction}_kernel_tflops"] = work / (gaps["busy_us"] * 1e-6) / 1e12
        return cell
    except Skip as why:
        return dict(skipped=str(why))
    except Exception as error:
        return dict(error=f"{type(error).__name__}: {str(error)[:200]}")


# ---- layers: host µs of each layer of the package, outermost first --------------------------------

def null_backend(name: str):
    """On the CPU: backend `name`'s host code with no arithmetic (the reference's kernels do nothing; the
    Triton backend builds every launch and issues none), installed for `name` by `fa.use_backend`."""
    from flash_attn_ck.backends.reference import ReferenceBackend
    if name == "reference":
        class NullReference(ReferenceBackend):
            def forward(self, *args):
                pass

            def backward(self, *args):
                pass
        return NullReference()
    from flash_attn_ck.backends.triton import TritonBackend
    from flash_attn_ck.backends.triton.runtime import launch

    class HostOnlyTriton(TritonBackend):
        device_types = frozenset({"cpu"})

        @classmethod
        def unavailable_reason(cls):
            return None

        def forward(self, *args):
            with _no_launches(launch):
                super().forward(*args)

        def backward(self, *args):
            with _no_launches(launch):
                super().backward(*args)
    return HostOnlyTriton()


@contextlib.contextmanager
def _no_launches(launch):
    from flash_attn_ck.backends.triton import backend as triton_backend
    saved = launch.LaunchSpec.launch, triton_backend._prepare_launch
    launch.LaunchSpec.launch = lambda self: None
    triton_backend._prepare_launch = lambda: None
    try:
        yield
    finally:
        launch.LaunchSpec.launch, triton_backend._prepare_launch = saved


def layer_rows(args, device, dtype, backend: str | None) -> list[dict]:
    """Host µs per call of each layer, forward then backward, at the first host shape, causal: the API, the
    autograd Function, the torch.library op, the pipeline, its stages, the backend (launches included on a
    GPU; on the CPU `null_backend`'s host code only)."""
    from flash_attn_ck import ops
    from flash_attn_ck.backends.registry import backend_instance
    from flash_attn_ck.core.inputs import describe_call, kernel_params
    from flash_attn_ck.core.options import AttentionOptions
    from flash_attn_ck.pipeline.backward import attention_backward
    from flash_attn_ck.pipeline.chunking import plan_chunks, workspace_cap
    from flash_attn_ck.pipeline.forward import attention_forward
    from flash_attn_ck.pipeline.prepare import prepare
    from flash_attn_ck.pipeline.select import select_backend
    b, s, h, d = args.host_shapes[0]
    name = backend or "triton"
    if name == "triton":
        dtype = torch.float16 if dtype == torch.float32 else dtype      # the Triton backend's dtypes
    installed = null_backend(name) if device.type == "cpu" else backend_instance(name)
    # On the CPU the stand-in is passed itself (its class, not the registered one, says it runs on the CPU).
    request = installed if device.type == "cpu" else name
    rows = []
    with fa.use_backend(installed):
        for varlen in (False, True):
            q, k, v, offsets = inputs(b, s, h, d, varlen, device, dtype)
            extra = dict(cu_seqlens_q=offsets["cu"], cu_seqlens_k=offsets["cu"], max_seqlen_q=s,
                         max_seqlen_k=s) if varlen else {}
            options = AttentionOptions(causal=True, backend=request, **extra)
            with torch.no_grad():
                out, lse, _ = fa.flash_attn_fwd(q, k, v, causal=True, backend=request, **extra)
            dout = torch.randn_like(out)
            graph_out = ops.attention(q, k, v, options)[0]
            problem = describe_call(q, k, v, options)
            chosen = select_backend(problem, request)
            params = kernel_params(problem, q, k, v, options, None)
            lse_like = torch.empty_like(lse)
            out_like = torch.empty_like(out)
            cap = workspace_cap(None)
            plan = plan_chunks(problem, chosen, cap, params)
            workspace = dict(plan.per_chunk.allocate(device), softmax_d=torch.empty_like(lse))
            grads = [torch.empty_like(t) for t in (q, k, v)]
            flat = ops._flatten(options, ops._FWD)
            layers = {
                "fwd: flash_attn_func, no grad": (True, lambda: fa.flash_attn_varlen_func(
                    q, k, v, offsets["cu"], offsets["cu"], s, s, causal=True, backend=request) if varlen
                    else fa.flash_attn_func(q, k, v, causal=True, backend=request)),
                "fwd: AttentionOptions(...)": (True, lambda: AttentionOptions(causal=True, backend=request, **extra)),
                "fwd: ops.attention, no grad (no Function)": (True, lambda: ops.attention(q, k, v, options)),
                "fwd: ops.attention, recording (the Function)": (False, lambda: ops.attention(q, k, v, options)),
                "fwd: torch.ops.flash_attn_ck.fwd (dispatcher)": (True, lambda: torch.ops.flash_attn_ck.fwd(
                    q, k, v, *flat)),
                "fwd: attention_forward (pipeline)": (True, lambda: attention_forward(q, k, v, options)),
                "fwd: describe_call (validation: a memo miss)": (True, lambda: describe_call(q, k, v, options)),
                "fwd: prepare (a memo hit: signature + value checks)": (True, lambda: prepare(q, k, v, options)),
                "fwd: select_backend": (True, lambda: select_backend(problem, request)),
                "fwd: backend.forward": (True, lambda: chosen.forward(problem, params, out_like, lse_like)),
                "fwd: flash_attn_func, recording autograd": (False, lambda: fa.flash_attn_func(
                    q, k, v, causal=True, backend=request) if not varlen else fa.flash_attn_varlen_func(
                    q, k, v, offsets["cu"], offsets["cu"], s, s, causal=True, backend=request)),
                "bwd: autograd.grad (Function backward)": (False, lambda: torch.autograd.grad(
                    graph_out, (q, k, v), dout, retain_graph=True)),
                "bwd: flash_attn_bwd (the op)": (True, lambda: fa.flash_attn_bwd(
                    dout, q, k, v, out, lse, causal=True, backend=request, **extra)),
                "bwd: attention_backward (pipeline, validating)": (True, lambda: attention_backward(
                    dout, q, k, v, out, lse, None, None, None, options, None)),
                "bwd: plan_chunks": (True, lambda: plan_chunks(problem, chosen, cap, params)),
                "bwd: backend.backward": (True, lambda: chosen.backward(problem, params, out, lse, dout, *grads,
                                                                        workspace)),
            }
            for layer, (no_grad, call) in layers.items():
                with torch.no_grad() if no_grad else contextlib.nullcontext():
                    # the fastest repeat: what the layer costs when nothing else holds the (shared) host
                    host, _ = host_and_wall_us(call, args.calls, args.repeats, device, summary=min)
                rows.append(dict(layer=layer, layout="varlen" if varlen else "dense", host_us=host))
                print(f"{layer:50s} {rows[-1]['layout']:6s} {host:8.1f} us", flush=True)
    return rows


# ---- report ----------------------------------------------------------------------------------------

def ratio(row: dict, key: str, ours: str, other: str) -> float | None:
    a, b = row["peers"].get(ours, {}).get(key), row["peers"].get(other, {}).get(key)
    return a / b if a is not None and b else None


def _num(value, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _tflops(value) -> str:
    """TFLOP/s: whole numbers, except the small ones of a CPU run."""
    return _num(value, "{:.0f}" if value is None or value >= 10 else "{:.2g}")


def _host_cell(cell: dict) -> str:
    if "host_us" not in cell:
        return "skipped" if "skipped" in cell else "error" if "error" in cell else "-"
    return f"{cell['host_us']:.0f}" + ("*" if cell.get("gpu_bound") else "")


def host_line(row: dict) -> str:
    cells = " ".join(f"{LABELS[n]}={_host_cell(c)}" for n, c in row["peers"].items())
    return (f"{row['call']:10s} b{row['b']} s{row['s']} h{row['h']} d{row['d']} "
            f"{'causal' if row['causal'] else 'full':6s} {row['layout']:6s}: host us {cells}")


def throughput_line(row: dict) -> str:
    cells = " ".join(f"{LABELS[n]}={_tflops(c.get('fwd_tflops'))}/{_tflops(c.get('bwd_tflops'))}"
                     for n, c in row["peers"].items())
    return f"d{row['d']} s{row['s']} {'causal' if row['causal'] else 'full'}: fwd/bwd TF/s {cells}"


def layer_table(meta: dict, layers: list[dict]) -> list[str]:
    if not layers:
        return []
    lines = [f"## Host µs per call of each layer (b:s:h:d {meta['layer_shape']}, causal; backend "
             f"{meta['layer_backend']}; fastest of the repeats)", "", "| layer | dense | varlen |", "|---|---|---|"]
    by_layer: dict[str, dict] = {}
    for r in layers:
        by_layer.setdefault(r["layer"], {})[r["layout"]] = r["host_us"]
    lines += [f"| {layer} | {_num(v.get('dense'), '{:.1f}')} | {_num(v.get('varlen'), '{:.1f}')} |"
              for layer, v in by_layer.items()]
    return [*lines, ""]


def markdown(meta: dict, host: list[dict], throughput: list[dict], layers: list[dict] = ()) -> str:
    notes = [f"- {LABELS[n]}: {why}" for n, why in meta.get("skipped", {}).items()]
    lines = [f"# Host cost per call, {meta['gpu']}, {meta['date']}", "",
             f"torch {meta['torch']}, triton {meta.get('triton', '-')}, {meta['dtype']}, device {meta['device']}, "
             f"ours on backend {meta['backend']!r}; {meta['calls']} back-to-back calls, median of "
             f"{meta['repeats']}. µs of host time per call; * = GPU-bound (wall > {GPU_BOUND_RATIO}x host: "
             "the GPU, not the host, set the pace of the calls).", "",
             *notes, *([""] if notes else []), *layer_table(meta, layers)]
    if host:
        lines += host_table(meta, host)
    if throughput:
        lines += throughput_table(meta, throughput)
    return "\n".join(lines) + "\n"


def host_table(meta: dict, host: list[dict]) -> list[str]:
    peers = meta["peers"]
    lines = ["## Host µs per call", ""]
    head = ["call", "b", "s", "h", "d", "causal", "layout", *(LABELS[n] for n in peers), "ours / FA2"]
    gaps = any("busy_us" in c for r in host for c in r["peers"].values())
    if gaps:
        head += ["ours GPU busy µs", "ours GPU idle µs", "FA2 GPU idle µs"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in host:
        cells = [CALL_LABELS[r["call"]], str(r["b"]), str(r["s"]), str(r["h"]), str(r["d"]),
                 "yes" if r["causal"] else "no", r["layout"], *(_host_cell(r["peers"].get(n, {})) for n in peers),
                 _num(ratio(r, "host_us", "ours", "sdpa_flash"), "{:.2f}")]
        if gaps:
            cells += [_num(r["peers"].get("ours", {}).get("busy_us")), _num(r["peers"].get("ours", {}).get("idle_us")),
                      _num(r["peers"].get("sdpa_flash", {}).get("idle_us"))]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def throughput_table(meta: dict, throughput: list[dict]) -> list[str]:
    tpeers = meta["throughput_peers"]
    lines = ["## Throughput of the short rows (TFLOP/s end to end; kernels alone with --gaps)", ""]
    head = ["d", "s", "b", "h", "causal", *(f"fwd {LABELS[n]}" for n in tpeers), "fwd ours / cuDNN",
            *(f"bwd {LABELS[n]}" for n in tpeers), "bwd ours / cuDNN"]
    kernels = any("fwd_kernel_tflops" in c for r in throughput for c in r["peers"].values())
    if kernels:
        head += ["fwd kernels ours / cuDNN", "bwd kernels ours / cuDNN"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in throughput:
        cells = [str(r["d"]), str(r["s"]), str(r["b"]), str(r["h"]), "yes" if r["causal"] else "no"]
        for direction in ("fwd", "bwd"):
            cells += [_tflops(r["peers"].get(n, {}).get(f"{direction}_tflops")) for n in tpeers]
            cells.append(_num(ratio(r, f"{direction}_tflops", "ours", "sdpa_cudnn"), "{:.2f}"))
        if kernels:
            cells += [_num(ratio(r, f"{x}_kernel_tflops", "ours", "sdpa_cudnn"), "{:.2f}") for x in ("fwd", "bwd")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(meta: dict, host: list[dict], throughput: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return
    panels = 1 + (1 if throughput else 0)
    fig, axes = plt.subplots(1, panels, figsize=(9 * panels, 5), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(1, len(meta["peers"]))
    for i, name in enumerate(meta["peers"]):
        values = [r["peers"].get(name, {}).get("host_us", math.nan) for r in host]
        ax.bar([x + i * width for x in range(len(host))], values, width, label=LABELS[name])
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(host))])
    ax.set_xticklabels([f"{r['call']} s{r['s']}d{r['d']}{' c' if r['causal'] else ''} {r['layout'][0]}" for r in host],
                       rotation=90, fontsize=6)
    ax.set_ylabel("host µs per call")
    ax.legend(fontsize=7)
    if throughput:
        ax = axes[0][1]
        for name in meta["throughput_peers"]:
            for direction, style in (("fwd", "--"), ("bwd", "-")):
                values = [r["peers"].get(name, {}).get(f"{direction}_tflops", math.nan) for r in throughput]
                ax.plot(range(len(throughput)), values, style, marker="o", label=f"{direction} {LABELS[name]}")
        ax.set_xticks(range(len(throughput)))
        ax.set_xticklabels([f"d{r['d']} s{r['s']}{' c' if r['causal'] else ''}" for r in throughput],
                           rotation=90, fontsize=6)
        ax.set_ylabel("TFLOP/s end to end")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(stem: Path, data: dict) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    stem.with_suffix(".md").write_text(markdown(data["meta"], data["host"], data["throughput"], data.get("layers", [])))
    if data["host"] or data["throughput"]:   # a layers-only run has nothing to draw
        plot(data["meta"], data["host"], data["throughput"], stem.with_suffix(".png"))


# ---- main ------------------------------------------------------------------------------------------

def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="ours: a backend name (default: automatic; 'reference' on cpu)")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--throughput-peers", default="ours,sdpa_cudnn,fa4")
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls per measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gaps", action="store_true", help="torch.profiler: GPU busy and idle µs per call")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--no-host", action="store_true", help="skip the host table (e.g. with --layers alone)")
    ap.add_argument("--layers", action="store_true",
                    help="host µs of each layer of ours (on the CPU: the backend's host code without arithmetic)")
    ap.add_argument("--host-shapes", default="", help=f"b:s:h:d,... (default {HOST_SHAPES}; cpu {CPU_HOST_SHAPES})")
    ap.add_argument("--seqs", default="512,1024,2048")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--tokens", type=int, default=16384, help="throughput rows: b = tokens / s")
    ap.add_argument("--hidden", type=int, default=2048, help="throughput rows: h = hidden / d")
    ap.add_argument("--out", default="bench")
    ap.add_argument("--tag", default="")
    ap.add_argument("--replot", default="", help="redraw the markdown and PNG of an earlier JSON and exit")
    args = ap.parse_args(argv)
    args.peers = [p for p in args.peers.split(",") if p]
    args.throughput_peers = [p for p in args.throughput_peers.split(",") if p]
    for name in args.peers + args.throughput_peers:
        if name not in PEERS:
            ap.error(f"unknown peer {name!r}: expected some of {', '.join(PEERS)}")
    shapes = args.host_shapes or (HOST_SHAPES if args.device.startswith("cuda") else CPU_HOST_SHAPES)
    args.host_shapes = [tuple(int(x) for x in spec.split(":")) for spec in shapes.split(",") if spec]
    args.seqs = [int(x) for x in args.seqs.split(",") if x]
    args.dims = [int(x) for x in args.dims.split(",") if x]
    return args


def main(argv=None) -> Path:
    args = parse(argv)
    if args.replot:
        path = Path(args.replot)
        write(path.with_suffix(""), json.loads(path.read_text()))
        return path.with_suffix("")
    device = torch.device(args.device)
    backend = args.backend or ("reference" if device.type == "cpu" else None)
    # bf16 as the benchmark grid; the reference backend on the CPU runs fp32 (what a CPU user would pass).
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)     # tiny tensors: intra-op threads would only add contention to the host path
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = dict(date=datetime.date.today().isoformat(), gpu=gpu, device=str(device), torch=torch.__version__,
                python=platform.python_version(), dtype=str(dtype).removeprefix("torch."), backend=backend or "auto",
                calls=args.calls, repeats=args.repeats, peers=args.peers, throughput_peers=args.throughput_peers,
                tokens=args.tokens, hidden=args.hidden, skipped={})
    with contextlib.suppress(ImportError):
        import triton
        meta["triton"] = triton.__version__
    if device.type != "cuda":
        meta["skipped"].update({n: "needs CUDA (this run is on the CPU)" for n in PEERS if n != "ours"})
    elif "fa4" in args.peers + args.throughput_peers:
        try:
            fa4_module()
        except Skip as why:
            meta["skipped"]["fa4"] = str(why)
    for name in meta["skipped"]:
        print(f"{LABELS[name]} skipped: {meta['skipped'][name]}")
    data = dict(meta=meta, host=[], throughput=[], layers=[])
    if args.layers:
        meta["layer_shape"] = ":".join(map(str, args.host_shapes[0]))
        name = args.backend or "triton"
        meta["layer_backend"] = f"{name}, host code only (no arithmetic, no launch)" if device.type == "cpu" else name
        data["layers"] = layer_rows(args, device, dtype, args.backend)
    if not args.no_host:
        data["host"] = host_rows(args, device, dtype, backend)
    if not args.no_throughput:
        data["throughput"] = throughput_rows(args, device, dtype, backend)
    stem = Path(args.out) / f"{gpu.replace(' ', '-').lower()}-{meta['date']}-host-cost{args.tag}"
    write(stem, data)
    print(markdown(meta, data["host"], data["throughput"], data["layers"]))
    return stem


if __name__ == "__main__":
    main()
