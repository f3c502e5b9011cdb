"""Launch configurations (tile shapes, warps, pipeline stages), keyed on the head-dim block, causal
and GQA. Chosen offline: nothing is autotuned on the call path.

Where the numbers come from:
- `SM90_*`: measured on one NVIDIA H200 (sm_90, torch 2.11.0+cu130, triton 3.6.0) by
  `scripts/triton_tune.py`, which times each candidate of `candidates()` on the grid of docs/semantics.md
  (bf16, s = 4096/8192) and keeps the fastest; the date is beside each table.
- `GENERIC_*`: for other CUDA GPUs, untuned; smaller tiles and two pipeline stages so that the
  shared memory of consumer and Ampere parts (about 100 KB per block) suffices.
- `INTERPRETER`: tiny tiles for TRITON_INTERPRET=1 on the CPU (correctness only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Tile:
    block_m: int        # query rows per step
    block_n: int        # key rows per step
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Configs:
    forward: Tile
    bwd_kv: Tile        # key-tile role: one program per key tile of block_n, walking query tiles of block_m
    bwd_dq: Tile        # query-tile role (dQ pass): one program per query tile of block_m, walking key tiles
    bwd_tma: str = "all"   # backward tiles through TMA descriptors where the tensors allow: "all" (loads
                           # and stores), "stores" (loads by pointers), "none" (pointers only)
    bwd_dp_first: bool = False   # issue dO V^T before exp2(S - lse) in both backward roles (see SM90)
    bwd_even_k: bool = True   # compile the backward's mask branch out when every key tile is full
                              # (EVEN_K, scores.block_needs_mask); the forward always does
    fwd_tma: bool = True   # forward tiles through TMA descriptors where the tensors allow

    def __post_init__(self):
        if self.bwd_tma not in ("all", "stores", "none"):
            raise ValueError(f"bwd_tma={self.bwd_tma!r}: expected 'all', 'stores' or 'none'")
        # Both backward roles run in one launch (bwd_main.attn_bwd_kernel): one num_warps, one num_stages.
        if (self.bwd_kv.num_warps, self.bwd_kv.num_stages) != (self.bwd_dq.num_warps, self.bwd_dq.num_stages):
            raise ValueError(f"bwd_kv {self.bwd_kv} and bwd_dq {self.bwd_dq} share one launch: "
                             "num_warps and num_stages must match")


@dataclass(frozen=True)
class WsTile:
    """Launch shape of the warp-specialised backward (bwd_ws.py): query rows per step, key rows per CTA,
    Q/dO ring stages, dQ hand-off buffers, warps of the MMA partition and register budgets of the 1-warp
    workers. `split_d`: the kernel whose two MMA warpgroups split the head dim (bwd_ws_split.py, head dims
    above 128): num_warps is then its first warpgroup's, and `mma_regs` the second's register budget.
    `max_registers`: registers per thread at launch (ptxas maxnreg), 0 for Triton's choice, which hands one CTA
    the whole register file; 128 with a 4-warp MMA partition (8 warps in all) lets two CTAs share an SM.
    `longest_first`: a key-major grid (bwd_ws_workers.cta_coords), which under a causal mask starts the longest
    key tiles of every head before any shorter one."""
    block_m: int
    block_n: int
    num_stages: int = 2
    dq_stages: int = 1
    num_warps: int = 8
    loader_regs: int = 24
    writer_regs: int = 24
    split_d: bool = False
    mma_regs: int = 240
    max_registers: int = 0
    longest_first: bool = False

    @classmethod
    def parse(cls, text: str) -> WsTile:
        """'BMxBN[xSTAGES[xDQ_STAGES[xWARPS[xMAX_REGISTERS[xLONGEST_FIRST]]]]]' (the flag 0 or 1), as the
        benchmark scripts take it."""
        names = ("block_m", "block_n", "num_stages", "dq_stages", "num_warps", "max_registers", "longest_first")
        values = list(map(int, text.split("x")))
        values[6:] = map(bool, values[6:])
        return cls(**dict(zip(names, values)))

    def __str__(self) -> str:
        text = f"{self.block_m}x{self.block_n}x{self.num_stages}x{self.dq_stages}"
        if (self.num_warps, self.max_registers, self.longest_first) != (8, 0, False):
            text += f"x{self.num_warps}x{self.max_registers}x{int(self.longest_first)}"
        return text


@dataclass(frozen=True)
class GluonRule:
    """Where a warp-specialised Gluon kernel runs (`TritonBackend.ws_reasons`, `fwd_ws_reasons`): the
    TritonBackend option that forces it (True) or turns it off (False), the head dims with tiles, where the
    default (None) runs it, the reasons given where it does not, and whether it needs a positive softmax scale."""
    option: str
    tiles: dict
    default_head_dims: frozenset
    min_seqlen: int
    slower_head_dim: str    # why a head dim with tiles but outside default_head_dims keeps the other kernel
    shorter: str            # why sequences shorter than min_seqlen do
    positive_scale: bool = False
    pads_head_dim: bool = False   # tiles are keyed by the power of two the head dim is padded to in shared memory

    def tile_key(self, head_dim: int) -> int:
        """The key of `tiles` that serves `head_dim` (absent: no tile)."""
        return head_block(head_dim) if self.pads_head_dim else head_dim


def head_block(head_dim: int) -> int:
    """The power-of-two register block that holds a (padded) head dim; columns past it are masked.
    At least 32: the smallest block the tile tables hold (d = 8 and 16 run in it, masked)."""
    block = 32
    while block < head_dim:
        block *= 2
    return block


# ---- sm_90 (H200), measured 2026-11-29 (see the module docstring) ----------------------------
# key: (head block, causal) -> Configs; GQA uses the MHA row (the program shape does not change).
# Row: (bwd_kv, bwd_dq, bwd_tma, bwd_dp_first, bwd_even_k).
# Backward tiles: winners of scripts/triton_tune.py on the H200 (bf16, s = 8192, non-causal). d64 and
# d256 from the first search (pointer loads; d64 356, d256 240 TF/s). d128 from the second search, after
# tile loads moved to TMA descriptors (tiles.py): key tile unchanged, dQ pass (128, 64, 8, 3), 392 TF/s
# in the dQ-pass mode. d256 keeps pointer loads in the backward: with TMA loads its best tiles reached
# 233 TF/s against 239 (docs/triton.md §Measured and dropped). The d32 row reuses d64's.
# dp_first (d256 only): writing dO V^T before the exp2 in both roles measured 258 vs 249 TF/s at d256
# s16384, 271 vs 266 at s8192, 253 vs 247 at s4096 causal (three alternating rounds, identical each
# round); at d128 it lost (causal s8192 355 vs 368), so the other rows keep the source order.
# bwd_even_k (2026-11-30, full grid with all peers): dropping the per-tile mask branch of non-causal calls
# whose key tiles are all full gave d64 non-causal 365-387 vs 351-370 TF/s, d128 395-430 vs 387-415, GQA
# 32/8 380/428 vs 366/420, but d256 192-197 vs 260-269 (s >= 2048), so the d256 row keeps the branch.
# Forward tiles: not searched (FlexAttention's H100 defaults, as a starting point).
_BWD_SM90 = {
    32: (Tile(32, 128, 4, 3), Tile(128, 64, 4, 3), "all", False, True),
    64: (Tile(32, 128, 4, 3), Tile(128, 64, 4, 3), "all", False, True),
    128: (Tile(64, 128, 8, 3), Tile(128, 64, 8, 3), "all", False, True),
    256: (Tile(64, 64, 8, 1), Tile(128, 64, 8, 1), "stores", True, False),
}
_FWD_SM90 = {32: Tile(128, 64, 4, 3), 64: Tile(128, 64, 4, 3), 128: Tile(128, 64, 8, 3), 256: Tile(64, 64, 4, 2)}
SM90 = {(d, causal): Configs(_FWD_SM90[d], *_BWD_SM90[d]) for d in _BWD_SM90 for causal in (False, True)}

# Short sequences (longest query/key length <= SHORT_SEQLEN): the backward moves its tiles through masked
# pointers, no TMA descriptors. Measured 2026-11-29 on the H200 (GPU time of all backward kernels,
# `launch_overhead.py --kernels`, SM90 tiles, dQ pass): d128 s512 0.610 vs 0.750 ms (causal 0.476 vs
# 0.632), s1024 1.019 vs 1.137 (0.681 vs 0.831), s2048 1.841 vs 1.905 (1.108 vs 1.231); d64 s2048
# 1.975 vs 2.058; d256 s2048 2.718 vs 2.731. At s4096 the descriptors win (d128 3.472 vs 3.757 ms):
# making a descriptor costs each program a fixed latency that only long key/query walks amortise.
SHORT_SEQLEN = 2048
# The forward, likewise, up to FWD_SHORT_SEQLEN (bench_bwd.py, forward TF/s pointers vs descriptors,
# 2026-11-29): s512 d64 307 vs 207, d128 300 vs 225, d256 246 vs 216; s1024 d64 causal 263 vs 233,
# d256 291 vs 279, d128 355 vs 369 (causal 203 vs 185); at s2048 the descriptors mostly win (d256
# 340 vs 330, GQA 32/8 449 vs 411).
FWD_SHORT_SEQLEN = 1024
# Made once: select is on the call path.
SM90_SHORT = {key: replace(c, bwd_tma="none") for key, c in SM90.items()}
SM90_FWD_SHORT = {key: replace(c, fwd_tma=False) for key, c in SM90_SHORT.items()}

# ---- warp-specialised backward (bwd_ws.py) on sm_90, measured 2026-11-30 --------------------------
# scripts/bwd_ws_check.py on the H200 (bf16, b = 16384/s, h = 2048/d; TFLOP/s of the whole backward with
# its torch pre/post-processing, next to the one-launch kernel in the same process):
#   d128 s8192      64x128: 450 / 412 causal (one-launch 411 / 372); GQA 32/8 468 / 394 (429 / 362)
#   d128 s8192      the next step's S^T (and dP^T) issued early: 308 (241); 3 stages 296; 2 dQ buffers 303
#                   (the issued-ahead accumulators push the MMA partition past its 240 registers: 224-484
#                   bytes of spills)
#   d128 s2048      352 / 257 vs one-launch 376 / 311 -> the kernel runs above BWD_WS_MIN_SEQLEN only
#   d64 s8192       64x128 346 / 304, 128x128 223-319 vs one-launch 384 / 326 -> d64 runs it only when forced
# 2026-12-01, the loader staging lse/D in shared memory, dK left in flight during the dQ hand-off and one
# release per slot (spills of the MMA partition 28 -> 12 bytes dense, 172 -> 92 varlen causal; Nsight Compute
# had shown 31% of stalls on L1TEX scoreboards and 8.5M local-memory requests per launch):
#   d128 s8192      529 / 469 (before 466 / 433), cuDNN 530 / 487; GQA 32/8 539 / 452, cuDNN 531 / 488;
#   d128 s4096      508 / 427, cuDNN 511 / 438 (bwd_ws_check.py --time-only, one process)
#   d128 s2048      478 / 372 vs one-launch 376 / 309, cuDNN 493 / 396; GQA 32/8 496 / 358 vs 378 / 297
#   d64 s8192       395 / 379 vs one-launch 384 / 333, cuDNN 446 / 408
# 2026-12-01, boxes of one head (3-D descriptors; d96 padded to 128 in shared memory), same process:
#   d128 s8192      536 / 485, one-launch 412 / 367, cuDNN 530 / 490
#   d96 s8192       424 / 386, one-launch 325 / 282, cuDNN 417 / 391 (h = 21)
# Head dims above 128 (192 and 256, 256 in shared memory): bwd_ws_split.py, 64 x 64 (each warpgroup's 4 warps own
# 16 key rows each; FA3 takes 64 x 80 at d256), one Q/dO stage (two do not fit beside K, V, P^T, dS^T and the dQ
# halves: 214 KB of shared memory with one).
# ptxas: no spills dense or causal at d256; 180 bytes in the deterministic mode, 16 varlen d192. Measured on the H200
# 2026-12-01 (bwd_ws_check.py --time-only, one process; FA4 2026-11-30: d256 376 / 356):
#   d256 s8192      394 / 391 vs one-launch 272 / 258, cuDNN 353 / 373
#   d256 s2048      357 / 309 vs one-launch 262 / 232, cuDNN 345 / 298
#   d192 s8192      314 / 313 vs one-launch 216 / 204, cuDNN 315 / 321 (h = 12; padded to 256 in shared memory)
# d64: two CTAs per SM. WsTile(64, 64, num_warps=4, max_registers=128): 75 KB of shared memory and 128 registers a
# thread at launch each, no spills (the MMA partition raises itself to 232). At d64 the exp2 and dS work per step
# weighs twice what it does at d128 against the matmuls, and one 8-warp MMA partition does it in lock-step (thread
# barriers); two CTAs' partitions are not, so one's softmax work overlaps the other's matmuls. Measured 2026-12-01
# (`device.sh candidates`, bwd_ws_check.py, one process): d64 s8192 407 / 389 vs 64x128 with 8 warps 390 / 375,
# cuDNN 443 / 409.
# Longest first (WsTile.longest_first, a key-major grid): scripts/wave_schedule.py models a causal launch's tail (CTAs
# start in grid order on the SM that frees first) and predicts x1.06 at d128 s8192 and x1.12 at GQA 32/8 (4x longer
# CTAs); its cost is L2 locality, since concurrent CTAs then belong to different heads. Measured 2026-12-01 (same
# run, key-major vs tile-major, TF/s): causal GQA 32/8 s8192 478 vs 442, s2048 383 vs 348 (cuDNN 488, 382);
# causal MHA d128 s8192 464 vs 481; non-causal 497 vs 538 (MHA), 525 vs 531 and 465 vs 494 (GQA). In processes that
# first ran the rest of the benchmark grid (A/B against the tile-major code, alternating, twice): causal GQA 32/8
# s8192 448 / 442 vs 406 / 439, s2048 372 / 382 vs 353 / 351 -> key-major for causal calls with
# BWD_WS_LONGEST_FIRST_MIN_GROUP or more query heads per kv head, at d128 (d96 runs the same tile; group 2, d64 and
# d256 not measured).
BWD_WS_SM90 = {64: WsTile(64, 64, num_stages=2, dq_stages=1, num_warps=4, max_registers=128),
               128: WsTile(64, 128, num_stages=2, dq_stages=1),
               256: WsTile(64, 64, num_stages=1, dq_stages=1, num_warps=4, split_d=True)}
BWD_WS_LONGEST_FIRST = {128: replace(BWD_WS_SM90[128], longest_first=True)}
BWD_WS_LONGEST_FIRST_MIN_GROUP = 4


def bwd_ws_tile(head_dim_padded: int, causal: bool, group_size: int) -> WsTile:
    """The warp-specialised backward's tile for a call (the tables above)."""
    key = head_block(head_dim_padded)
    if causal and group_size >= BWD_WS_LONGEST_FIRST_MIN_GROUP and key in BWD_WS_LONGEST_FIRST:
        return BWD_WS_LONGEST_FIRST[key]
    return BWD_WS_SM90[key]


