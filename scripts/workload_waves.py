"""Where the warp-specialised kernels spend an H200 on the training-shaped workloads: a model, not a measurement.

Built on scripts/wave_schedule.py's list scheduling (CTAs start in grid order on the SM that frees first, one
CTA per SM): a CTA runs for its steps (tiles it walks, times query heads) at the dense kernels' measured rate
per SM, and a CTA that has no work (a varlen tile past its sequence) costs `exit_us`. Per workload of
scripts/bench_workloads.py (full sizes, seed 0; the short rows at d128, as if bwd_ws ran them) it prints:
- forward and backward makespans of today's grids (`batch x tiles(max_seqlen)` per head, the backward in
  launches of kv-head groups under config.BWD_WS_DQ_ACCUM_BYTES, each after a zero fill of dq_accum and before
  a cast) against grids over varlen_schedule's (sequence, tile) items, longest first, heads fastest;
- what removing the per-launch zero fill and cast saves, and what one launch over every head would save;
- the share of steps that pay for the mask (edge tiles), for windows and causal;
- deterministic causal: today's order (key tiles start ascending and add into each dQ tile in ascending
  order) against the causal direction (descending, FA3/FA4), by an event model of the semaphore waits.

    python scripts/workload_waves.py [--exit-us 1.0] [--json out.json]
    python scripts/workload_waves.py --measure-exit      (on a GPU: what an exiting CTA costs, from empty sequences)
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_workloads import FULL, Workload, workloads
from wave_schedule import makespan

from flash_attn_ck.backends.triton import config
from flash_attn_ck.backends.triton.runtime.varlen_schedule import TileWalk, item_steps, schedule_bound, schedule_model

MiB = 2 ** 20


@dataclass(frozen=True)
class Costs:
    """µs on one H200 SM. A d128 backward step (64 query rows x 128 keys, one query head) is 10.5 MFLOP: at the
    dense 528 TF/s over 132 SMs, 2.62 µs; a forward step (128 x 128) is 8.4 MFLOP: at 617 TF/s, 1.80 µs
    (docs/triton.md). A backward CTA also pays `bwd_cta_us` (K/V loads, pipeline fill, dK/dV
    stores): 6 µs makes the model's dense causal d128 s8192 backward 476 TF/s against 475 measured (its s2048 is
    then 410 against 370: short CTAs cost more still, so the packed rows are upper bounds). The zero fill and
    the cast are the profile's (notes/profiles-2026-12-01.md: 0.91 ms for four 128 MiB fills, 0.20 ms for four
    casts; the fills run at 0.6 TB/s, the casts at 2.7). `exit_us` is a guess until --measure-exit runs."""
    bwd_step_us: float = 2.62
    fwd_step_us: float = 1.80
    bwd_cta_us: float = 6.0
    exit_us: float = 1.0
    zero_us_per_mib: float = 910 / 4 / 128
    cast_us_per_mib: float = 200 / 4 / 128
    fused_zero_us_per_mib: float = 1 / 3.0      # zeros written by a pass that runs anyway, at 3 TB/s
    sms: int = 132


def walks(w: Workload) -> tuple[TileWalk, TileWalk]:
    """(forward, backward) walks of the default warp-specialised tiles for d128."""
    fwd, bwd = config.FWD_WS_SM90[128][w.causal], config.BWD_WS_SM90[128]
    left, right = (-1 if w.window is None else w.window), (0 if w.causal else -1)
    return (TileWalk(fwd.block_m, fwd.block_n, False, left, right),
            TileWalk(bwd.block_n, bwd.block_m, True, left, right))


def grid_order(lengths, walk: TileWalk, per_item: float, fixed: float, heads: int, costs: Costs,
               tile_axis_first: bool, reverse_tiles: bool) -> list[float]:
    """CTA durations of today's grid: (tiles(max), batch, heads) with the tile axis fastest, or (heads, batch,
    tiles) with heads fastest (the key-major / longest-first grid); past a sequence a CTA exits."""
    tiles = -(-max(lengths) // walk.own_block)
    order = [tiles - 1 - x if reverse_tiles else x for x in range(tiles)]

    def cta(b, t):
        n = lengths[b]
        return fixed + per_item * item_steps(n, n, t, walk) if t * walk.own_block < n else costs.exit_us
    if tile_axis_first:
        return [cta(b, t) for _ in range(heads) for b in range(len(lengths)) for t in order]
    return [cta(b, t) for t in order for b in range(len(lengths)) for _ in range(heads)]


def scheduled(lengths, walk: TileWalk, per_item: float, fixed: float, heads: int, costs: Costs) -> list[float]:
    """CTA durations over varlen_schedule's items, heads fastest; the padding past the real items exits."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    rows = schedule_model(cu, cu, walk, schedule_bound(cu[-1], len(lengths), walk.own_block))
    return [fixed + per_item * item_steps(lengths[b], lengths[b], t, walk) if b >= 0 else costs.exit_us
            for b, t in rows for _ in range(heads)]


