"""Launch configurations (tile shapes, warps, pipeline stages), keyed on the head-dim block (`head_block`), causal
and GQA, and where the default runs each kernel (operators.py declares them per kernel). Chosen offline: nothing is
autotuned on the call path. One comment line per decision names where its numbers are: the measurements (H200, sm_90,
triton 3.6) are in bench/nvidia-h200.md §The measurements behind the design decisions; docs/triton.md says why each
choice is what it is."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


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
    `key_major`: a key-major grid (bwd_ws_workers.cta_coords), which under a causal mask starts the longest
    key tiles of every head before any shorter one. `named_barriers`: the MMA partition releases a Q/dO slot and
    hands dQ over by a hardware named barrier that each of its threads arrives on (the loader and the dQ writer wait on
    it), not by a one-thread mbarrier arrive, before and after which Triton puts a barrier of the whole partition
    (bwd_ws_workers.named_arrive; bwd_ws.py only, not split_d)."""
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
    key_major: bool = False
    named_barriers: bool = False

    def __post_init__(self):
        if self.named_barriers and self.split_d:
            raise ValueError(f"WsTile {self}: named_barriers is bwd_ws.py's (its one MMA partition); "
                             "expected split_d=False")
        if self.named_barriers and NAMED_BARRIER_FIRST + self.num_stages + self.dq_stages > NAMED_BARRIER_COUNT:
            raise ValueError(f"WsTile {self}: named_barriers needs one hardware barrier per Q/dO and dQ stage, ids "
                             f"{NAMED_BARRIER_FIRST} to {NAMED_BARRIER_COUNT - 1}; expected num_stages + dq_stages "
                             f"<= {NAMED_BARRIER_COUNT - NAMED_BARRIER_FIRST}")

    @classmethod
    def parse(cls, text: str) -> WsTile:
        """'BMxBN[xSTAGES[xDQ_STAGES[xWARPS[xMAX_REGISTERS[xKEY_MAJOR[xNAMED_BARRIERS]]]]]]' (the flags 0 or 1), as
        the benchmark scripts take it."""
        names = ("block_m", "block_n", "num_stages", "dq_stages", "num_warps", "max_registers", "key_major",
                 "named_barriers")
        values: list[Any] = list(map(int, text.split("x")))
        values[6:] = map(bool, values[6:])
        return cls(**dict(zip(names, values)))

    def __str__(self) -> str:
        text = f"{self.block_m}x{self.block_n}x{self.num_stages}x{self.dq_stages}"
        if (self.num_warps, self.max_registers, self.key_major, self.named_barriers) != (8, 0, False, False):
            text += f"x{self.num_warps}x{self.max_registers}x{int(self.key_major)}"
        return text + "x1" if self.named_barriers else text


# Hardware named barriers of a CTA (bar.sync ids 0-15); Triton's own code uses the lowest ids (0 for a partition's
# barrier, 1 for the start and end of warp specialisation), WsTile.named_barriers the ids from NAMED_BARRIER_FIRST.
NAMED_BARRIER_COUNT = 16
NAMED_BARRIER_FIRST = 8


def head_block(head_dim: int) -> int:
    """The power-of-two block that holds a (padded) head dim, in registers (the Triton kernels; columns past it
    are masked) and in shared memory (the Gluon kernels' TMA boxes read zeros past it): every tile table is keyed
    by it. At least 32: the smallest block the tables hold (d = 8 and 16 run in it, masked)."""
    block = 32
    while block < head_dim:
        block *= 2
    return block