# Where it measured faster than the one-launch kernel. Above 128 both kernels pad the head dim to 256, so every
# head dim there does the work measured at d256 and d192.
BWD_WS_DEFAULT_HEAD_DIMS = frozenset({64, 96, 128, *range(136, 257, 8)})
BWD_WS_MIN_SEQLEN = 2048   # the shortest length measured (d64 only at s8192)
BWD_WS_RULE = GluonRule("ws", BWD_WS_SM90, BWD_WS_DEFAULT_HEAD_DIMS, BWD_WS_MIN_SEQLEN,
                        slower_head_dim="the one-launch kernel measured faster",
                        shorter="the one-launch kernel measured faster", pads_head_dim=True)
# The fp32 dQ accumulator of one launch: kv-head groups run in turn so that it stays under this size (one
# launch for every call of the benchmark grid; docs/triton.md on the GQA memory target this does not meet).
BWD_WS_DQ_ACCUM_BYTES = 128 * 2 ** 20

# ---- warp-specialised forward (fwd_ws.py) on sm_90 ------------------------------------------------------
# Registers per thread of each consumer warpgroup by their count: FA3's budgets for two and three consumer
# warpgroups (hopper/flash_fwd_kernel.h); with the loader's they fill the register file.
FWD_WS_CONSUMER_REGS = {2: 240, 3: 160}


