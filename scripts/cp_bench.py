"""Context parallelism on CUDA GPUs: correctness, then forward+backward scaling against one GPU (its runs:
bench/nvidia-h200.md §Context parallelism).

    # correctness (bf16): every exchange and torch's context_parallel() with our handlers, against fp32 SDPA, each
    # within 2x of one GPU's error on the same sequence; exits non-zero on a failure
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 scripts/cp_bench.py --check
    # scaling: causal bf16 h 32/8 d 128, s = 32k, 64k, 128k total; ring, all-gather and a2a side by side
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 scripts/cp_bench.py --seqlens 32768 65536 131072 \
        --json bench/cp-h200x2.json

Leave NVLink multicast off (NCCL_NVLS_ENABLE=0, as the device notes say). Rank 0 prints one row per
(s, kv_exchange): ms per fwd+bwd on W GPUs, the 1-GPU time of the whole sequence where it fits (measured
on rank 0 alone while the others wait), the speed-up, and peak memory per GPU. With --json it also writes
the scaling table (.md) and plot (.png) beside the JSON; `python3 scripts/cp_bench.py --report X.json`
redraws them from an earlier run (no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flash_attn_ck import flash_attn_func
from flash_attn_ck.integrations.context_parallel import KV_EXCHANGES, context_parallel_attn, shard


def inputs(seq, heads, heads_k, dim, device, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    q = torch.randn(1, seq, heads, dim, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, seq, heads_k, dim, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    return q, k, v, torch.randn_like(q)


def timed(fn, iters=5, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def fwd_bwd(attn, q, k, v, dout):
    def step():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, dout))
    return step


def sdpa_bshd(q, k, v, **kwargs):
    """F.scaled_dot_product_attention on (b, s, h, d) tensors; GQA inputs need enable_gqa."""
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), enable_gqa=k.shape[2] != q.shape[2],
                                          **kwargs).transpose(1, 2)


def exchanges(world: int) -> dict[str, object]:
    """Each kv_exchange this world size runs -> the group it takes: the default process group, or for "a2a+ring"
    its 2-D mesh (2 ring groups x world/2 a2a ranks; even world sizes only)."""
    from torch.distributed.device_mesh import init_device_mesh
    groups = {e: None for e in KV_EXCHANGES if e != "a2a+ring"}
    if world % 2 == 0:
        groups["a2a+ring"] = init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("ring", "a2a"))
    return groups


def max_errors(results, reference) -> list[float]:
    return [(r.float() - e.float()).abs().max().item() for r, e in zip(results, reference, strict=True)]


def _fmt(errors) -> str:
    return " ".join(f"{e:.2e}" for e in errors)


def check(args, device) -> bool:
    """Every exchange (bf16, causal, GQA 32/8) and torch's context_parallel() with `install_torch_cp_handlers`:
    out/dq/dk/dv within 2x of one GPU's error (our kernels, the whole sequence) against fp32 SDPA."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = inputs(8192, 32, 8, 128, device)
    reference = fwd_bwd(lambda *t: sdpa_bshd(*t, is_causal=True), *(t.float() for t in (q, k, v, dout)))()
    single = max_errors(fwd_bwd(lambda *t: flash_attn_func(*t, causal=True), q, k, v, dout)(), reference)
    passed = True
    rows = {}
    for exchange, group in exchanges(world).items():
        local = [shard(t, group) for t in (q, k, v, dout)]
        ours = fwd_bwd(lambda *t, e=exchange, g=group: context_parallel_attn(*t, g, causal=True, kv_exchange=e),
                       *local)()
        rows[exchange] = max_errors(ours, [shard(t, group) for t in reference])
    # torch's machinery: SDPA under context_parallel() on (b, h, s, d) buffers, our ring through the handlers.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from flash_attn_ck.integrations.torch_cp import install_torch_cp_handlers
    mesh = init_device_mesh("cuda", (world,))
    buffers = [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)]
    with install_torch_cp_handlers(), context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]), \
            torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        # context_parallel() shards the buffers in place (head-tail order: our zigzag shards)
        sharded = [t.detach().requires_grad_() for t in buffers[:3]]
        out = F.scaled_dot_product_attention(*sharded, is_causal=True, enable_gqa=True)
        grads = torch.autograd.grad(out, sharded, buffers[3])
    rows["torch context_parallel"] = max_errors([t.transpose(1, 2) for t in (out, *grads)], reference)
    for name, errors in rows.items():
        ok = all(e <= 2 * s + 1e-6 for e, s in zip(errors, single, strict=True))
        passed &= ok
        print(f"rank {rank} {name:>24}: max error out/dq/dk/dv {_fmt(errors)} vs one GPU {_fmt(single)}: "
              f"{'ok' if ok else 'FAILED (over 2x)'}", flush=True)
    return passed


