"""The warp-specialised backward's workers that bwd_ws.py and bwd_ws_split.py share: the kernels' prologue (their
aggregates from their arguments, the exit of a CTA with no work), the schedule every partition derives from the
program id, the loader partition (TMA loads of K, V and the Q/dO ring; lse·log2e
and delta staged in shared memory) and the dQ writer (TMA reduce-adds into the fp32 dq_accum, ordered in the
deterministic mode). bwd_ws.py's docstring describes the protocol."""


from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .. import config
from ..runtime.triton_versions import barrier, tma_load
from .gluon_common import LOG2E, Mask, Ring, Sequences, aggregate, slot


@aggregate
class PartitionConstants:
    """The constants every partition reads: the kernel's tile (config.WsTile: NUM_STAGES the Q/dO ring's, DQ_STAGES the
    dQ hand-off's buffers, NUM_WARPS the first MMA warpgroup's), the head dim in shared memory (HEAD_D), the
    deterministic mode, v's and dO's head dim in shared memory (HEAD_DV: HEAD_D's, or a narrower v's own), and DQ_PARTS,
    the dQ hand-off's column parts (one per MMA warpgroup that owns a part of the head dim: 2 in bwd_ws_split); with
    NAMED_BARRIERS (config.WsTile.named_barriers) the hardware barriers of the Q/dO ring's slots (from RING_BARRIER) and
    of the dQ hand-off's buffers (from DQ_BARRIER), each completed by NAMED_THREADS threads: the MMA partition's and one
    worker warp's (named_arrive, named_wait)."""
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    HEAD_D: gl.constexpr
    HEAD_DV: gl.constexpr
    QK_TAIL: gl.constexpr      # columns of q/k's tail block (GluonCall.QK_TAIL; 0: none): HEAD_D is then the first's
    NUM_STAGES: gl.constexpr
    DQ_STAGES: gl.constexpr
    DQ_PARTS: gl.constexpr
    NUM_WARPS: gl.constexpr
    DETERMINISTIC: gl.constexpr
    KEY_MAJOR: gl.constexpr
    NAMED_BARRIERS: gl.constexpr
    NAMED_THREADS: gl.constexpr
    RING_BARRIER: gl.constexpr
    DQ_BARRIER: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, TILE, HEAD_D, HEAD_DV, QK_TAIL, DETERMINISTIC, DQ_PARTS):
        for name in ("block_m", "block_n", "num_stages", "dq_stages", "num_warps", "key_major", "named_barriers"):
            setattr(self, name.upper(), gl.constexpr(getattr(TILE, name)))
        self.HEAD_D = gl.constexpr(HEAD_D)
        self.HEAD_DV = gl.constexpr(HEAD_DV)
        self.QK_TAIL = gl.constexpr(QK_TAIL)
        self.DETERMINISTIC = gl.constexpr(DETERMINISTIC)
        self.DQ_PARTS = gl.constexpr(DQ_PARTS)
        self.NAMED_THREADS = gl.constexpr(32 * (TILE.num_warps + 1))
        self.RING_BARRIER = gl.constexpr(config.NAMED_BARRIER_FIRST)
        self.DQ_BARRIER = gl.constexpr(config.NAMED_BARRIER_FIRST + TILE.num_stages)


@aggregate
class Buffers:
    """The loader's shared memory and barriers: K, V (behind kv_ready) and the Q/dO rings ((rows, 1, HEAD_D) boxes of
    one head; V's and dO's of HEAD_DV columns) with lse·log2e and delta beside them (q's ready barrier counts Q's
    bytes and the loader's lse/delta stores); Q and dO share their "empty" barriers, released by every MMA partition.
    `dq`: the dQ hand-off ring (ready: "dq_full", one arrival per part; empty: the writer's)."""
    q: Ring
    do: Ring
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    lse: gl.shared_memory_descriptor
    delta: gl.shared_memory_descriptor
    kv_ready: gl.shared_memory_descriptor
    dq: Ring
    q_tail: Ring               # with a q/k tail block (QK_TAIL): Q's and K's tail tiles and dQ's tail part, on the
    k_tail: gl.shared_memory_descriptor     # barriers of q, k and dq; else q, k and dq again (unread)
    dq_tail: Ring

    @gluon.jit
    def kv(self):
        """K and V, (BLOCK_N, 1, HEAD_D) and (BLOCK_N, 1, HEAD_DV) boxes of one head, as 2-D tiles."""
        return slot_of(self.k), slot_of(self.v)


