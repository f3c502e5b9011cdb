"""Context parallelism on CUDA GPUs: correctness, then forward+backward timing. NOT RUN YET:
written and reviewed on CPU only; it needs a session with device time on `nvidia-h200-x2`.

    # correctness (bf16, vs the same sequence on one GPU, and torch's context_parallel() with the provider)
    torchrun --standalone --nproc_per_node=2 scripts/cp_bench.py --check
    # benchmark: causal bf16 h 32/8 d 128, s = 32k, 64k, 128k total; ring and all-gather side by side
    torchrun --standalone --nproc_per_node=2 scripts/cp_bench.py --seqlens 32768 65536 131072 \
        --json $OUT/cp-h200x2.json

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

import torch
import torch.distributed as dist

from flash_attn_ck import flash_attn_func
from flash_attn_ck.integrations.context_parallel import context_parallel_attn, shard


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


def check(args, device):
    """bf16 results of both exchanges vs one GPU on the full sequence (ratio of errors vs fp32 math), and
    torch's own context_parallel() on top of the SDPA provider."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = inputs(8192, 32, 8, 128, device)
    full = fwd_bwd(lambda *t: flash_attn_func(*t, causal=True), q, k, v, dout)()
    local = [shard(t) for t in (q, k, v, dout)]
    for exchange in ("ring", "allgather"):
        ours = fwd_bwd(lambda *t, e=exchange: context_parallel_attn(*t, causal=True, kv_exchange=e), *local)()
        errors = [(o.float() - shard(f).float()).abs().max().item() for o, f in zip(ours, full, strict=True)]
        print(f"rank {rank} {exchange}: max |cp - 1 GPU| out/dq/dk/dv = {errors}", flush=True)
    # torch's machinery: SDPA under context_parallel() with FLASH_ATTN_CK active (b, h, s, d buffers).
    import torch.nn.attention as attention
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel, context_parallel_unshard

    import flash_attn_ck.integrations.sdpa  # noqa: F401  (registers FLASH_ATTN_CK)
    attention.activate_flash_attention_impl("FLASH_ATTN_CK")
    mesh = init_device_mesh("cuda", (world,))
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
        expected = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        with context_parallel(mesh, buffers=[qb, kb, vb], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        (out,) = context_parallel_unshard(mesh, [out], [2])
    print(f"rank {rank} torch context_parallel + FLASH_ATTN_CK: max |cp - 1 GPU| = "
          f"{(out.float() - expected.float()).abs().max().item():.3e}", flush=True)
    attention.restore_flash_attention_impl()


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
        local = [shard(t) for t in (q, k, v, dout)]
        del q, k, v, dout
        for exchange in ("ring", "allgather"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ms = timed(fwd_bwd(lambda *t, e=exchange: context_parallel_attn(*t, causal=True, kv_exchange=e), *local))
            mem = torch.cuda.max_memory_allocated() / 2 ** 30
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
        (check if args.check else bench)(args, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