def bench(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for seq in args.seqlens:
        q, k, v, dout = inputs(seq, args.heads, args.heads_k, args.head_dim, device)
        single = None
        if rank == 0:
            try:
                torch.cuda.reset_peak_memory_stats()
                single = timed(fwd_bwd(lambda *t: flash_attn_func(*t, causal=True), q, k, v, dout))
                single_mem = torch.cuda.max_memory_allocated() / 2 ** 30
            except torch.OutOfMemoryError:
                single, single_mem = None, None
        dist.barrier()
        groups = exchanges(world)
        shards = {e: [shard(t, g) for t in (q, k, v, dout)] for e, g in groups.items()}
        del q, k, v, dout
        for exchange, group in groups.items():
            local = shards[exchange]
            others = sum(t.nbytes for e, ts in shards.items() if e != exchange for t in ts)   # not this run's
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ms = timed(fwd_bwd(lambda *t, e=exchange, g=group: context_parallel_attn(*t, g, causal=True,
                                                                                     kv_exchange=e), *local))
            mem = (torch.cuda.max_memory_allocated() - others) / 2 ** 30
            if rank == 0:
                row = dict(seqlen=seq, world=world, kv_exchange=exchange, ms=ms, peak_gib=mem, single_ms=single,
                           single_peak_gib=single_mem, speedup=single / ms if single else None)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        report(rows, args.json)


def scaling_table(rows) -> str:
    """Markdown: per (s, exchange) the time on W GPUs against one GPU, the speed-up, and memory per GPU."""
    lines = ["| s | exchange | GPUs | ms fwd+bwd | ms on 1 GPU | speed-up | GiB per GPU | GiB on 1 GPU "
             "| memory / 1 GPU |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        single = r["single_ms"]
        mem_ratio = r["peak_gib"] / r["single_peak_gib"] if r["single_peak_gib"] else None
        lines.append(f"| {r['seqlen']} | {r['kv_exchange']} | {r['world']} | {r['ms']:.2f} | "
                     + (f"{single:.2f} | {single / r['ms']:.2f}x" if single else "does not fit | -")
                     + f" | {r['peak_gib']:.2f} | "
                     + (f"{r['single_peak_gib']:.2f} | {mem_ratio:.2f}" if mem_ratio else "- | -") + " |")
    return "\n".join(lines) + "\n"


def report(rows, json_path: str) -> None:
    """The scaling table and a plot of the speed-up per sequence length and exchange, beside `json_path`."""
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as f:
        f.write(scaling_table(rows))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for exchange in sorted({r["kv_exchange"] for r in rows}):
        points = [(r["seqlen"], r["single_ms"] / r["ms"]) for r in rows
                  if r["kv_exchange"] == exchange and r["single_ms"]]
        if points:
            ax.plot(*zip(*points), marker="o", label=exchange)
    world = rows[0]["world"] if rows else 1
    ax.axhline(world, color="gray", linestyle="--", label=f"ideal ({world} GPUs)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (total)")
    ax.set_ylabel("speed-up over 1 GPU (fwd+bwd)")
    ax.set_title("context parallelism, causal bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=90)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-k", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json")
    parser.add_argument("--report", metavar="JSON", help="write the table and plot of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            report(json.load(f), args.report)
        return
    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    try:
        passed = check(args, device) if args.check else bench(args, device) or True
    finally:
        dist.destroy_process_group()
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