@gluon.jit
def slot_of(box):
    """A (rows, 1, cols) box of one head as a (rows, cols) tile."""
    return box.reshape([box.shape[0], box.shape[2]])


@builtin
def tma_reduce_add(desc, coord, src, _semantic=None):
    """dst[coord] += src through the TMA engine. Gluon 3.6 has the op in its builder but no wrapper
    (tma.async_atomic_add arrives in Triton 3.8)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


# ---- hand-offs by hardware named barriers (config.WsTile.named_barriers) --------------------------------------
# Triton fences a one-thread mbarrier arrive with a barrier of the whole partition before it (the arrive must follow
# every thread's accesses) and one at the next shared-memory access after it (its analysis takes the arrive for an
# access to all of shared memory). A named barrier that every MMA thread arrives on and the worker warp waits on
# needs neither, and an arrive orders the thread's earlier memory accesses before the waiter's later ones. Gluon
# gives no shared-memory address of an mbarrier to arrive on from every thread (an inline asm takes no memdesc).
@gluon.constexpr_function
def _named_barrier_asm(op, threads):
    return gl.constexpr(f"barrier.{op} $1, {threads};\n mov.b32 $0, $1;")


@gluon.jit
def named_arrive(consts, barrier_id):
    """This thread arrives on hardware barrier `barrier_id` (a tensor) and goes on."""
    gl.inline_asm_elementwise(_named_barrier_asm("arrive", consts.NAMED_THREADS), "=r,r", [barrier_id],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def named_wait(consts, barrier_id):
    """This thread arrives on hardware barrier `barrier_id` (a tensor) and waits until it completes."""
    gl.inline_asm_elementwise(_named_barrier_asm("sync", consts.NAMED_THREADS), "=r,r", [barrier_id],
                              dtype=gl.int32, is_pure=False, pack=1)


# ---- schedule: which (query head, query tile) pairs a key tile visits --------------------------
@gluon.jit
def cta_coords(seqs, KEY_MAJOR: gl.constexpr):
    """(key tile, batch, kv head, kv heads) of this CTA. The grid is (key tiles, batch, kv heads), or with
    KEY_MAJOR (kv heads, batch, key tiles): CTAs start in grid order, x fastest, so key-major starts every head's
    first key tiles, the longest under a causal mask, before any head's later ones (longest first). With a schedule
    (`seqs.schedule`, varlen_schedule.py) the grid is (kv heads, schedule rows), heads fastest, and the row names the
    sequence and key tile: every head's items in the schedule's order, the most query tiles first."""
    if seqs.schedule is not None:
        b, n_tile = seqs.scheduled_item()
        kv_head = gl.program_id(0)
        kv_heads = gl.num_programs(0)
    else:
        TILE_AXIS: gl.constexpr = 2 if KEY_MAJOR else 0
        HEAD_AXIS: gl.constexpr = 0 if KEY_MAJOR else 2
        n_tile = gl.program_id(TILE_AXIS)
        b = gl.program_id(1)
        kv_head = gl.program_id(HEAD_AXIS)
        kv_heads = gl.num_programs(HEAD_AXIS)
    return n_tile, b, kv_head, kv_heads


@gluon.jit
def tile_schedule(consts, seqs, mask):
    """Everything every partition derives from the program id, computed the same way in each."""
    n_tile, b, kv_head, _ = cta_coords(seqs, consts.KEY_MAJOR)
    n0 = n_tile * consts.BLOCK_N
    q_row0, len_q = seqs.query(b)
    k_row0, len_k = seqs.key(b)
    shift = mask.shift(len_q, len_k)
    m_lo, m_hi = mask.query_range(n0, len_q, shift, consts.BLOCK_M, consts.BLOCK_N)
    m_tiles = gl.maximum(gl.cdiv(m_hi - m_lo, consts.BLOCK_M), 0)
    return n0, b, kv_head, q_row0, len_q, k_row0, len_k, shift, m_lo, m_tiles


@gluon.jit
def step_slope(alibi, b, kv_head, group, step, m_tiles):
    """ALiBi's slope (times log2 e) of the query head of `step` (a CTA walks its kv head's group head by head, the
    query tiles of each in turn); `alibi`: (fp32 slopes, their batch stride)."""
    Slopes, slope_batch = alibi
    return gl.load(Slopes + b.to(gl.int64) * slope_batch + kv_head * group + step // m_tiles) * LOG2E


# ---- the kernels' shared prologue ------------------------------------------------------------------
@gluon.jit
def prologue(TILE, CALL, DQ_PARTS: gl.constexpr, cu_seqlens, schedule, sizes, window, v_desc):
    """(PartitionConstants, Sequences, Mask) of a kernel from its arguments (bwd_ws.attn_bwd_ws_kernel's; DQ_PARTS:
    PartitionConstants's; HEAD_DV from v's box)."""
    cu_seqlens_q, cu_seqlens_k = cu_seqlens
    seqs = Sequences(cu_seqlens_q, cu_seqlens_k, sizes.seqlen_q, sizes.seqlen_k, CALL.VARLEN, schedule)
    consts = PartitionConstants(TILE, CALL.HEAD_D, v_desc.block_type.shape[2], CALL.QK_TAIL, CALL.DETERMINISTIC,
                                DQ_PARTS)
    return consts, seqs, Mask(window, CALL.MASK)


@gluon.jit
def past_sequence(consts, seqs):
    """Whether this CTA has nothing to do: a varlen CTA whose row of the schedule is padding, or without one whose key
    tile starts past its sequence; a constexpr False for a dense call (which compiles no cu_seqlens loads)."""
    past = False
    if seqs.VARLEN:
        if seqs.schedule is not None:
            past = seqs.scheduled_item()[0] < 0
        else:
            n_tile, b, _, _ = cta_coords(seqs, consts.KEY_MAJOR)
            past = n_tile * consts.BLOCK_N >= gl.load(seqs.cu_seqlens_k + b + 1) - gl.load(seqs.cu_seqlens_k + b)
    return past


@gluon.jit
def allocate(consts, q_desc, k_desc, v_desc, do_desc, dq_desc, tail_descs, RELEASES: gl.constexpr):
    """The workers' Buffers; `tile_empty` (the Q/dO rings' "empty") completes with RELEASES arrivals, one per MMA
    partition; `tail_descs`: (q tail, k tail, dq tail) descriptors with a q/k tail block, else None."""
    BLOCK_M: gl.constexpr = consts.BLOCK_M
    HEAD_D: gl.constexpr = consts.HEAD_D
    NUM_STAGES: gl.constexpr = consts.NUM_STAGES
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, 1, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, 1, consts.HEAD_DV], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [consts.BLOCK_N, 1, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [consts.BLOCK_N, 1, consts.HEAD_DV], v_desc.layout)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], rows_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], rows_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    tile_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=2)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(tile_empty.index(i), count=RELEASES)
    mbarrier.init(kv_ready, count=1)

    # the dQ writer's fp32 buffers: DQ_STAGES x DQ_PARTS of HEAD_D / DQ_PARTS columns (with a q/k tail block: of
    # HEAD_D, the first block's, and the tail part's apart)
    DQ_STAGES: gl.constexpr = consts.DQ_STAGES
    DQ_PARTS: gl.constexpr = consts.DQ_PARTS
    MAIN_PARTS: gl.constexpr = main_dq_parts(consts)
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_STAGES * MAIN_PARTS, BLOCK_M, 1, HEAD_D // MAIN_PARTS],
                                        dq_desc.layout)
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], bar_layout)
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], bar_layout)
    for i in gl.static_range(DQ_STAGES):
        mbarrier.init(dq_full.index(i), count=DQ_PARTS)
        mbarrier.init(dq_empty.index(i), count=1)
    q_ring = Ring(q_smem, q_ready, tile_empty, NUM_STAGES)  # type: ignore[call-arg]
    dq_ring = Ring(dq_smem, dq_full, dq_empty, DQ_STAGES)  # type: ignore[call-arg]
    if consts.QK_TAIL:
        q_tail_desc, k_tail_desc, dq_tail_desc = tail_descs
        QK_TAIL: gl.constexpr = consts.QK_TAIL
        q_tail = Ring(gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, 1, QK_TAIL], q_tail_desc.layout),  # type: ignore[call-arg]
                      q_ready, tile_empty, NUM_STAGES)
        k_tail = gl.allocate_shared_memory(dtype, [consts.BLOCK_N, 1, QK_TAIL], k_tail_desc.layout)
        dq_tail = Ring(gl.allocate_shared_memory(gl.float32, [DQ_STAGES, BLOCK_M, 1, QK_TAIL], dq_tail_desc.layout),  # type: ignore[call-arg]
                       dq_full, dq_empty, DQ_STAGES)
    else:
        q_tail = q_ring
        k_tail = k_smem
        dq_tail = dq_ring
    return Buffers(q_ring, Ring(do_smem, do_ready, tile_empty, NUM_STAGES), k_smem, v_smem, lse_smem,  # type: ignore[call-arg]
                   delta_smem, kv_ready, dq_ring, q_tail, k_tail, dq_tail)


@gluon.constexpr_function
def main_dq_parts(consts):
    """The dQ parts in the main dQ buffers: all of them, or with a q/k tail block the first block's only."""
    return gl.constexpr(1 if consts.QK_TAIL else consts.DQ_PARTS)