# ---- sm_90 (H200): one-launch kernels -----------------------------------------------------------
# (bwd_kv, bwd_dq, bwd_tma, bwd_dp_first, bwd_even_k) per head block, GQA on the MHA row: bench/nvidia-h200.md.
_BWD_SM90 = {
    32: (Tile(32, 128, 4, 3), Tile(128, 64, 4, 3), "all", False, True),
    64: (Tile(32, 128, 4, 3), Tile(128, 64, 4, 3), "all", False, True),
    128: (Tile(64, 128, 8, 3), Tile(128, 64, 8, 3), "all", False, True),
    256: (Tile(64, 64, 8, 1), Tile(128, 64, 8, 1), "stores", True, False),
}
_FWD_SM90 = {32: Tile(128, 64, 4, 3), 64: Tile(128, 64, 4, 3), 128: Tile(128, 64, 8, 3), 256: Tile(64, 64, 4, 2)}
SM90 = {(d, causal): Configs(_FWD_SM90[d], *_BWD_SM90[d]) for d in _BWD_SM90 for causal in (False, True)}

# Longest lengths up to which tiles move by masked pointers, not TMA: bench/nvidia-h200.md §Short sequences.
SHORT_SEQLEN = 2048
FWD_SHORT_SEQLEN = 1024


# Made once: select is on the call path.
SM90_SHORT = {key: replace(c, bwd_tma="none") for key, c in SM90.items()}
SM90_FWD_SHORT = {key: replace(c, fwd_tma=False) for key, c in SM90_SHORT.items()}

# ---- warp-specialised backward (bwd_ws.py, bwd_ws_split.py) on sm_90 --------------------------------------------
# Tiles per head block: bench/nvidia-h200.md §Warp-specialised backward.
BWD_WS_SM90 = {64: WsTile(64, 64, num_stages=2, dq_stages=1, num_warps=4, max_registers=128),
               128: WsTile(64, 128, num_stages=2, dq_stages=1),
               256: WsTile(64, 64, num_stages=1, dq_stages=1, num_warps=4, split_d=True)}
# Key-major grid for causal GQA 4+ and deterministic causal calls: same section, "Longest first"; docs/workloads.md.
BWD_WS_KEY_MAJOR = {128: replace(BWD_WS_SM90[128], key_major=True)}
BWD_WS_KEY_MAJOR_MIN_GROUP = 4


def bwd_ws_tile(head_dim: int, causal: bool, group_size: int = 1, deterministic: bool = False) -> WsTile | None:
    """The warp-specialised backward's tile for a call (the tables above; None: no tile for the head dim)."""
    key = head_block(head_dim)
    key_major = deterministic or group_size >= BWD_WS_KEY_MAJOR_MIN_GROUP
    if causal and key_major and key in BWD_WS_KEY_MAJOR:
        return BWD_WS_KEY_MAJOR[key]
    return BWD_WS_SM90.get(key)


# Where it measured faster than the one-launch kernel (same section, "Short sequences"): these head dims, from
# these longest-sequence lengths per head block (GQA included, since its several launches replay); the
# operators bwd_ws and bwd_ws_split (operators.py) declare them.
BWD_WS_DEFAULT_HEAD_DIMS = frozenset({64, 96, 128, *range(136, 257, 8)})
BWD_WS_MIN_SEQLEN = {64: 1024, 128: 512, 256: 512}
# One launch's fp32 dQ accumulator; kv-head groups run in turn below it: docs/triton.md §Known limits.
BWD_WS_DQ_ACCUM_BYTES = 128 * 2 ** 20

# ---- varlen schedule (varlen_schedule.py) of the warp-specialised kernels (TritonBackend(varlen_schedule=...)) ------
VARLEN_SCHEDULE = True   # faster on packed documents, deterministic above all (bench/nvidia-h200.md)
GRID_Y_MAX = 65535   # a CUDA grid's y dimension: a schedule of more items keeps the grid over every (batch, tile)

# ---- warp-specialised forward (fwd_ws.py) on sm_90 ------------------------------------------------------
# Registers per thread of a consumer warpgroup by their count: FA3's budgets (hopper/flash_fwd_kernel.h).
FWD_WS_CONSUMER_REGS = {2: 240, 3: 160}


