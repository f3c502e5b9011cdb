"""Warp-specialised forward kernel for sm_90, written in Gluon (FA3's design).

One CTA per (query tile of BLOCK_M rows, batch, query head); the first program of each (batch, head) takes its
last query tile, the longest under a causal mask, and with QUERY_MAJOR the grid is (heads, batch, query tiles),
so the last query tiles of every head start before any shorter one (`_cta_coords`). A varlen launch may instead
take a schedule (varlen_schedule.py: the real (sequence, query tile) items, the most key tiles first): grid
(heads, items), program (h, p) runs item p for head h and exits on the padding. CONSUMERS (2 or 3) consumer
warpgroups of 64 query rows each and a loader warp share the CTA:

  loader      (1 warp)   TMA: the CTA's Q tiles (one per consumer) once, behind one "q_ready" mbarrier; then per
                         visible key tile K and V into a ring of NUM_STAGES buffers, each behind its own
                         "ready" mbarrier (TMA byte count) and "empty" mbarrier (count CONSUMERS: every
                         consumer releases it).
  consumer 0  (default,  query rows [m0, m0 + 64), one warpgroup;
               4 warps)
  consumer i  (4 warps)  query rows [m0 + 64 i, m0 + 64 (i + 1)), one warpgroup each.
                         Per key tile: S = Q K^T (shared-memory operands, async wgmma); online softmax in
                         registers (running max m and sum l; P = exp2(S * scale * log2e - m * scale *
                         log2e), one FFMA per score); O = O * alpha + P V with P as the register A
                         operand of the wgmma. The warpgroups run on their own, so one's softmax
                         overlaps another's matmuls; PINGPONG makes them take turns issuing (one "turn"
                         mbarrier each, passed round in consumer order).
                         OVERLAP: S of key tile j + 1 is issued before P V of tile j and the softmax of
                         j + 1 runs while P V of j is on the tensor cores (FA3's intra-warpgroup
                         overlap); one more S tile lives in registers.
                         Epilogue: O / l in the input dtype (a TMA store through the warpgroup's own Q
                         buffer when its rows lie in the sequence, else a row-masked pointer store) and
                         lse = m * scale + ln(l) in fp32; a row that sees no key gets O = 0, lse = +inf.
                         With a learnable sink (`Sink`) its logit is first taken in as one more term
                         of m and l (softmax_terms.take_sink). With a softcap each S tile becomes
                         softcap * tanh(scale * S / softcap) in log2 units before the mask and the max;
                         with ALiBi the head's slope times each score's distance from the bottom-right
                         diagonal is subtracted (in log2 units: softmax_terms.alibi_distance).

Every consumer walks every key tile the CTA sees (the loader loads each once); a tile that no row of a
warpgroup sees gives P = 0 there. Each key tile tests at run time whether it needs the mask; with SPLIT_MASK
(config.FwdWsTile.split_mask) a consumer instead walks the tiles its rows see in full
(gluon_common.Mask.unmasked_key_tiles) in a loop of their own without mask code, and those before and after them
with the mask. Three consumers (FA3's d64 shape, 192 query rows per CTA) have 160 registers
each, room for no OVERLAP. Tensors reach the kernel as host TMA descriptors with boxes of one
head over 3-D (rows, heads, head_dim) views (gluon_common.descriptor), so one descriptor serves dense and
varlen calls: a key tile may read rows of the next sequence (masked to P = 0, as every tile past len_k
is), a Q tile may too (those rows are never written). HEAD_D is the power of two at or above head_dim:
loads read zeros past head_dim, so S and O are exact, and stores write head_dim columns only. V and O have their own
HEAD_DV (v's box): a v narrower than q/k (MLA's 192 / 128) takes V tiles, a P V matmul and an O accumulator of its
own width, and O leaves through a view of the Q buffer at that width. With `q_tail_desc` / `k_tail_desc`
(config.fwd_ws_qk_tail: q/k's head dim 129-192 beside a v of at most 128, MLA's 192 / 128) Q and K are loaded as a
HEAD_D-column block and a QK_TAIL-column tail block (two TMA boxes on one barrier), and S is the sum of one matmul
per block: 192 columns in shared memory and in the matmuls where the head block would take 256.

Invariants (on the host: `TritonBackend.fwd_ws_reasons` decides which calls run here,
gluon_common.uniform_rows copies tensors whose rows a descriptor cannot view):
  - head_dim padded to a power of two with a tile in config.FWD_WS_SM90, v's no wider (HEAD_DV <= HEAD_D: O goes
    out through the Q buffer); heads adjacent in memory (stride_h = head_dim), rows uniform, 16-byte aligned; out
    viewed as v;
  - BLOCK_M = 64 * CONSUMERS (config.FwdWsTile checks it);
  - the softmax scale is positive (the running max is taken on raw scores, or on log2-unit ones with a softcap
    or ALiBi).
"""