# ---- loader partition ------------------------------------------------------------------------
@gluon.jit
def loader(consts, bufs, seqs, mask, descs, rows, group):
    """`descs`: (q, k, v, dO) descriptors, and the (q tail, k tail, dq tail) ones or None; `rows`: (Lse, Delta,
    (batch, head) strides of both)."""
    q_desc, k_desc, v_desc, do_desc, tail_descs = descs
    Lse, Delta, stride_lse = rows
    stride_lse_b, stride_lse_h = stride_lse
    BLOCK_M: gl.constexpr = consts.BLOCK_M
    NUM_STAGES: gl.constexpr = consts.NUM_STAGES
    n0, b, kv_head, q_row0, len_q, k_row0, len_k, shift, m_lo, m_tiles = tile_schedule(consts, seqs, mask)
    if consts.QK_TAIL:
        q_tail_desc, k_tail_desc, _ = tail_descs
        mbarrier.expect(bufs.kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes
                        + k_tail_desc.block_type.nbytes)
        tma_load(k_tail_desc, [k_row0 + n0, kv_head, consts.HEAD_D], bufs.kv_ready, bufs.k_tail)
    else:
        mbarrier.expect(bufs.kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [k_row0 + n0, kv_head, 0], bufs.kv_ready, bufs.k)
    tma_load(v_desc, [k_row0 + n0, kv_head, 0], bufs.kv_ready, bufs.v)
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    offs_m_tile = gl.arange(0, BLOCK_M, layout=row_layout)
    if seqs.VARLEN:
        Lse += q_row0
        Delta += q_row0
    steps = m_tiles * group
    q_ready = bufs.q.ready
    do_ready = bufs.do.ready
    for step in range(steps):
        stage = step % NUM_STAGES
        phase = (step // NUM_STAGES) & 1
        head = kv_head * group + step // m_tiles
        m0 = m_lo + (step % m_tiles) * BLOCK_M
        if consts.NAMED_BARRIERS:
            if step >= NUM_STAGES:   # the slot's previous tile is released
                named_wait(consts, consts.RING_BARRIER + stage)
        else:
            mbarrier.wait(bufs.q.empty.index(stage), phase ^ 1)
        if consts.QK_TAIL:
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + q_tail_desc.block_type.nbytes)
            tma_load(q_tail_desc, [q_row0 + m0, head, consts.HEAD_D], q_ready.index(stage),
                     bufs.q_tail.bufs.index(stage))
        else:
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_row0 + m0, head, 0], q_ready.index(stage),
                                        bufs.q.bufs.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
        tma_load(do_desc, [q_row0 + m0, head, 0], do_ready.index(stage),
                                        bufs.do.bufs.index(stage))
        # lse (times log2 e) and delta of the tile's rows beside Q, behind q_ready's second arrival; rows past
        # the sequence get lse = +inf (P = 0) and delta = 0.
        offs_m = m0 + offs_m_tile
        row_ok = offs_m < len_q
        head_offset = b.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h
        bufs.lse.index(stage).store(gl.load(Lse + head_offset + offs_m, mask=row_ok, other=float("inf")) * LOG2E)
        bufs.delta.index(stage).store(gl.load(Delta + head_offset + offs_m, mask=row_ok, other=0.0))
        mbarrier.arrive(q_ready.index(stage), count=1)
    if consts.NAMED_BARRIERS:   # complete the last tiles' releases: a CTA ends with no barrier half arrived
        for step in range(gl.maximum(steps - NUM_STAGES, 0), steps):
            named_wait(consts, consts.RING_BARRIER + step % NUM_STAGES)