@dataclass(frozen=True)
class FwdWsTile:
    """Launch shape of the warp-specialised forward (fwd_ws.py): query rows per CTA (`consumers` warpgroups of 64
    rows each), key rows per step, K/V ring stages, whether the next key tile's S = Q K^T is issued before the
    current P V (intra-warpgroup overlap), whether the consumers take turns issuing their matmuls (ping-pong), the
    register budgets of a consumer warpgroup (None: FWD_WS_CONSUMER_REGS) and of the 1-warp loader, and whether the
    grid is query-tile-major (`longest_first`: under a causal mask the longest query tiles of every head start before
    any shorter one; fwd_ws._cta_coords)."""
    block_m: int
    block_n: int
    num_stages: int = 2
    overlap: bool = True
    pingpong: bool = False
    consumer_regs: int | None = None
    loader_regs: int = 24
    longest_first: bool = False
    consumers: int = 2

    def __post_init__(self):
        if self.consumers not in FWD_WS_CONSUMER_REGS or self.block_m != 64 * self.consumers:
            raise ValueError(f"FwdWsTile: {self.consumers} consumers with block_m {self.block_m}; expected 2 or 3 "
                             "consumer warpgroups of 64 query rows each (a wgmma's M)")
        if self.consumer_regs is None:
            object.__setattr__(self, "consumer_regs", FWD_WS_CONSUMER_REGS[self.consumers])

    @classmethod
    def parse(cls, text: str) -> FwdWsTile:
        """'BMxBN[xSTAGES[xOVERLAP[xPINGPONG[xLONGEST_FIRST]]]]' (flags 0 or 1), as scripts/fwd_ws_check.py takes it;
        BM 192 means three consumer warpgroups."""
        names = ("block_m", "block_n", "num_stages", "overlap", "pingpong", "longest_first")
        values = list(map(int, text.split("x")))
        values[3:] = map(bool, values[3:])
        return cls(**dict(zip(names, values)), consumers=values[0] // 64)

    def __str__(self) -> str:
        text = f"{self.block_m}x{self.block_n}x{self.num_stages}x{int(self.overlap)}x{int(self.pingpong)}"
        return text + "x1" if self.longest_first else text


# Tiles: FA3's H100 shape for d128 (128 query rows per CTA in two consumer warpgroups, 2 K/V stages, the
# intra-warpgroup overlap; FA3's key block, 176 non-causal / 128 causal, is not a power of two: 128 here);
# at d64 FA3 takes 192 x 192 with three warpgroups, a shape this two-consumer kernel does not have: 128 x 128.
# 240 registers per consumer warpgroup and 24 for the loader are FA3's budgets for two consumer warpgroups.
# Measured 2026-12-01 on the H200 (scripts/fwd_ws_check.py, bf16, b = 16384/s, h = 2048/d, forward TFLOP/s
# non-causal / causal, same process):
#   d128 s4096  overlap 605 / 517, no overlap 528 / 470, previous forward 471 / 401, cuDNN 588 / 508
#   d128 s8192  overlap 602 / 519, no overlap 546 / 503, previous forward 484 / 439, cuDNN 594 / 539
#   GQA 32/8 s8192  overlap 604 / 574, previous 482 / 453, cuDNN 583 / 538
#   d64 s8192   overlap 445 / 414, no overlap 432 / 408, previous forward 398 / 371, cuDNN 451 / 432
# Ping-pong (the two consumers take turns issuing their matmuls, FA3's warp scheduler barrier), measured
# 2026-12-01 in one process (fwd_ws_check.py --tiles 128x128x2x1x0,128x128x2x1x1 --seqlens 2048,8192; off / on):
#   causal      d128 s8192 540 / 575, s2048 462 / 472; GQA 32/8 s8192 588 / 588, s2048 468 / 488;
#               d64 s8192 410 / 415, s2048 331 / 335                            -> on
#   non-causal  d128 s8192 615 / 609, s2048 628 / 567; GQA 32/8 s8192 611 / 616, s2048 568 / 551;
#               d64 s8192 457 / 442, s2048 423 / 414                            -> off
# d256 (and d192, padded to 256 in shared memory): 128 x 64 tiles, FA3's key block at d256; 196 KB of shared
# memory with 2 stages. Measured 2026-12-01 (fwd_ws_check.py --shapes 96:21:21,192:10:10,256:8:8 --seqlens 8192,
# ping-pong off / on, previous forward, cuDNN, same process):
#   d256  674 / 653 and 602 / 598 causal (previous 377 / 335, cuDNN 649 / 591)   -> ping-pong off
#   d192  528 / 516 and 489 / 486 causal (previous 288 / 247, cuDNN 645 / 570)   -> ping-pong off
#   d96   478 / 470 and 445 / 449 causal (previous 376 / 343, cuDNN 468 / 423)   (d128 tiles: as d128)
# Longest first (FwdWsTile.longest_first, a query-major grid): the causal d128 s8192 forward reaches 0.94 of the ideal
# tile-major, 0.998 query-major in scripts/wave_schedule.py's model, but measured slower on the H200 2026-12-01
# (`fwd_ws_check.py --tiles128 128x128x2x1x1,128x128x2x1x1x1`, tile-major vs query-major): causal d128 s8192 559 vs
# 538, GQA 32/8 s8192 573 vs 567 and s2048 478 vs 466, non-causal 608 vs 558; only causal d128 s2048 309 vs 323
# -> off (the option stays for measurement).
# Keyed by the power of two the head dim is padded to in shared memory (d96 runs in the d128 tiles), then causal.
FWD_WS_SM90 = {d: {causal: FwdWsTile(128, 128 if d < 256 else 64, num_stages=2, overlap=True,
                                     pingpong=causal and d < 256)
                   for causal in (False, True)} for d in (64, 128, 256)}
# Shorter sequences, measured 2026-12-01 (fwd_ws_check.py --seqlens 1024,2048, same process, fwd_ws vs previous
# forward vs cuDNN): d128 s2048 566 / 457 vs 445 / 336 (cuDNN 612 / 478), s1024 543 / 344 vs 386 / 291;
# GQA 32/8 s2048 569 / 471 vs 451 / 349, s1024 535 / 404 vs 410 / 310; d64 s2048 420 / 330 vs 371 / 303,
# s1024 373 / 257 vs 353 / 264 (the one row where the previous forward is ahead, by 3%).
# Default for the head dims measured faster than the previous forward (d96/d192/d256 timed at s8192 only, d64/d128
# from s1024 on), from s1024, the shortest length measured.
FWD_WS_DEFAULT_HEAD_DIMS = frozenset({64, 96, 128, 192, 256})
FWD_WS_MIN_SEQLEN = 1024
# The running max is taken on raw scores, so the softmax scale must be positive.
FWD_WS_RULE = GluonRule("fwd_ws", FWD_WS_SM90, FWD_WS_DEFAULT_HEAD_DIMS, FWD_WS_MIN_SEQLEN,
                        slower_head_dim="not measured faster than the previous forward (TritonBackend(fwd_ws=True) "
                                        "runs it)",
                        shorter="not measured faster there (TritonBackend(fwd_ws=True) runs it)",
                        positive_scale=True, pads_head_dim=True)

GENERIC = {
    32: Configs(Tile(64, 64, 4, 2), Tile(64, 64, 4, 2), Tile(64, 64, 4, 2)),
    64: Configs(Tile(64, 64, 4, 2), Tile(64, 64, 4, 2), Tile(64, 64, 4, 2)),
    128: Configs(Tile(64, 32, 4, 2), Tile(32, 64, 4, 2), Tile(64, 32, 4, 2)),
    256: Configs(Tile(32, 32, 4, 1), Tile(32, 32, 4, 1), Tile(32, 32, 4, 1)),
}

INTERPRETER = Configs(Tile(16, 16, 1, 1), Tile(16, 16, 1, 1), Tile(16, 16, 1, 1))


def select(head_dim: int, causal: bool, capability: tuple[int, int] | None, interpreter: bool,
           seqlen: int = 0) -> Configs:
    """The configs for a call; `seqlen` is its longest (max) query or key length."""
    if interpreter:
        return INTERPRETER
    block = head_block(head_dim)
    if capability is not None and capability[0] == 9:
        table = SM90_FWD_SHORT if seqlen <= FWD_SHORT_SEQLEN else SM90_SHORT if seqlen <= SHORT_SEQLEN else SM90
        return table[(block, causal)]
    return GENERIC[block]