import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .. import config
from ..runtime.launch import GluonCall, GluonMask, GluonSizes, LaunchSpec
from ..runtime.softmax_terms import alibi_distance, take_sink
from ..runtime.triton_versions import reinterpret, tma_load, tma_store
from .dropout import pattern_of
from .gluon_common import (
    LOG2E,
    Mask,
    Ring,
    Sequences,
    aggregate,
    descriptor,
    hardware_tanh,
    slot,
    uniform_descriptor,
)

CONSUMER_WARPS: gl.constexpr = gl.constexpr(4)   # one warpgroup per consumer partition


@aggregate
class PartitionConstants:
    """The kernel's tile (config.FwdWsTile) and head dims in shared memory (q/k's, v's) as constants, and the consumers'
    register layouts: the warpgroup's 4 warps split the rows of S and O; P is the register A operand of P V."""
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    HEAD_D: gl.constexpr       # q/k's columns in shared memory (their first block with a tail)
    HEAD_DV: gl.constexpr
    QK_TAIL: gl.constexpr      # columns of q/k's tail block (GluonCall.QK_TAIL; 0: none)
    NUM_STAGES: gl.constexpr
    CONSUMERS: gl.constexpr
    ROWS: gl.constexpr        # query rows per consumer warpgroup
    OVERLAP: gl.constexpr
    PINGPONG: gl.constexpr
    QUERY_MAJOR: gl.constexpr
    SPLIT_MASK: gl.constexpr
    s_layout: gl.constexpr
    o_layout: gl.constexpr
    p_layout: gl.constexpr
    row_layout: gl.constexpr   # one value per query row

    @gluon.constexpr_function
    def __init__(self, TILE, HEAD_D, HEAD_DV, QK_TAIL):
        for name in ("block_m", "block_n", "num_stages", "consumers", "overlap", "pingpong", "query_major",
                     "split_mask"):
            setattr(self, name.upper(), gl.constexpr(getattr(TILE, name)))
        self.HEAD_D = gl.constexpr(HEAD_D)
        self.HEAD_DV = gl.constexpr(HEAD_DV)
        self.QK_TAIL = gl.constexpr(QK_TAIL)
        self.ROWS = gl.constexpr(TILE.block_m // TILE.consumers)
        warps = CONSUMER_WARPS.value
        self.s_layout = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                               instr_shape=[16, TILE.block_n, 16]))
        self.o_layout = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                               instr_shape=[16, HEAD_DV, 16]))
        self.p_layout = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=self.o_layout.value, k_width=2))
        self.row_layout = gl.constexpr(gl.SliceLayout(1, self.s_layout.value))


@aggregate
class Buffers:
    """Shared memory and barriers: the CTA's Q tiles (one per consumer, behind one "q_ready" barrier), the K and V
    rings, and the ping-pong "turn" barriers (one per consumer); with a q/k tail block (QK_TAIL) the Q tail tiles and
    the K tail ring (on the K ring's barriers), else the Q tiles and the K ring again (unread)."""
    q: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    k: Ring
    v: Ring
    turn: gl.shared_memory_descriptor
    q_tail: gl.shared_memory_descriptor
    k_tail: Ring


# ---- schedule: which query rows and key tiles a CTA covers --------------------------------------
@gluon.jit
def _cta_coords(seqs, BLOCK_M: gl.constexpr, QUERY_MAJOR: gl.constexpr):
    """(first query row, batch, query head) of this CTA: the grid is (query tiles, batch, heads), or with QUERY_MAJOR
    (heads, batch, query tiles); the first program along the tile axis takes the last query tile. With a schedule
    (`seqs.schedule`) the grid is (heads, schedule rows) and the row names the sequence and query tile."""
    if seqs.schedule is not None:
        b, tile = seqs.scheduled_item()
        m0 = tile * BLOCK_M
        head = gl.program_id(0)
    else:
        TILE_AXIS: gl.constexpr = 2 if QUERY_MAJOR else 0
        HEAD_AXIS: gl.constexpr = 0 if QUERY_MAJOR else 2
        m0 = (gl.num_programs(TILE_AXIS) - 1 - gl.program_id(TILE_AXIS)) * BLOCK_M
        b = gl.program_id(1)
        head = gl.program_id(HEAD_AXIS)
    return m0, b, head


@gluon.jit
def _past_sequence(seqs, consts):
    """Whether this CTA has nothing to do (varlen): its row of the schedule is padding, or without one its query tile
    starts past its sequence."""
    if seqs.schedule is not None:
        past = seqs.scheduled_item()[0] < 0
    else:
        m0, b, _ = _cta_coords(seqs, consts.BLOCK_M, consts.QUERY_MAJOR)
        past = m0 >= gl.load(seqs.cu_seqlens_q + b + 1) - gl.load(seqs.cu_seqlens_q + b)
    return past