def masked_share(w: Workload, walk: TileWalk) -> float:
    """Share of the forward's (query tile, key tile) steps that need the mask (gluon_common.Mask.tile_needs_mask)."""
    masked = total = 0
    left, right = walk.left, walk.right
    for n in set(w.lengths):
        count = w.lengths.count(n)
        for m in range(-(-n // walk.own_block)):
            m0 = m * walk.own_block
            lo = 0 if left < 0 else max(0, m0 - left)
            hi = n - 1 if right < 0 else min(n - 1, m0 + walk.own_block - 1 + right)
            for t in range(lo // walk.walk_block, hi // walk.walk_block + 1):
                n0 = t * walk.walk_block
                partial = n0 + walk.walk_block > n
                partial |= left >= 0 and n0 < m0 + walk.own_block - 1 - left
                partial |= right >= 0 and n0 + walk.walk_block - 1 > m0 + right
                masked += count * partial
                total += count
    return masked / total


def model(w: Workload, costs: Costs) -> dict:
    fwd_walk, bwd_walk = walks(w)
    lengths, group = list(w.lengths), w.heads // w.kv_heads
    fwd_tile = config.FWD_WS_SM90[128][w.causal]
    fwd_now = makespan(grid_order(lengths, fwd_walk, costs.fwd_step_us, 0.0, w.heads, costs,
                                  not fwd_tile.query_major, reverse_tiles=True), costs.sms)
    fwd_new = makespan(scheduled(lengths, fwd_walk, costs.fwd_step_us, 0.0, w.heads, costs), costs.sms)
    rows = sum(lengths)
    per_kv_head = rows * group * 128 * 4
    kv_per_launch = max(1, min(w.kv_heads, config.BWD_WS_DQ_ACCUM_BYTES // per_kv_head))
    launches = -(-w.kv_heads // kv_per_launch)
    key_major = config.bwd_ws_tile(128, w.causal, group, w.deterministic).key_major
    per_cta = costs.bwd_step_us * group
    fixed = costs.bwd_cta_us
    bwd_now = launches * makespan(grid_order(lengths, bwd_walk, per_cta, fixed, kv_per_launch, costs, not key_major,
                                             reverse_tiles=False), costs.sms)
    bwd_new = launches * makespan(scheduled(lengths, bwd_walk, per_cta, fixed, kv_per_launch, costs), costs.sms)
    bwd_one = makespan(scheduled(lengths, bwd_walk, per_cta, fixed, w.kv_heads, costs), costs.sms)
    accum_mib, all_mib = kv_per_launch * per_kv_head / MiB, w.kv_heads * per_kv_head / MiB
    zero, cast = launches * accum_mib * costs.zero_us_per_mib, launches * accum_mib * costs.cast_us_per_mib
    fused_zero = launches * accum_mib * costs.fused_zero_us_per_mib
    steps = dict(now=fwd_now + bwd_now + zero + cast, scheduled=fwd_new + bwd_new + zero + cast,
                 fused_zero=fwd_new + bwd_new + cast + fused_zero,
                 one_launch=fwd_new + bwd_one + cast + all_mib * costs.fused_zero_us_per_mib)
    useful = w.flops("step") / 1e6     # MFLOP; MFLOP / µs = TF/s
    return dict(workload=w.name, family=w.family, launches=launches, dq_accum_mib=accum_mib, one_launch_mib=all_mib,
                fwd_ctas=len(grid_order(lengths, fwd_walk, 1, 0, w.heads, costs, True, True)),
                fwd_items=sum(-(-n // fwd_walk.own_block) for n in lengths) * w.heads,
                fwd_now_ms=fwd_now / 1e3, fwd_scheduled_ms=fwd_new / 1e3, bwd_now_ms=bwd_now / 1e3,
                bwd_scheduled_ms=bwd_new / 1e3, bwd_one_launch_ms=bwd_one / 1e3, zero_ms=zero / 1e3, cast_ms=cast / 1e3,
                **{f"step_{k}_ms": v / 1e3 for k, v in steps.items()},
                **{f"step_{k}_tflops": useful / v for k, v in steps.items()},
                masked_share=masked_share(w, fwd_walk) if w.causal or w.window is not None else 0.0)


def deterministic_makespan(key_tiles: int, query_tiles_per_key: int, heads: int, sms: int, descending: bool,
                           heads_fastest: bool, add_steps: float) -> float:
    """Causal deterministic backward of one batch x heads of equal sequences, in steps: CTAs (key tile n of a
    head) start in grid order on the SM that frees first, (heads, tiles) with heads or tiles fastest, and walk
    their query tiles upward (m = n * r .. end, r query tiles per key tile). The dQ add of (n, m) waits for the
    previous key tile in the add order (n - 1 ascending, n + 1 descending, launched in that order too) to have
    added into m, then takes `add_steps` (the bulk add and its completion wait); one dQ buffer, so a step's
    hand-off waits for the previous add."""
    end = key_tiles * query_tiles_per_key
    tiles = range(key_tiles - 1, -1, -1) if descending else range(key_tiles)
    order = [(h, n) for n in tiles for h in range(heads)] if heads_fastest else \
        [(h, n) for h in range(heads) for n in tiles]
    free = [0.0] * sms
    added = {}                              # (head, n, m) -> time its add completed
    finish = 0.0
    for h, n in order:
        start = heapq.heappop(free)
        compute = add = start
        prev = n + 1 if descending else n - 1
        for m in range(n * query_tiles_per_key, end):
            compute = max(compute + 1.0, add)        # the hand-off of step m waits for the add of step m - 1
            wait = added.get((h, prev, m), 0.0) if 0 <= prev < key_tiles else 0.0
            add = max(compute, wait) + add_steps
            added[(h, n, m)] = add
        heapq.heappush(free, add)
        finish = max(finish, add)
    return finish


def measure_exit(empty: int = 512) -> None:
    """On a GPU: forward and backward of one 8k sequence (GQA 32/8, d128, causal) alone and with `empty` empty
    sequences after it; the difference over the extra CTAs, times the SMs, is what an exiting CTA costs."""
    import torch
    from bench_bwd import make_runner, time_passes
    s, h, h_k, d = 8192, 32, 8, 128
    leaves = [torch.randn(s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for heads in (h, h_k, h_k)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    times = {}
    for extra in (0, empty):
        cu = torch.tensor([0] + [s] * (1 + extra), dtype=torch.int32, device="cuda")
        times[extra] = time_passes(make_runner("triton", *leaves, True, varlen=(cu, s)), leaves)
    fwd_ctas = empty * (s // 128) * h
    bwd_ctas = empty * (s // 128) * h_k     # every launch together
    for kind, ctas in (("fwd", fwd_ctas), ("bwd", bwd_ctas)):
        extra_us = (times[empty][f"{kind}_ms"] - times[0][f"{kind}_ms"]) * 1e3
        print(f"{kind}: {times[0][f'{kind}_ms']:.3f} ms alone, {times[empty][f'{kind}_ms']:.3f} ms with {empty} empty "
              f"sequences: {extra_us * sms / ctas:.2f} µs per exiting CTA per SM")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--exit-us", type=float, default=Costs.exit_us, help="what a CTA that exits costs an SM (µs)")
    ap.add_argument("--json", default="")
    ap.add_argument("--measure-exit", action="store_true", help="on a GPU: measure --exit-us")
    args = ap.parse_args(argv)
    if args.measure_exit:
        measure_exit()
        return None
    costs = replace(Costs(), exit_us=args.exit_us)
    rows = [model(w, costs) for w in workloads(FULL)      # the model's tiles and step costs are d128's
            if w.family in ("packed", "window", "long") or (w.family == "short" and w.head_dim == 128)]
    print(f"exit {costs.exit_us} µs; ms per pass; TF/s of the modelled step: today / scheduled grids / and the zero "
          "fill fused / and one launch over every head")
    print("| workload | launches | fwd CTAs / items | fwd now | fwd scheduled | bwd now | bwd scheduled | "
          "bwd one launch (MiB) | zero + cast | masked steps | step TF/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tflops = " / ".join(f"{r[f'step_{k}_tflops']:.0f}" for k in ("now", "scheduled", "fused_zero", "one_launch"))
        print(f"| {r['workload']} | {r['launches']} | {r['fwd_ctas']} / {r['fwd_items']} | {r['fwd_now_ms']:.2f} | "
              f"{r['fwd_scheduled_ms']:.2f} | {r['bwd_now_ms']:.2f} | {r['bwd_scheduled_ms']:.2f} | "
              f"{r['bwd_one_launch_ms']:.2f} ({r['one_launch_mib']:.0f}) | {r['zero_ms']:.2f} + {r['cast_ms']:.2f} | "
              f"{r['masked_share']:.0%} | {tflops} |")
    s, b, h = FULL.deterministic_seqlen, FULL.deterministic_batch, FULL.mha_heads
    tile = config.BWD_WS_SM90[128]
    tiles, per_key = s // tile.block_n, tile.block_n // tile.block_m
    ideal = sum(tiles * per_key - n * per_key for n in range(tiles)) * b * h / costs.sms
    det = {}
    print(f"\ndeterministic causal s{s} b{b} h{h}: modelled makespan in steps (ideal {ideal:.0f}), per add time")
    print("| add (steps) | ascending, tiles fastest (today, MHA) | ascending, heads fastest (today, GQA) | "
          "descending, tiles fastest | descending, heads fastest |")
    print("|---|---|---|---|---|")
    for add in (0.1, 0.5, 1.0, 1.5):
        cells = []
        for descending in (False, True):
            for heads_fastest in (False, True):
                span = deterministic_makespan(tiles, per_key, b * h, costs.sms, descending, heads_fastest, add)
                det[f"add{add}-{'desc' if descending else 'asc'}-{'heads' if heads_fastest else 'tiles'}"] = span
                cells.append(f"{span:.0f} ({ideal / span:.2f})")
        print(f"| {add} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(costs=costs.__dict__, rows=rows, deterministic=det), indent=1))
    return rows, det


if __name__ == "__main__":
    main()