# ---- dQ writer partition ---------------------------------------------------------------------
@gluon.jit
def _bulk_wait_all(token):
    """Wait until every bulk async copy of this thread has completed (its writes done, not only its
    reads of shared memory as tma.store_wait), then order them before later generic-proxy accesses."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n fence.proxy.async.global;\n mov.b32 $0, $1;",
                                     "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def dq_writer(consts, bufs, seqs, mask, dq_descs, Sem, group, sem_m_tiles):
    """Per step: the query tile's dQ, in DQ_PARTS buffers of HEAD_D / DQ_PARTS columns each (bwd_ws_split.py
    hands it over in halves; with a q/k tail block in the first block's and the tail's), reduce-added into dq_accum.
    `dq_descs`: dq_accum's descriptor and the (q tail, k tail, dq_accum tail) descriptors or None."""
    dq_desc, tail_descs = dq_descs
    BLOCK_M: gl.constexpr = consts.BLOCK_M
    BLOCK_N: gl.constexpr = consts.BLOCK_N
    DQ_STAGES: gl.constexpr = consts.DQ_STAGES
    MAIN_PARTS: gl.constexpr = main_dq_parts(consts)
    n0, b, kv_head, q_row0, len_q, k_row0, len_k, shift, m_lo, m_tiles = tile_schedule(consts, seqs, mask)
    n_tile, _, _, kv_heads = cta_coords(seqs, consts.KEY_MAJOR)
    heads = kv_heads * group
    for step in range(m_tiles * group):
        stage = step % DQ_STAGES
        phase = (step // DQ_STAGES) & 1
        head = kv_head * group + step // m_tiles
        m0 = m_lo + (step % m_tiles) * BLOCK_M
        if consts.NAMED_BARRIERS:
            named_wait(consts, consts.DQ_BARRIER + stage)
        else:
            mbarrier.wait(bufs.dq.ready.index(stage), phase)
        if consts.DETERMINISTIC:
            # Key tiles add into a query tile in ascending order: tile n waits until the tiles before it
            # that see this query tile (from the first one, Mask.first_key_tile) have added theirs.
            turn = n_tile - mask.first_key_tile(m0, shift, BLOCK_N)
            sem = Sem + ((b * heads + head) * sem_m_tiles + m0 // BLOCK_M)
            while gl.atomic_add(sem, 0, sem="acquire") != turn:
                pass
        for part in gl.static_range(MAIN_PARTS):
            tma_reduce_add(dq_desc, [q_row0 + m0, head, part * (consts.HEAD_D // MAIN_PARTS)],
                           bufs.dq.bufs.index(stage * MAIN_PARTS + part))
        if consts.QK_TAIL:
            tma_reduce_add(tail_descs[2], [q_row0 + m0, head, consts.HEAD_D], bufs.dq_tail.bufs.index(stage))
        if consts.DETERMINISTIC:
            _bulk_wait_all(step)
            gl.atomic_add(sem, 1, sem="release")
        else:
            tma.store_wait(0)   # the engine has read the buffer
        mbarrier.arrive(bufs.dq.empty.index(stage), count=1)


@gluon.jit
def release_slot(consts, bufs, step):
    """The MMA partition is done with the Q/dO slot of `step`: one arrival on "tile_empty" (every thread's on the
    slot's named barrier)."""
    if consts.NAMED_BARRIERS:
        named_arrive(consts, consts.RING_BARRIER + step % consts.NUM_STAGES)
    else:
        bufs.q.release(step)


@gluon.jit
def hand_dq(consts, bufs, dq, scale, step, PART: gl.constexpr):
    """Hand step's dQ (scaled; its part PART of consts.DQ_PARTS) to the writer once its buffer is free: every warp's
    rows in shared memory, then one arrival on "dq_full" (every thread's on the buffer's named barrier)."""
    dq_stage = step % consts.DQ_STAGES
    mbarrier.wait(bufs.dq.empty.index(dq_stage), ((step // consts.DQ_STAGES) & 1) ^ 1)
    if consts.DQ_PARTS == 1:
        slot(bufs.dq.bufs, dq_stage).store(dq * scale)
    elif consts.QK_TAIL:    # the first block's part, or the tail's
        if PART == 0:
            slot(bufs.dq.bufs, dq_stage).store(dq * scale)
        else:
            slot(bufs.dq_tail.bufs, dq_stage).store(dq * scale)
    else:
        slot(bufs.dq.bufs, dq_stage * consts.DQ_PARTS + PART).store(dq * scale)
    fence_async_shared()
    if consts.NAMED_BARRIERS:
        named_arrive(consts, consts.DQ_BARRIER + dq_stage)
    else:
        barrier()   # every warp's dQ is in shared memory
        mbarrier.arrive(bufs.dq.ready.index(dq_stage), count=1)


# ---- epilogue of the MMA partitions -------------------------------------------------------------
@gluon.jit
def store_dkv(dk, dv, grads, n0, b, kv_head, k_row0, len_k, sizes, scale, DK_COL0: gl.constexpr,
              DV_COL0: gl.constexpr, VARLEN: gl.constexpr):
    """dK (scaled) and dV, fp32 accumulators of (key rows, columns from DK_COL0 / DV_COL0: bwd_ws_split's warpgroups
    hold a part of each) in the output dtype: rows of this sequence only, columns below q/k's head dim (dK) and v's
    (dV) only, not the shared-memory padding. `grads`: (dK, dV, their (batch, row, head) strides, v's head dim or
    None: q/k's); `sizes`: launch.GluonSizes."""
    dK, dV, strides, head_dim_v = grads
    stride_dk, stride_dv = strides
    if head_dim_v is None:
        head_dim_v = sizes.head_dim
    dk_ptrs, dk_keep = _row_pointers(dk, dK, stride_dk, n0, b, kv_head, k_row0, len_k, sizes.head_dim,
                                     DK_COL0, VARLEN)
    dv_ptrs, dv_keep = _row_pointers(dv, dV, stride_dv, n0, b, kv_head, k_row0, len_k, head_dim_v,
                                     DV_COL0, VARLEN)
    gl.store(dk_ptrs, (dk * scale).to(dK.dtype.element_ty), mask=dk_keep)
    gl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=dv_keep)


@gluon.jit
def _row_pointers(acc, Out, strides, n0, b, kv_head, k_row0, len_k, cols, COL0: gl.constexpr, VARLEN: gl.constexpr):
    """Where one kv head's (key rows n0..., columns COL0...) accumulator `acc` goes in Out, and the mask of the
    sequence's rows and the columns below `cols`."""
    stride_b, stride_r, stride_h = strides
    layout: gl.constexpr = acc.type.layout
    offs_r = n0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    offs_d = COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    keep = gl.expand_dims(offs_r < len_k, 1) & gl.expand_dims(offs_d < cols, 0)
    rows = offs_r.to(gl.int64)
    if VARLEN:
        rows += k_row0
    ptrs = (Out + b.to(gl.int64) * stride_b + kv_head * stride_h + gl.expand_dims(rows * stride_r, 1)
            + gl.expand_dims(offs_d, 0))
    return ptrs, keep