@gluon.jit
def _tile_schedule(consts, seqs, mask):
    """Everything every partition derives from the program id, computed the same way in each."""
    m0, b, head = _cta_coords(seqs, consts.BLOCK_M, consts.QUERY_MAJOR)
    q_row0, len_q = seqs.query(b)
    k_row0, len_k = seqs.key(b)
    shift = mask.shift(len_q, len_k)
    n_lo, n_tiles = mask.key_tiles(m0, len_q, len_k, shift, consts.BLOCK_M, consts.BLOCK_N)
    return m0, b, head, q_row0, len_q, k_row0, len_k, shift, n_lo, n_tiles


# ---- loader partition ------------------------------------------------------------------------
@gluon.jit
def _loader(consts, bufs, seqs, mask, descs, group):
    """`descs`: the (q, k, v) descriptors, and with a q/k tail block (q tail, k tail) after them."""
    if consts.QK_TAIL:
        q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc = descs
    else:
        q_desc, k_desc, v_desc = descs
    m0, b, head, q_row0, len_q, k_row0, len_k, shift, n_lo, n_tiles = _tile_schedule(consts, seqs, mask)
    if consts.QK_TAIL:
        mbarrier.expect(bufs.q_ready, consts.CONSUMERS * (q_desc.block_type.nbytes + q_tail_desc.block_type.nbytes))
    else:
        mbarrier.expect(bufs.q_ready, consts.CONSUMERS * q_desc.block_type.nbytes)
    for wg in gl.static_range(consts.CONSUMERS):
        tma_load(q_desc, [q_row0 + m0 + wg * consts.ROWS, head, 0], bufs.q_ready,
                                        bufs.q.index(wg))
        if consts.QK_TAIL:
            tma_load(q_tail_desc, [q_row0 + m0 + wg * consts.ROWS, head, consts.HEAD_D], bufs.q_ready,
                     bufs.q_tail.index(wg))
    kv_head = head // group
    for j in range(n_tiles):
        stage = j % consts.NUM_STAGES
        phase = (j // consts.NUM_STAGES) & 1
        row = k_row0 + n_lo + j * consts.BLOCK_N
        if consts.QK_TAIL:
            _load_with_tail(bufs.k, bufs.k_tail, (k_desc, k_tail_desc), [row, kv_head, 0], consts.HEAD_D, stage,
                            phase)
        else:
            _load(bufs.k, k_desc, [row, kv_head, 0], stage, phase)
        _load(bufs.v, v_desc, [row, kv_head, 0], stage, phase)


@gluon.jit
def _load(ring, desc, coord, stage, phase):
    """Load a tile into `ring`'s slot `stage` once it is free (its readers released it in the previous phase)."""
    mbarrier.wait(ring.empty.index(stage), phase ^ 1)
    mbarrier.expect(ring.ready.index(stage), desc.block_type.nbytes)
    tma_load(desc, coord, ring.ready.index(stage), ring.bufs.index(stage))


@gluon.jit
def _load_with_tail(ring, tail_ring, descs, coord, tail_column, stage, phase):
    """`_load` of a K tile as its first block into `ring` and its tail block (from column `tail_column`) into
    `tail_ring`, which shares `ring`'s barriers: one wait, one byte count, two TMA loads."""
    desc, tail_desc = descs
    mbarrier.wait(ring.empty.index(stage), phase ^ 1)
    mbarrier.expect(ring.ready.index(stage), desc.block_type.nbytes + tail_desc.block_type.nbytes)
    tma_load(desc, coord, ring.ready.index(stage), ring.bufs.index(stage))
    tma_load(tail_desc, [coord[0], coord[1], tail_column], ring.ready.index(stage), tail_ring.bufs.index(stage))


# ---- consumer steps --------------------------------------------------------------------------
@gluon.jit
def _issue_pv(consts, p, v, j, acc):
    """Issue O += P V of key tile j (async) once its V has landed; P from registers."""
    v.wait_ready(j)
    p_op = gl.convert_layout(p.to(v.bufs.dtype), consts.p_layout)
    return warpgroup_mma(p_op, v.tile(j), acc, is_async=True)


@gluon.jit
def _issue_s(consts, bufs, q_tile, s_zero, j, WARPGROUP: gl.constexpr):
    """Issue S = Q K^T of key tile j (async) once its K has landed; with a q/k tail block, the tail's matmul adds
    into the first block's."""
    s = bufs.k.issue_mma(q_tile, s_zero, j)
    if consts.QK_TAIL:
        s = warpgroup_mma(slot(bufs.q_tail, WARPGROUP), bufs.k_tail.tile(j).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _s_round(consts, bufs, q_tile, s_zero, j, rounds, WARPGROUP: gl.constexpr):
    """A matmul round of S = Q K^T alone (key tile j): issue it in turn, wait for it, release K's slot."""
    rounds = _take_turn(consts, bufs.turn, rounds, WARPGROUP)
    s = _issue_s(consts, bufs, q_tile, s_zero, j, WARPGROUP)
    _pass_turn(consts, bufs.turn, WARPGROUP)
    s = warpgroup_mma_wait(0, deps=(s,))
    bufs.k.release(j)
    return s, rounds


@gluon.jit
def _pv_round(consts, bufs, p, j, acc, rounds, WARPGROUP: gl.constexpr):
    """A matmul round of P V alone (key tile j): issue it in turn, wait for it, release V's slot."""
    rounds = _take_turn(consts, bufs.turn, rounds, WARPGROUP)
    acc = _issue_pv(consts, p, bufs.v, j, acc)
    _pass_turn(consts, bufs.turn, WARPGROUP)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    bufs.v.release(j)
    return acc, rounds


@gluon.jit
def _take_turn(consts, turn, rounds, WARPGROUP: gl.constexpr):
    """PINGPONG: wait until the previous consumer has issued its matmuls of the round (turn[WARPGROUP] completes
    once per round), so the warpgroups' matmuls reach the tensor cores one round each, in consumer order."""
    if consts.PINGPONG:
        mbarrier.wait(turn.index(WARPGROUP), rounds & 1)
    return rounds + 1


@gluon.jit
def _pass_turn(consts, turn, WARPGROUP: gl.constexpr):
    """PINGPONG: this consumer's matmuls of the round are issued; the next one's turn (one turn barrier each)."""
    if consts.PINGPONG:
        mbarrier.arrive(turn.index((WARPGROUP + 1) % turn.shape[0]), count=1)


@gluon.jit
def _softmax_step(consts, mask, s, m_i, l_i, n0, offs_m, offs_n, m0, len_k, shift, scale_log2, score_terms,
                  MASKED: gl.constexpr):
    """One key tile's online-softmax update of raw scores s: (P, alpha that rescales O, new max, new sum).
    The max is kept on raw scores; exp2 takes s * scale * log2e - m * scale * log2e (one FFMA). `score_terms`: (cap
    or None, scale, ALiBi's (slope * log2e per row, distance shift) or None, the row's dropout.Dropout or None): with
    a cap the scores become cap * tanh(scale * s / cap) in log2 units first, with ALiBi scale * s in log2 units minus
    the bias (scale_log2 is then 1); with dropout P's dropped entries are zero (the sum l is taken before: the
    softmax's). MASKED: whether the tile needs the mask (True, False: no mask code), or None: the tile decides at run
    time."""
    cap, scale, bias, drop = score_terms
    if cap is not None:
        s = (hardware_tanh(s * (scale / cap)) * cap) * LOG2E    # in this order: cap * log2e may overflow fp32
    elif bias is not None:
        s = s * (scale * LOG2E)
    if bias is not None:    # (relative to the tile, as the mask: distance |(i - n0) + shift - column|)
        slope_log2, alibi_shift = bias
        s = s - gl.expand_dims(slope_log2, 1) * alibi_distance(gl.expand_dims(offs_m - n0, 1),
                                                                gl.expand_dims(offs_n, 0), alibi_shift)
    if MASKED is None:
        masked = mask.tile_needs_mask(m0, n0, len_k, shift, consts.ROWS, consts.BLOCK_N)
    else:
        masked = MASKED
    if masked:
        # (relative to the tile: columns 0..BLOCK_N - 1 against per-row bounds, no per-column key index)
        keep = mask.keep(gl.expand_dims(offs_m - n0, 1), gl.expand_dims(offs_n, 0), len_k - n0, shift)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_scaled = gl.where(m_new == float("-inf"), 0.0, m_new * scale_log2)   # a row with no key yet: P = 0
    p = gl.exp2(s * scale_log2 - gl.expand_dims(m_scaled, 1))
    alpha = gl.exp2(m_i * scale_log2 - m_scaled)
    l_new = l_i * alpha + gl.sum(p, 1)
    if drop is not None:
        p = gl.where(drop.keep(offs_m, n0, consts.BLOCK_N, consts.s_layout, False), p, 0.0)
    return p, alpha, m_new, l_new


@gluon.jit
def _unmasked_tiles(consts, mask, m0, len_q, len_k, shift, n_lo, n_tiles, start):
    """SPLIT_MASK: the consumer's key tiles [start, first) need the mask, [first, end) do not (every row of the
    warpgroup sees every key of them: gluon_common.Mask.unmasked_key_tiles), [end, n_tiles) do."""
    first, end = mask.unmasked_key_tiles(m0, consts.ROWS, len_q, len_k, shift, n_lo, n_tiles, consts.BLOCK_N)
    first = gl.maximum(first, start)
    return first, gl.maximum(end, first)


@gluon.jit
def _overlap_steps(consts, bufs, mask, q_tile, s_zero, keys, start, stop, carry, WARPGROUP: gl.constexpr,
                   MASKED: gl.constexpr):
    """OVERLAP: key tiles [start, stop), start > 0 (`_softmax_step`'s MASKED for each). `keys`: (offs_m, offs_n, m0,
    n_lo, len_k, shift, scale_log2, score_terms); `carry`: (P of tile start - 1, m, l, O, rounds), returned after tile
    stop - 1."""
    offs_m, offs_n, m0, n_lo, len_k, shift, scale_log2, score_terms = keys
    p, m_i, l_i, acc, rounds = carry
    for j in range(start, stop):
        rounds = _take_turn(consts, bufs.turn, rounds, WARPGROUP)
        s = _issue_s(consts, bufs, q_tile, s_zero, j, WARPGROUP)
        acc = _issue_pv(consts, p, bufs.v, j - 1, acc)
        _pass_turn(consts, bufs.turn, WARPGROUP)
        s = warpgroup_mma_wait(1, deps=(s,))
        bufs.k.release(j)
        p, alpha, m_i, l_i = _softmax_step(consts, mask, s, m_i, l_i, n_lo + j * consts.BLOCK_N, offs_m, offs_n,
                                           m0, len_k, shift, scale_log2, score_terms, MASKED)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        bufs.v.release(j - 1)
        acc = _rescale(acc, alpha, consts.o_layout)
    return p, m_i, l_i, acc, rounds


@gluon.jit
def _steps(consts, bufs, mask, q_tile, s_zero, keys, start, stop, state, WARPGROUP: gl.constexpr,
           MASKED: gl.constexpr):
    """Without OVERLAP: key tiles [start, stop), each S round, softmax and P V round in turn. `keys` as
    `_overlap_steps`'; `state`: (m, l, O, rounds), returned after tile stop - 1."""
    offs_m, offs_n, m0, n_lo, len_k, shift, scale_log2, score_terms = keys
    m_i, l_i, acc, rounds = state
    for j in range(start, stop):
        s, rounds = _s_round(consts, bufs, q_tile, s_zero, j, rounds, WARPGROUP)
        p, alpha, m_i, l_i = _softmax_step(consts, mask, s, m_i, l_i, n_lo + j * consts.BLOCK_N, offs_m, offs_n, m0,
                                           len_k, shift, scale_log2, score_terms, MASKED)
        acc = _rescale(acc, alpha, consts.o_layout)
        acc, rounds = _pv_round(consts, bufs, p, j, acc, rounds, WARPGROUP)
    return m_i, l_i, acc, rounds


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)


# ---- consumer partitions (default and worker: one warpgroup each) ------------------------------
@gluon.jit
def _consumer(consts, bufs, seqs, mask, outputs, sizes, terms, WARPGROUP: gl.constexpr):
    """Query rows [m0 + ROWS * WARPGROUP, + ROWS) of the CTA's tile. `outputs`: (o_desc, Out, Lse, (out row, lse
    batch, lse head) strides); `sizes`: the kernel's; `terms`: (the softcap or None, a learnable sink's fp32 (heads,)
    logits or None, ALiBi's (fp32 slopes, their batch stride) or None, dropout's (rng_state, p, query heads, first
    head) or None)."""
    o_desc, Out, Lse, strides = outputs
    cap, Sink, alibi, dropout = terms
    stride_out_row, stride_lse_b, stride_lse_h = strides
    head_dim_v, scale = sizes.head_dim, sizes.scale    # (the forward's sizes carry out's head dim: v's)
    m0_cta, b, head, q_row0, len_q, k_row0, len_k, shift, n_lo, n_tiles = _tile_schedule(consts, seqs, mask)
    ROWS: gl.constexpr = consts.ROWS
    m0 = m0_cta + WARPGROUP * ROWS
    dtype: gl.constexpr = bufs.q.dtype

    offs_m = m0 + gl.arange(0, ROWS, layout=consts.row_layout)
    offs_n = gl.arange(0, consts.BLOCK_N, layout=gl.SliceLayout(0, consts.s_layout))
    scale_log2 = scale * LOG2E
    # with a cap or ALiBi, _softmax_step's scores are in log2 units, which exp2 and lse take as they are
    if dropout is not None:
        drop = pattern_of(dropout, b, head)
    else:
        drop: gl.constexpr = dropout  # type: ignore[no-redef]  # (a constexpr None: partitions take no plain None)
    if alibi is not None:   # the head's slope in log2 units, per row; the distance's zero is the bottom-right diagonal
        Slopes, slope_batch = alibi
        slope_log2 = gl.load(Slopes + b.to(gl.int64) * slope_batch + head + offs_m * 0) * LOG2E
        score_terms = (cap, scale, (slope_log2, len_k - len_q), drop)
    else:
        score_terms = (cap, scale, alibi, drop)  # type: ignore[assignment]  # (alibi: None, a constant)
    if cap is not None or alibi is not None:
        scale_log2 = 1.0
        scale = 1.0 / LOG2E
    q_tile = slot(bufs.q, WARPGROUP)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, consts.row_layout)
    l_i = gl.zeros([ROWS], gl.float32, consts.row_layout)
    acc = gl.zeros([ROWS, consts.HEAD_DV], gl.float32, consts.o_layout)
    s_zero = gl.zeros([ROWS, consts.BLOCK_N], gl.float32, consts.s_layout)
    mbarrier.wait(bufs.q_ready, 0)   # also before an empty key range: the epilogue reuses the Q buffer
    rounds = 0   # matmul-issue rounds taken (PINGPONG)
    if consts.PINGPONG and WARPGROUP == consts.CONSUMERS - 1:
        _pass_turn(consts, bufs.turn, WARPGROUP)   # consumer 0 issues first

    # ---- online softmax over the visible key tiles ----
    keys = (offs_m, offs_n, m0, n_lo, len_k, shift, scale_log2, score_terms)
    if consts.OVERLAP:
        # S_{j+1} is issued before P V_j; the softmax of tile j + 1 overlaps P V_j.
        if n_tiles > 0:
            s, rounds = _s_round(consts, bufs, q_tile, s_zero, 0, rounds, WARPGROUP)
            p, _, m_i, l_i = _softmax_step(consts, mask, s, m_i, l_i, n_lo, offs_m, offs_n, m0, len_k, shift,
                                           scale_log2, score_terms, None)
            carry = (p, m_i, l_i, acc, rounds)
            if consts.SPLIT_MASK:
                first, end = _unmasked_tiles(consts, mask, m0, len_q, len_k, shift, n_lo, n_tiles, 1)
                carry = _overlap_steps(consts, bufs, mask, q_tile, s_zero, keys, 1, first, carry, WARPGROUP, True)
                carry = _overlap_steps(consts, bufs, mask, q_tile, s_zero, keys, first, end, carry, WARPGROUP, False)
                carry = _overlap_steps(consts, bufs, mask, q_tile, s_zero, keys, end, n_tiles, carry, WARPGROUP, True)
            else:
                carry = _overlap_steps(consts, bufs, mask, q_tile, s_zero, keys, 1, n_tiles, carry, WARPGROUP, None)
            p, m_i, l_i, acc, rounds = carry
            acc, rounds = _pv_round(consts, bufs, p, n_tiles - 1, acc, rounds, WARPGROUP)
    else:
        state = (m_i, l_i, acc, rounds)
        if consts.SPLIT_MASK:
            first, end = _unmasked_tiles(consts, mask, m0, len_q, len_k, shift, n_lo, n_tiles, 0)
            state = _steps(consts, bufs, mask, q_tile, s_zero, keys, 0, first, state, WARPGROUP, True)
            state = _steps(consts, bufs, mask, q_tile, s_zero, keys, first, end, state, WARPGROUP, False)
            state = _steps(consts, bufs, mask, q_tile, s_zero, keys, end, n_tiles, state, WARPGROUP, True)
        else:
            state = _steps(consts, bufs, mask, q_tile, s_zero, keys, 0, n_tiles, state, WARPGROUP, None)
        m_i, l_i, acc, rounds = state

    # ---- epilogue: O / l and lse; rows that see no key (and no sink, or a sink of -inf) get O = 0, lse = +inf ----
    alpha = 1.0     # what moves O to the max the sink may raise
    if Sink is not None:    # the sink as one more term of the row's softmax; m then in log2 units
        m_i, l_i, alpha = take_sink(m_i * scale_log2, l_i, gl.load(Sink + head + offs_m * 0) * LOG2E)
        scale = 1.0 / LOG2E
    empty = l_i == 0.0
    inv_l = gl.where(empty, 0.0, alpha / l_i)
    if dropout is not None:    # kept probabilities are scaled by 1 / (1 - p)
        inv_l = inv_l / (1.0 - drop.p)
    out = _rescale(acc, inv_l, consts.o_layout).to(dtype)
    lse = gl.where(empty, float("inf"), m_i * scale + gl.log2(gl.where(empty, 1.0, l_i)) / LOG2E)
    lse_rows = Lse + b.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h + offs_m
    if seqs.VARLEN:
        lse_rows += q_row0
    gl.store(lse_rows, lse, mask=offs_m < len_q)
    if m0 + ROWS <= len_q:
        # this warpgroup's S matmuls, the only readers of its Q, are done: O goes out through its buffer (the
        # TMA store writes the head's head_dim columns, not the padding)
        o_box, o_tile = _out_buffers(consts, bufs.q, o_desc, WARPGROUP)
        o_tile.store(out)
        fence_async_shared()
        tma_store(o_desc, [q_row0 + m0, head, 0], o_box)
        tma.store_wait(0)
    elif m0 < len_q:
        offs_r = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, consts.o_layout))
        offs_d = gl.arange(0, consts.HEAD_DV, layout=gl.SliceLayout(0, consts.o_layout))
        rows = (q_row0 + offs_r).to(gl.int64)
        ptrs = Out + gl.expand_dims(rows * stride_out_row, 1) + head * head_dim_v + gl.expand_dims(offs_d, 0)
        gl.store(ptrs, out, mask=gl.expand_dims(offs_r < len_q, 1) & gl.expand_dims(offs_d < head_dim_v, 0))