@dataclass(frozen=True)
class FwdWsTile:
    """Launch shape of the warp-specialised forward (fwd_ws.py): query rows per CTA (`consumers` warpgroups of 64
    rows each), key rows per step, K/V ring stages, whether the next key tile's S = Q K^T is issued before the
    current P V (intra-warpgroup overlap), whether the consumers take turns issuing their matmuls (ping-pong), the
    register budgets of a consumer warpgroup (None: FWD_WS_CONSUMER_REGS) and of the 1-warp loader, and whether the
    grid is query-tile-major (`query_major`: under a causal mask the longest query tiles of every head start before
    any shorter one; fwd_ws._cta_coords), and whether each consumer runs the key tiles its rows see in full in a loop
    of their own without the mask's code (`split_mask`: gluon_common.Mask.unmasked_key_tiles; off, each key tile
    tests at run time whether it needs the mask)."""
    block_m: int
    block_n: int
    num_stages: int = 2
    overlap: bool = True
    pingpong: bool = False
    consumer_regs: int | None = None
    loader_regs: int = 24
    query_major: bool = False
    consumers: int = 2
    split_mask: bool = False

    def __post_init__(self):
        if self.consumers not in FWD_WS_CONSUMER_REGS or self.block_m != 64 * self.consumers:
            raise ValueError(f"FwdWsTile: {self.consumers} consumers with block_m {self.block_m}; expected 2 or 3 "
                             "consumer warpgroups of 64 query rows each (a wgmma's M)")
        if self.consumer_regs is None:
            object.__setattr__(self, "consumer_regs", FWD_WS_CONSUMER_REGS[self.consumers])

    @classmethod
    def parse(cls, text: str) -> FwdWsTile:
        """'BMxBN[xSTAGES[xOVERLAP[xPINGPONG[xQUERY_MAJOR[xSPLIT_MASK]]]]]' (flags 0 or 1), as
        scripts/lab/fwd_ws_check.py takes it; BM 192 means three consumer warpgroups."""
        names = ("block_m", "block_n", "num_stages", "overlap", "pingpong", "query_major", "split_mask")
        values: list[Any] = list(map(int, text.split("x")))
        values[3:] = map(bool, values[3:])
        return cls(**dict(zip(names, values)), consumers=values[0] // 64)

    def __str__(self) -> str:
        text = f"{self.block_m}x{self.block_n}x{self.num_stages}x{int(self.overlap)}x{int(self.pingpong)}"
        if self.split_mask:
            return f"{text}x{int(self.query_major)}x1"
        return text + "x1" if self.query_major else text


# Tiles per head block, then causal: bench/nvidia-h200.md §Warp-specialised forward.
FWD_WS_SM90 = {d: {causal: FwdWsTile(128, 128 if d < 256 else 64, num_stages=2, overlap=True,
                                     pingpong=causal and d < 256)
                   for causal in (False, True)} for d in (64, 128, 256)}
# Where it measured faster than the previous forward (same section, "Short sequences"): these head dims, from
# these longest-sequence lengths per head block (256: the shortest measured); the operator fwd_ws declares them.
FWD_WS_DEFAULT_HEAD_DIMS = frozenset({64, 96, 128, 192, 256})
FWD_WS_MIN_SEQLEN = {64: 1024, 128: 256, 256: 256}
# Head blocks (q/k's) where the warp-specialised kernels run a v narrower than q/k by default (at v's own head dim:
# V, O, dO and dV tiles of v's head block): where measured faster than the kernel that runs it otherwise
# (bench/nvidia-h100.md §A value head dim of its own: MLA's (192, 128) causal, fwd_ws 1.4x the (d, d) call with v
# padded, the ws backward 1.1-1.45x the one-launch backward). Elsewhere TritonBackend(fwd_ws=True) / (ws=True) run it.
FWD_WS_NARROWER_VALUE_HEAD_BLOCKS = frozenset({256})
BWD_WS_NARROWER_VALUE_HEAD_BLOCKS = frozenset({256})
# Where the defaults give a score term to the warp-specialised kernels, which take the sink, the softcap and ALiBi
# (operators' takes_sink, supports_softcap, supports_alibi), rather than to the one-launch ones: where they measured
# faster (bench/nvidia-h100.md §Score terms on the warp-specialised kernels, §Softcap and dropout at every head
# block). The sink and bwd_ws's softcap: wherever those kernels run. fwd_ws's and bwd_ws_split's softcap: these head
# blocks (with the hardware tanh, fwd_ws measured faster at 128 and 256; bwd_ws_split at 256 is its only block).
FWD_WS_SOFTCAP_HEAD_BLOCKS = frozenset({128, 256})
BWD_WS_SPLIT_SOFTCAP_HEAD_BLOCKS = frozenset({256})
# Dropout (gluon/dropout.py's draws beside the softmax of fwd_ws, the P^T of bwd_ws and bwd_ws_split): where measured
# faster than the one-launch kernels (the same sections): the backward at every head block (bwd_ws at 64 and 128,
# bwd_ws_split at 256); the forward at 256 only (at 64 and 128 the one-launch forward measured faster).
FWD_WS_DROPOUT_HEAD_BLOCKS = frozenset({256})
BWD_WS_DROPOUT_HEAD_BLOCKS = frozenset({64, 128, 256})
# ALiBi: under these Triton releases, (major, minor); under 3.9 both directions measured slower than the one-launch
# kernels, and 3.7 and 3.8 were not measured.
WS_ALIBI_TRITON_RELEASES = frozenset({(3, 6)})


# fwd_ws may load q/k of a head dim in 129-192 as a 128-column block and a tail block (the rest, in a power of two of
# columns), one matmul each into S: 192 columns in shared memory and in the matmuls where the head block takes 256.
# Only beside a v of at most 128 columns (MLA's (192, 128)): O then leaves through the first block's buffer, and S and
# O are the d128 tile's, which runs it (shared memory: Q 48 KB, K 2 x 48, V 2 x 32). On: 1.21-1.23x the 256-column
# head block at (192, 128) causal (bench/nvidia-h100.md §A value head dim of its own; timed under Triton 3.6).
FWD_WS_QK_TAIL = True


# bwd_ws_split may likewise take q/k of a head dim in 129-192 as a 128-column block and a tail block, beside any v: its
# two warpgroups then own dK's and dQ's first 128 columns and the tail's (not halves of 256), S^T the sum of two
# matmuls: 832 of the 1,024 column-units of matmul work a step at (192, 128), 1,024 of 1,280 at (192, 192). Off until
# it has run on a GPU (compiled for sm_90a).
BWD_WS_QK_TAIL = False


def _qk_tail(head_dim: int) -> int:
    """The columns of q/k's tail block beside a 128-column first block where the head dim is in 129-192, else 0."""
    return head_block(head_dim - 128) if 128 < head_dim <= 192 else 0


def fwd_ws_qk_tail(head_dim: int, head_dim_v: int) -> int:
    """The columns of the tail block fwd_ws loads q/k in (FWD_WS_QK_TAIL), 0: none (the head block whole)."""
    return _qk_tail(head_dim) if FWD_WS_QK_TAIL and head_block(head_dim_v) <= 128 else 0


def bwd_ws_qk_tail(head_dim: int) -> int:
    """The columns of the tail block bwd_ws_split loads q/k in (BWD_WS_QK_TAIL), 0: none (the head block whole)."""
    return _qk_tail(head_dim) if BWD_WS_QK_TAIL else 0


def fwd_ws_tile(head_dim: int, causal: bool, head_dim_v: int | None = None) -> FwdWsTile | None:
    """The warp-specialised forward's tile for a call (None: no tile for the head dim; GQA runs the MHA tile); q/k
    with a tail block (fwd_ws_qk_tail, v's head dim given) run the d128 tile."""
    if head_dim_v is not None and fwd_ws_qk_tail(head_dim, head_dim_v):
        return FWD_WS_SM90[128][causal]
    tiles = FWD_WS_SM90.get(head_block(head_dim))
    return tiles[causal] if tiles else None


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