@gluon.jit
def _out_buffers(consts, q_bufs, o_desc, WARPGROUP: gl.constexpr):
    """The warpgroup's Q buffer as O's (rows, 1, HEAD_DV) box (the TMA store's source) and as its (rows, HEAD_DV)
    tile (the registers' destination): the buffer itself, or for a narrower v its first rows once the whole buffer is
    viewed in O's layout (a reinterpretation keeps the storage's size; a view is reshaped before it is sliced)."""
    if consts.HEAD_DV == consts.HEAD_D:
        box = q_bufs.index(WARPGROUP)
        tile = box.reshape([consts.ROWS, consts.HEAD_DV])
    else:
        rows: gl.constexpr = consts.ROWS * consts.HEAD_D // consts.HEAD_DV
        whole = reinterpret(q_bufs.index(WARPGROUP), q_bufs.dtype, [rows, 1, consts.HEAD_DV], o_desc.layout)
        box = whole.slice(0, consts.ROWS, dim=0)
        tile = whole.reshape([rows, consts.HEAD_DV]).slice(0, consts.ROWS, dim=0)
    return box, tile


# ---- the kernel ------------------------------------------------------------------------------
@gluon.jit
def attn_fwd_ws_kernel(q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc, o_desc, Out, Lse, cu_seqlens, schedule,
                       strides, sizes, window, softcap, Sink, alibi, dropout, TILE: gl.constexpr, CALL: gl.constexpr):
    """Grid: (query tiles, batch, query heads), or (query heads, batch, query tiles) with QUERY_MAJOR, or with a
    `schedule` (varlen: int32 (rows, 2) [sequence, query tile], else a constexpr None) (query heads, rows); num_warps =
    CONSUMER_WARPS (consumer 0). `cu_seqlens`: (q, k); `strides`: (out row, lse batch, lse head); `sizes`:
    launch.GluonSizes; `window`: (left, right); `softcap`: scores softcap * tanh(scale * q.k / softcap), or None;
    `Sink`: a learnable sink's fp32 (query heads,) logits, taken into each row's softmax, or None (None: a constant,
    the kernel compiles without the term); `alibi`: (fp32 (query heads,) or (batch, query heads) slopes, their batch
    stride (0 for (query heads,))), or None; `dropout`: (int64 [seed, offset] rng_state, p, the call's query
    heads, the launch's first query head) of core/dropout.py's pattern, or None; TILE: config.FwdWsTile; CALL:
    launch.GluonCall. See the module docstring."""
    consts = PartitionConstants(TILE, CALL.HEAD_D, v_desc.block_type.shape[2], CALL.QK_TAIL)
    seqlen_q, seqlen_k, group = sizes.seqlen_q, sizes.seqlen_k, sizes.group
    cu_seqlens_q, cu_seqlens_k = cu_seqlens
    seqs = Sequences(cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, CALL.VARLEN, schedule)
    if CALL.VARLEN:   # noqa: SIM102 (a constexpr branch: dense calls compile no cu_seqlens loads)
        if _past_sequence(seqs, consts):
            return
    dtype: gl.constexpr = q_desc.dtype
    CONSUMERS: gl.constexpr = consts.CONSUMERS
    NUM_STAGES: gl.constexpr = consts.NUM_STAGES
    # (rows, 1, HEAD_D) boxes of one head each (gluon_common.descriptor); `slot` views them 2-D
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, consts.ROWS, 1, consts.HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, consts.BLOCK_N, 1, consts.HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, consts.BLOCK_N, 1, consts.HEAD_DV], v_desc.layout)
    if consts.QK_TAIL:
        q_tail = gl.allocate_shared_memory(dtype, [CONSUMERS, consts.ROWS, 1, consts.QK_TAIL], q_tail_desc.layout)
        k_tail = gl.allocate_shared_memory(dtype, [NUM_STAGES, consts.BLOCK_N, 1, consts.QK_TAIL], k_tail_desc.layout)
    else:
        q_tail = q_smem
        k_tail = k_smem

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], bar_layout)   # PINGPONG: consumer i may issue
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)   # one arrival per consumer warpgroup
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    bufs = Buffers(q_smem, q_ready, Ring(k_smem, k_ready, k_empty, NUM_STAGES),  # type: ignore[call-arg]
                   Ring(v_smem, v_ready, v_empty, NUM_STAGES), turn,  # type: ignore[call-arg]
                   q_tail, Ring(k_tail, k_ready, k_empty, NUM_STAGES))  # type: ignore[call-arg]
    mask = Mask(window, CALL.MASK)
    outputs = (o_desc, Out, Lse, strides)
    if consts.QK_TAIL:
        descs = (q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc)
    else:   # (partitions take no plain None)
        descs = (q_desc, k_desc, v_desc)  # type: ignore[assignment]
    gl.warp_specialize(
        [(_consumer, (consts, bufs, seqs, mask, outputs, sizes, (softcap, Sink, alibi, dropout), wg))
         for wg in (0, 1, 2)[:CONSUMERS]]
        + [(_loader, (consts, bufs, seqs, mask, descs, group))],
        [CONSUMER_WARPS] * (CONSUMERS - 1) + [1], [TILE.consumer_regs] * (CONSUMERS - 1) + [TILE.loader_regs])


# ---- host side -------------------------------------------------------------------------------
def launch_spec(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, varlen: bool, batch: int, seqlen_q: int,
                seqlen_k: int, scale: float, mask: GluonMask, tile, schedule=None, softcap: float = 0.0,
                sink=None, alibi=None, dropout=None, qk_tail: int = 0) -> tuple[LaunchSpec, object]:
    """The launch of attn_fwd_ws_kernel for out (layout of q, v's head dim, which is at most q/k's) and lse ((b, h,
    s_q) or varlen (h, total_q)), and the tensor it writes: out itself, or a copy of it that a descriptor can view
    (launch copies it back). `schedule` (varlen only): the call's (sequence, query tile) items
    (varlen_schedule.build_schedule of a walk that owns query tiles of tile.block_m rows), run on a grid (query
    heads, items); None: the grid over every (batch, query tile). `softcap`: the scores' cap (0: none); `sink`: fp32
    (query heads,) logits of a learnable sink the kernel takes into its softmax, or None; `alibi`: (fp32 slopes
    (heads,) or (batch, heads), their batch stride) or None; `dropout`: (the call's int64 [seed, offset] rng_state,
    p, its query heads, the launch's first query head) or None; `qk_tail`: the columns of q/k's tail block
    (config.fwd_ws_qk_tail), 0: none."""
    group = q.shape[-2] // k.shape[-2]
    rows_per_consumer = tile.block_m // tile.consumers
    first = config.head_block(q.shape[-1] - qk_tail) if qk_tail else None    # the first block's columns
    (q, q_desc), (k, k_desc) = (uniform_descriptor(t, varlen, rows, first)
                                for t, rows in ((q, rows_per_consumer), (k, tile.block_n)))
    q_tail_desc, k_tail_desc = ((descriptor(t, varlen, rows, block_cols=qk_tail) if qk_tail else None)
                                for t, rows in ((q, rows_per_consumer), (k, tile.block_n)))
    v_desc = uniform_descriptor(v, varlen, tile.block_n)[1]
    target, out_desc = uniform_descriptor(out, varlen, rows_per_consumer)
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    query_tiles = triton.cdiv(seqlen_q, tile.block_m)
    grid: tuple[int, ...]
    if schedule is not None:
        assert varlen, "a schedule lists the items of a varlen call"
        grid = (q.shape[-2], schedule.shape[0])
    else:
        grid = (q.shape[-2], batch, query_tiles) if tile.query_major else (query_tiles, batch, q.shape[-2])
    return LaunchSpec(attn_fwd_ws_kernel, grid, dict(
        q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, q_tail_desc=q_tail_desc, k_tail_desc=k_tail_desc,
        o_desc=out_desc, Out=target, Lse=lse,
        cu_seqlens=(cu_seqlens_q, cu_seqlens_k) if varlen else (lse, lse), schedule=schedule,
        strides=(out_desc.strides[0], *lse_strides),   # target's row stride
        sizes=GluonSizes(seqlen_q, seqlen_k, out.shape[-1], group, scale), window=mask.window,
        softcap=softcap or None, Sink=sink, alibi=alibi, dropout=dropout, TILE=tile,
        CALL=GluonCall(q_desc.block_shape[-1], varlen, mask.flags, QK_TAIL=qk_tail)),
        CONSUMER_WARPS.value), target


def launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """One launch of attn_fwd_ws_kernel (launch_spec's keywords): out (layout of q) and lse."""
    spec, target = launch_spec(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, **kwargs)
    spec.launch()
    if target is not out:
        out.copy_(target)
