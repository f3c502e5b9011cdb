"""The Triton backend's kernels as operators, fastest first: FORWARD and BACKWARD at the end of this file.

Each operator is one kernel variant and declares, as data, what it runs: the capabilities every backend declares
(dtypes, mask kinds, features, fp32 results: backends/base.py turns them into words), the GPU architectures and
Triton releases it compiles for, the head dims of its own tile table, where the default setting runs it (head dims,
and per head block the shortest longest-sequence: where it measured faster than the operator after it) and the
TritonBackend setting that forces it (True) or turns it off (False). Then its tile, its workspace (`buffers`) and its
launches (`run`).

A call runs the first operator of its role with no reasons (`TritonBackend.operator`); `TritonBackend.kernel_choice`
(the forward's `forward_kernel`, a backward plan's `kernel`) names it and every operator before it with its reasons.
Adding a kernel variant: its kernel module, an operator class here, and its place in a list.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...core.errors import KernelCompileError
from ...core.mask import WINDOW_MASK_KINDS, MaskKind, MaskType
from ...core.plan import BufferSpec
from ...core.problem import AttentionParams, AttentionProblem
from ..base import Capabilities, declared_reasons
from . import config
from .gluon.bwd_ws_shapes import semaphore_tiles
from .runtime import launch, target, triton_versions

if TYPE_CHECKING:
    from .runtime.varlen_schedule import TileWalk

_MISSING = object()


def per_problem(owners: int):
    """A method `(*owners, problem, *arguments)` whose result follows from those alone (`owners`: the backend, or an
    operator and the backend), computed once per problem: kept in `problem.memo` under (owners, method, arguments).
    The pipeline reuses a problem per call signature, so a repeated call decides nothing again; a backend's settings
    are fixed once it is made (TritonBackend.__setattr__). Results are immutable (tuples, named tuples, frozen
    dataclasses)."""
    def decorate(method):
        name = method.__name__

        @functools.wraps(method)
        def memoised(*args):
            p = args[owners]
            key = (*args[:owners], name, *args[owners + 1:])
            found = p.memo.get(key, _MISSING)
            if found is _MISSING:
                found = p.remember(key, method(*args))
            return found
        return memoised
    return decorate


# Operators (by name) whose kernel failed to compile in this process, with the reason their refusal gives: such a
# call ran, and every later one runs, on the next operator.
FAILED_TO_COMPILE: dict[str, str] = {}
_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """A RuntimeWarning, once per process for each message: a Gluon kernel gives way to a one-launch one."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(f"flash_attn_ck: {message}", RuntimeWarning, stacklevel=4)


def failed_to_compile(operator: type[Operator], error: KernelCompileError) -> None:
    """Note that `operator`'s kernel failed to compile (every later call refuses it in words), and warn once."""
    FAILED_TO_COMPILE[operator.name] = f"{error.kernel_name} failed to compile with Triton " \
                                       f"{triton_versions.installed()} ({error.first_error})"
    warn_once(f"{FAILED_TO_COMPILE[operator.name]}; its calls run on the one-launch Triton kernels")


class Operator(Capabilities):
    """One kernel variant: its declarations (class attributes), tile, workspace and launches. Subclasses of
    ForwardOperator and BackwardOperator."""
    name: ClassVar[str]
    role: ClassVar[str]                     # "forward" or "backward"
    # Each kernel rebuilds its diagonal per sequence from the alignment and left/right; none takes CK's generic (y, x).
    mask_kinds: ClassVar[frozenset[MaskKind]] = WINDOW_MASK_KINDS
    fp32_outputs_refusal: ClassVar[str | None] = None
    # Major compute capabilities it compiles for (None: any CUDA GPU, and the interpreter).
    architectures: ClassVar[frozenset[int] | None] = None
    architecture_refusal: ClassVar[str] = ""
    # Whether it runs only under the Triton releases the backend's tests cover (triton_versions.gluon_refusal).
    tested_releases_only: ClassVar[bool] = False
    # A forward's: whether its kernel takes the learnable sink into its softmax (Backend.forward_takes_sink); else the
    # pipeline folds the sink around it.
    takes_sink: ClassVar[bool] = False
    # The TritonBackend setting that forces it (True) or turns it off (False); None: neither.
    option: ClassVar[str | None] = None
    # Its tile table, keyed by head block (config.head_block); None: a tile for every head dim.
    tiles: ClassVar[Mapping[int, Any] | None] = None
    # Where the default setting runs it: these head dims (None: every one with a tile), from these longest-sequence
    # lengths per head block (absent: any length); and why not elsewhere.
    default_head_dims: ClassVar[frozenset[int] | None] = None
    slower_head_dim: ClassVar[str] = ""
    min_seqlen: ClassVar[Mapping[int, int]] = {}
    shorter: ClassVar[str] = ""
    # Whether it needs a positive softmax scale (a kernel that takes the running max on raw scores).
    positive_scale: ClassVar[bool] = False

    @classmethod
    def setting(cls, backend) -> bool | None:
        """The backend's setting for this operator: True forces it where it can run, False turns it off, None runs
        it where the defaults say."""
        return getattr(backend, cls.option) if cls.option else None

    @classmethod
    @per_problem(owners=2)
    def reasons(cls, backend, p: AttentionProblem) -> tuple[str, ...]:
        """Why this operator does not run the call under `backend`'s settings, in words (empty: it may)."""
        setting = cls.setting(backend)
        if setting is False:
            return (f"turned off (TritonBackend({cls.option}={getattr(backend, cls.option or '')!r}))",)
        reasons = []
        architecture = target.architecture(p.device)
        if cls.architectures is not None and architecture not in cls.architectures:
            reasons.append(cls.architecture_refusal)
        elif cls.tested_releases_only and setting is not True and (outside := triton_versions.gluon_refusal()):
            warn_once(f"{outside}: the one-launch Triton kernels run instead (TritonBackend(fwd_ws=True, ws=True) "
                      "forces them)")
            reasons.append(outside)
        if cls.name in FAILED_TO_COMPILE:
            reasons.append(FAILED_TO_COMPILE[cls.name])
        reasons += declared_reasons(cls, p)
        d, block = p.head_dim_padded, config.head_block(p.head_dim_padded)
        if cls.tiles is not None and block not in cls.tiles:
            if p.head_dim <= cls.max_head_dim:     # else declared_reasons said so
                reasons.append(f"head dim {d}: the kernel has tiles for head dims (padded to a power of two) "
                               f"{sorted(cls.tiles)}")
        elif setting is None and cls.default_head_dims is not None and d not in cls.default_head_dims:
            reasons.append(f"head dim {d}: {cls.slower_head_dim}")
        elif setting is None and max(p.seqlen_q, p.seqlen_k) < (shortest := cls.min_seqlen.get(block, 0)):
            reasons.append(f"sequences shorter than {shortest}: {cls.shorter}")
        if cls.positive_scale and p.softmax_scale <= 0:
            reasons.append(f"softmax scale {p.softmax_scale} (the kernel takes the running max on raw scores)")
        return tuple(reasons + cls.extra_reasons(backend, p, setting))

    @classmethod
    def extra_reasons(cls, backend, p: AttentionProblem, setting: bool | None) -> list[str]:
        """Refusals beyond the declarations (`setting`: `cls.setting(backend)`)."""
        return []

    @classmethod
    def describe(cls, backend, p: AttentionProblem) -> str:
        """The kernel and how it runs the call, in a few words."""
        raise NotImplementedError


class GluonOperator(Operator):
    """What the warp-specialised Gluon kernels share: sm_90 only, the tested Triton releases only, input-dtype results,
    the softcap and ALiBi, and dropout where a subclass takes it (each by default only where measured faster); the
    mask as gluon_common.Mask takes it, and the varlen schedule of their tiles."""
    supports_alibi = supports_softcap = True
    supports_dropout = False
    # Head blocks where the defaults run its softcap calls (None: wherever it takes them), and its dropout calls (where
    # it takes dropout).
    softcap_head_blocks: ClassVar[frozenset[int] | None] = None
    dropout_head_blocks: ClassVar[frozenset[int]] = frozenset()
    # A v wider than q/k is refused (`wider_value_refusal` says why). A narrower one runs at its own head dim (V, O, dO
    # and dV tiles of v's head block), by default in the head blocks (q/k's) of `narrower_value_head_blocks` (where
    # that measured faster than `previous`, the kernel that runs it otherwise), forced on anywhere.
    value_head_dim_refusal = None
    wider_value_refusal: ClassVar[str] = "the kernel has one head block"
    narrower_value_head_blocks: ClassVar[frozenset[int]] = frozenset()
    previous: ClassVar[str]
    fp32_outputs_refusal = "its TMA stores go through shared tiles of the input dtype"
    architectures = frozenset({9})
    architecture_refusal = "needs an sm_90 GPU (Gluon wgmma/TMA kernel)"
    tested_releases_only = True

    @classmethod
    def extra_reasons(cls, backend, p: AttentionProblem, setting: bool | None) -> list[str]:
        """A v wider than q/k; and what it takes but the defaults leave to the one-launch kernels where it was not
        measured faster (config.FWD_WS_SOFTCAP_HEAD_BLOCKS, BWD_WS_SPLIT_SOFTCAP_HEAD_BLOCKS,
        FWD_WS_DROPOUT_HEAD_BLOCKS, BWD_WS_DROPOUT_HEAD_BLOCKS, WS_ALIBI_TRITON_RELEASES, the operator's
        narrower_value_head_blocks); its setting forced on runs those here."""
        reasons, forced = [], f"(TritonBackend({cls.option}=True) runs it)"
        if p.head_dim_v_padded > p.head_dim_padded:
            reasons.append(f"value head dim {p.head_dim_v} above q/k's {p.head_dim}: {cls.wider_value_refusal}")
        if setting is not None:
            return reasons
        block = config.head_block(p.head_dim_padded)
        if p.softcap != 0.0 and cls.softcap_head_blocks is not None and block not in cls.softcap_head_blocks:
            reasons.append(f"softcap at head dim {p.head_dim_padded}: not measured faster than the one-launch kernel "
                           f"there {forced}")
        if p.dropout_p > 0 and cls.supports_dropout and block not in cls.dropout_head_blocks:
            reasons.append(f"dropout at head dim {p.head_dim_padded}: not measured faster than the one-launch kernel "
                           f"there {forced}")
        version = triton_versions.installed()
        if p.has_alibi and triton_versions.release(version) not in config.WS_ALIBI_TRITON_RELEASES:
            reasons.append(f"ALiBi under Triton {version}: not measured faster than the one-launch kernels there "
                           f"{forced}")
        if p.head_dim_v_padded < p.head_dim_padded and block not in cls.narrower_value_head_blocks:
            reasons.append(f"value head dim {p.head_dim_v} below q/k's {p.head_dim}: not measured faster than "
                           f"{cls.previous} at head block {block} {forced}")
        return reasons

    @staticmethod
    def value_notes(p: AttentionProblem, tensors: str) -> list[str]:
        """The plan line's note on a narrower v (`tensors`: what the kernel takes at v's width), if any."""
        if p.head_dim_v_padded < p.head_dim_padded:
            return [f"{tensors} at v's own head block {config.head_block(p.head_dim_v_padded)}"]
        return []

    @classmethod
    def tile(cls, backend, p: AttentionProblem) -> Any:
        raise NotImplementedError

    @classmethod
    @per_problem(owners=2)
    def mask(cls, backend, p: AttentionProblem) -> launch.GluonMask:
        """The call's mask as the kernels' launch functions (fwd_ws.launch, bwd_ws.launch) take it."""
        m = mask_args(p)
        return launch.GluonMask((m["window_left"], m["window_right"]),
                                launch.MaskFlags(m["TOP_LEFT"], m["HAS_LEFT"], m["HAS_RIGHT"]))

    @classmethod
    @per_problem(owners=2)
    def schedule_walk(cls, backend, p: AttentionProblem) -> tuple[TileWalk, int] | None:
        """(varlen_schedule.TileWalk, bound) of the schedule this operator's launch of the call runs, or None where it
        keeps the grid over every (batch, tile): varlen_schedule off (None: config.VARLEN_SCHEDULE), a dense call, more
        items than a grid's y dimension takes, or a deterministic backward with a left window bound.

        The walk is the launch's: forward CTAs own query tiles of the tile's block_m rows and walk key tiles of
        block_n, backward CTAs own key tiles of block_n and walk query tiles of block_m; the window is the kernels'
        own (`mask`: its bounds where its flags set them, bottom-right unless top-left). The bound is known from
        shapes (varlen_schedule.schedule_bound of the owned axis's rows): no host sync.

        Deterministic backward: the writer of key tile n adds into a query tile only after every key tile of the
        sequence before n that sees it has added, so a CTA waits on CTAs of the same sequence and kv head with lower
        key tiles. That cannot hang if each of those starts no later than the waiter (CTAs start in grid order, as the
        key-major grid already relies on): within a kv head the schedule's order is steps descending, ties in
        (sequence, tile) order, so it holds when a sequence's steps never increase with the key tile. Without a left
        bound a key tile sees queries [lo(n), len_q) with lo non-decreasing in n (0 without a right bound): its steps
        never increase, and the ordered adds keep the grid's order, bit for bit. With a left bound the first key tiles
        see more query tiles as n grows (their windows are cut at query 0), so a later tile would start first and wait
        on an earlier one behind it: those calls keep the grid."""
        setting = config.VARLEN_SCHEDULE if backend.varlen_schedule is None else backend.varlen_schedule
        if not setting or not p.varlen:
            return None
        from .runtime.varlen_schedule import TileWalk, schedule_bound  # Triton's: imported where a kernel runs
        mask, tile = cls.mask(backend, p), cls.tile(backend, p)
        owns_keys = cls.role == "backward"
        if owns_keys and p.deterministic and mask.flags.HAS_LEFT:
            return None
        own, walk, rows = (tile.block_n, tile.block_m, p.total_k) if owns_keys else \
            (tile.block_m, tile.block_n, p.total_q)
        bound = schedule_bound(rows, p.batch, own)
        if bound > config.GRID_Y_MAX:
            return None
        left, right = mask.window
        return TileWalk(own, walk, owns_keys=owns_keys, left=left if mask.flags.HAS_LEFT else -1,
                        right=right if mask.flags.HAS_RIGHT else -1, top_left=mask.flags.TOP_LEFT), bound

    @classmethod
    def schedule(cls, backend, p: AttentionProblem, params: AttentionParams) -> torch.Tensor | None:
        """The call's schedule (`schedule_walk`), built on the device, or None."""
        found = cls.schedule_walk(backend, p)
        if found is None:
            return None
        from .runtime.varlen_schedule import build_schedule
        assert params.cu_seqlens_q is not None and params.cu_seqlens_k is not None
        return build_schedule(params.cu_seqlens_q, params.cu_seqlens_k, *found)


def mask_args(p: AttentionProblem) -> dict:
    """The mask's window bounds (>= 0) and flags, by the names the kernels' Features and ScoreArgs give them."""
    m = p.mask
    masked = m.type != MaskType.NO_MASK
    return dict(window_left=max(m.left, 0), window_right=max(m.right, 0), TOP_LEFT=m.type == MaskType.TOP_LEFT,
                HAS_LEFT=masked and m.left >= 0, HAS_RIGHT=masked and m.right >= 0)


# ---- forward ---------------------------------------------------------------------------------------------------
class ForwardOperator(Operator):
    role = "forward"

    @classmethod
    def run(cls, backend, p: AttentionProblem, params: AttentionParams, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Write out and lse (Backend.forward)."""
        raise NotImplementedError


class FwdWs(GluonOperator, ForwardOperator):
    """The warp-specialised Gluon forward (gluon/fwd_ws.py)."""
    name = "fwd_ws"
    option = "fwd_ws"
    tiles = config.FWD_WS_SM90
    default_head_dims = config.FWD_WS_DEFAULT_HEAD_DIMS
    slower_head_dim = "not measured faster than the previous forward (TritonBackend(fwd_ws=True) runs it)"
    min_seqlen = config.FWD_WS_MIN_SEQLEN
    shorter = "not measured faster there (TritonBackend(fwd_ws=True) runs it)"
    positive_scale = True
    takes_sink = True
    supports_dropout = True
    softcap_head_blocks = config.FWD_WS_SOFTCAP_HEAD_BLOCKS
    dropout_head_blocks = config.FWD_WS_DROPOUT_HEAD_BLOCKS
    narrower_value_head_blocks = config.FWD_WS_NARROWER_VALUE_HEAD_BLOCKS
    wider_value_refusal = "its O leaves through q's shared-memory tile"
    previous = "the previous forward"

    @classmethod
    @per_problem(owners=2)
    def tile(cls, backend, p: AttentionProblem) -> config.FwdWsTile | None:
        return backend.fwd_ws_tile or config.fwd_ws_tile(p.head_dim_padded, p.mask.is_causal,
                                                         p.head_dim_v_padded)

    @classmethod
    def describe(cls, backend, p: AttentionProblem) -> str:
        notes = ["warp-specialised Gluon, sm_90"]
        notes += cls.value_notes(p, "v")
        tail = config.fwd_ws_qk_tail(p.head_dim_padded, p.head_dim_v_padded)
        if tail:
            notes.append(f"q/k as 128 + {tail} columns")
        if cls.schedule_walk(backend, p):
            notes.append("varlen schedule: the longest query tiles first")
        return f"fwd_ws ({'; '.join(notes)})"

    @classmethod
    def run(cls, backend, p: AttentionProblem, params: AttentionParams, out: torch.Tensor, lse: torch.Tensor) -> None:
        """One launch of fwd_ws (v and out at their own head dim)."""
        from .gluon import fwd_ws
        fwd_ws.launch(params.q, params.k, params.v, out, lse, params.cu_seqlens_q, params.cu_seqlens_k,
                      varlen=p.varlen, batch=p.batch, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, scale=p.softmax_scale,
                      tile=cls.tile(backend, p), mask=cls.mask(backend, p), schedule=cls.schedule(backend, p, params),
                      softcap=p.softcap, sink=params.learnable_sink if cls.takes_sink else None,
                      alibi=_alibi(p, params.alibi_slopes), dropout=_dropout(p, params, 0),
                      qk_tail=config.fwd_ws_qk_tail(p.head_dim_padded, p.head_dim_v_padded))


class Forward(ForwardOperator):
    """The one-launch Triton forward (one_launch/forward.py): one program per query tile."""
    name = "forward"
    takes_sink = True

    @classmethod
    def describe(cls, backend, p: AttentionProblem) -> str:
        return "forward (one program per query tile)"

    @classmethod
    def run(cls, backend, p: AttentionProblem, params: AttentionParams, out: torch.Tensor, lse: torch.Tensor) -> None:
        tile = backend.configs_for(p).forward
        use_tma = backend.tma_plan(p, "forward", params.q, params.k, params.v, out) == "all"
        scores, features = backend.scores_features(p, ("VARLEN", p.varlen), ("USE_TMA", use_tma),
                                                   ("TMA_LOADS", use_tma), ("EVEN_K", even_keys(p, tile.block_n)))
        sizes = backend.sizes(p, params.q.shape[-1])
        launch.forward(params.q, params.k, params.v, out, lse, backend.sequence_args(p, params, lse), sizes, scores,
                       features, tile, config.head_block(sizes.head_dim),
                       (cdiv(p.seqlen_q, tile.block_m), p.batch * p.heads_q), params.learnable_sink).launch()


# ---- backward --------------------------------------------------------------------------------------------------
class BackwardOperator(Operator):
    role = "backward"

    @classmethod
    def buffers(cls, backend, p: AttentionProblem) -> list[BufferSpec]:
        """The buffers it needs beyond softmax_d (Backend.backward_plan)."""
        return []

    @classmethod
    def run(cls, backend, p: AttentionProblem, params: AttentionParams, out: torch.Tensor, lse: torch.Tensor,
            dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
            workspace: dict[str, torch.Tensor]) -> None:
        """Fill workspace['softmax_d'], dq, dk and dv (Backend.backward)."""
        raise NotImplementedError


def _preprocess(p: AttentionProblem, out: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor,
                accumulators: tuple, sizes: launch.Sizes) -> None:
    """delta = rowsum(dO * O) into `delta` (over v's head dim); zero the plan's fp32 accumulators and semaphores
    (None: absent)."""
    launch.bwd_preprocess(out, dout, delta, accumulators, p.batch, sizes, p.varlen,
                          config.head_block(sizes.head_dim), value=value_head_dim(p)).launch()


def value_head_dim(p: AttentionProblem) -> tuple[int, int] | None:
    """v's kernel head dim and block (launch.Features.HEAD_DIM_V, BLOCK_DV) where they are not q/k's (the padded head
    dims differ), else None: the one-launch kernels then run as with one head dim."""
    if p.head_dim_v_padded == p.head_dim_padded:
        return None
    return p.head_dim_v_padded, config.head_block(p.head_dim_v_padded)


class _WarpSpecialisedBackward(GluonOperator, BackwardOperator):
    """The warp-specialised Gluon backward: bwd_ws, or bwd_ws_split where its tile splits the head dim."""
    split_d: ClassVar[bool]
    option = "ws"
    supports_dropout = True
    dropout_head_blocks = config.BWD_WS_DROPOUT_HEAD_BLOCKS
    default_head_dims = config.BWD_WS_DEFAULT_HEAD_DIMS
    slower_head_dim = "the one-launch kernel measured faster"
    min_seqlen = config.BWD_WS_MIN_SEQLEN
    shorter = "the one-launch kernel measured faster"
    narrower_value_head_blocks = config.BWD_WS_NARROWER_VALUE_HEAD_BLOCKS
    previous = "the one-launch backward"

    @classmethod
    def extra_reasons(cls, backend, p: AttentionProblem, setting: bool | None) -> list[str]:
        reasons = super().extra_reasons(backend, p, setting)
        given = backend.ws_tile
        if given is not None and given.split_d != cls.split_d:
            reasons.append(f"the given ws_tile {given} is {'bwd_ws_split' if given.split_d else 'bwd_ws'}'s")
        return reasons

    @classmethod
    @per_problem(owners=2)
    def tile(cls, backend, p: AttentionProblem) -> config.WsTile | None:
        return backend.ws_tile or config.bwd_ws_tile(p.head_dim_padded, p.mask.is_causal, p.group_size,
                                                     p.deterministic)

    @classmethod
    @per_problem(owners=2)
    def kv_heads_per_launch(cls, backend, p: AttentionProblem) -> int:
        """KV heads per launch: its fp32 dQ accumulator (a launch's query heads) stays under
        config.BWD_WS_DQ_ACCUM_BYTES."""
        per_kv_head = p.rows_q * p.group_size * p.head_dim_padded * 4
        return max(1, min(p.heads_k, config.BWD_WS_DQ_ACCUM_BYTES // max(per_kv_head, 1)))

    @classmethod
    def describe(cls, backend, p: AttentionProblem) -> str:
        notes = ["warp-specialised Gluon, sm_90"]
        if cls.split_d:
            notes.append("two warpgroups split the head dim")
        notes += cls.value_notes(p, "v and dout")
        tail = cls.qk_tail(p)
        if tail:
            notes.append(f"q/k as 128 + {tail} columns")
        if cls.schedule_walk(backend, p):
            notes.append("varlen schedule: the longest key tiles first")
        elif cls.tile(backend, p).key_major:
            notes.append("key-major grid: the longest causal key tiles first")
        return f"{cls.name} ({'; '.join(notes)})"

    @classmethod
    def qk_tail(cls, p: AttentionProblem) -> int:
        """The columns of the tail block q/k load in (bwd_ws_split: config.bwd_ws_qk_tail), 0: none."""
        return config.bwd_ws_qk_tail(p.head_dim_padded) if cls.split_d else 0

    @classmethod
    def buffers(cls, backend, p: AttentionProblem) -> list[BufferSpec]:
        heads = cls.kv_heads_per_launch(backend, p) * p.group_size
        buffers = [BufferSpec("dq_accum", (*p.q_rows_shape, heads, p.head_dim_padded), torch.float32, False,
                              f"fp32 dQ of {heads} query heads per launch (TMA reduce-adds; zeroed by "
                              "bwd_preprocess, then by a fill before each later launch)")]
        if p.deterministic:
            tiles = semaphore_tiles(p.seqlen_q, cls.tile(backend, p))
            buffers.append(BufferSpec("dq_semaphore", (p.batch, heads, tiles),
                                      torch.int32, False, "orders the dQ adds per (batch, head, query tile); zeroed "
                                      "by bwd_preprocess, and before each later launch"))
        return buffers

    @classmethod
    def run(cls, backend, p: AttentionProblem, params: AttentionParams, out: torch.Tensor, lse: torch.Tensor,
            dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
            workspace: dict[str, torch.Tensor]) -> None:
        """delta (zeroing dq_accum and the semaphores), then per group of kv heads: the kernel, the dQ cast, and a
        zeroing of dq_accum and the semaphores where another group follows. Kernel launches and views only
        (`launch.derived`), so that the replay re-issues every group's launches."""
        from .gluon import bwd_ws, gluon_common
        d = params.q.shape[-1]
        tile = cls.tile(backend, p)
        delta, dq_acc, sems = workspace["softmax_d"], workspace["dq_accum"], workspace.get("dq_semaphore")
        sizes = backend.sizes(p, d)
        _preprocess(p, out, dout, delta, (dq_acc, None, None, sems), sizes)
        q, k, v = (gluon_common.uniform_rows(t, p.varlen) for t in (params.q, params.k, params.v))
        dout = gluon_common.uniform_rows(dout, p.varlen)
        mask = cls.mask(backend, p)
        schedule = cls.schedule(backend, p, params)     # one for every launch: the same items
        kv_per_launch, group = cls.kv_heads_per_launch(backend, p), p.group_size
        batch = 1 if p.varlen else p.batch
        stats_heads_dim = 0 if p.varlen else 1      # lse/delta: (h, total_q) or (b, h, s_q)
        for h0 in range(0, p.heads_k, kv_per_launch):
            kv = slice(h0, min(h0 + kv_per_launch, p.heads_k))
            hq = slice(kv.start * group, kv.stop * group)
            launch_heads = slice(0, hq.stop - hq.start)
            acc = heads_of(dq_acc, -2, launch_heads)
            sem = None if sems is None else _dense_prefix(sems, (sems.shape[0], launch_heads.stop, sems.shape[2]))
            lse_h, delta_h = (heads_of(t, stats_heads_dim, hq) for t in (lse, delta))
            dk_h, dv_h = heads_of(dk, -2, kv), heads_of(dv, -2, kv)
            slopes = None if params.alibi_slopes is None else heads_of(params.alibi_slopes, -1, hq)
            bwd_ws.launch(heads_of(q, -2, hq), heads_of(k, -2, kv), heads_of(v, -2, kv), heads_of(dout, -2, hq), lse_h,
                          delta_h, acc, dk_h, dv_h, params.cu_seqlens_q, params.cu_seqlens_k, varlen=p.varlen,
                          batch=p.batch, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, scale=p.softmax_scale, mask=mask,
                          tile=tile, semaphores=sem, schedule=schedule, softcap=p.softcap, alibi=_alibi(p, slopes),
                          dropout=_dropout(p, params, hq.start), qk_tail=cls.qk_tail(p))
            dq_h = heads_of(dq, -2, hq)
            cast(acc, dq_h, launch.bhr(acc, p.varlen), launch.bhr(dq_h, p.varlen), hq.stop - hq.start, batch,
                 p.rows_q // batch, d)
            if kv.stop < p.heads_k:     # the next launch adds into the accumulator and counts in the semaphores
                launch.zero_flat(*(t for t in (acc, sems) if t is not None)).launch()


class BwdWs(_WarpSpecialisedBackward):
    """The warp-specialised Gluon backward (gluon/bwd_ws.py): one MMA warpgroup, head dims up to 128."""
    name = "bwd_ws"
    split_d = False
    tiles = MappingProxyType({block: tile for block, tile in config.BWD_WS_SM90.items() if not tile.split_d})


class BwdWsSplit(_WarpSpecialisedBackward):
    """The warp-specialised Gluon backward whose two MMA warpgroups split the head dim (gluon/bwd_ws_split.py)."""
    name = "bwd_ws_split"
    split_d = True
    softcap_head_blocks = config.BWD_WS_SPLIT_SOFTCAP_HEAD_BLOCKS
    tiles = MappingProxyType({block: tile for block, tile in config.BWD_WS_SM90.items() if tile.split_d})

    @classmethod
    def extra_reasons(cls, backend, p: AttentionProblem, setting: bool | None) -> list[str]:
        """Dropout and the softcap each hand the dP warpgroup a tile of their own beside P^T (the whole P^T, the
        scores' slope): both together need more shared memory than a CTA has."""
        reasons = super().extra_reasons(backend, p, setting)
        if p.dropout_p > 0 and p.softcap != 0.0:
            reasons.append("dropout with a softcap: their two tiles beside P^T exceed a CTA's shared memory")
        return reasons


class _OneLaunchBackward(BackwardOperator):
    """The one-launch Triton backward (one_launch/bwd_main.py): bwd_preprocess, one launch of key-tile programs and,
    without atomic dQ, query-tile programs (bwd_dq), then bwd_postprocess."""
    dq_atomic: ClassVar[bool]

    @classmethod
    def buffers(cls, backend, p: AttentionProblem) -> list[BufferSpec]:
        d, buffers = p.head_dim_padded, []
        if cls.dq_atomic:
            buffers.append(BufferSpec("dq_accum", (*p.q_rows_shape, p.heads_q, d), torch.float32, False,
                                      "fp32 dQ laid out like q, atomic adds (zeroed by bwd_preprocess)"))
        if backend.accumulate_kv(p):
            acc_shape = (p.heads_k, p.total_k, d) if p.varlen else (p.batch, p.heads_k, p.seqlen_k, d)
            for name in ("dk_accum", "dv_accum"):
                buffers.append(BufferSpec(name, acc_shape, torch.float32, False,
                                          f"fp32 {name[:2]} summed over groups of {p.group_size} "
                                          "(zeroed by bwd_preprocess)"))
            if p.deterministic:
                tiles = cdiv(p.seqlen_k, backend.configs_for(p).bwd_kv.block_n)
                buffers.append(BufferSpec("dkv_semaphore", (max(tiles, 1), p.batch, p.heads_k), torch.int32, False,
                                          "orders the group's adds per (key tile, batch, kv head)"))
        return buffers

    @classmethod
    def run(cls, backend, p: AttentionProblem, params: AttentionParams, out: torch.Tensor, lse: torch.Tensor,
            dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
            workspace: dict[str, torch.Tensor]) -> None:
        cfg = backend.configs_for(p)
        delta = workspace["softmax_d"]
        dq_acc = workspace.get("dq_accum")
        dk_acc, dv_acc = workspace.get("dk_accum"), workspace.get("dv_accum")
        sems = workspace.get("dkv_semaphore")
        assert (dq_acc is not None) == cls.dq_atomic and (dk_acc is not None) == backend.accumulate_kv(p)
        seq, sizes = backend.sequence_args(p, params, delta), backend.sizes(p, params.q.shape[-1])
        d = sizes.head_dim
        block_d = config.head_block(d)
        assert launch.lse_strides(delta, p.varlen) == launch.lse_strides(lse, p.varlen), \
            "softmax_d must be strided like lse"

        # ---- 1. delta = rowsum(dO * O); zero the accumulators and semaphores ----
        _preprocess(p, out, dout, delta, (dq_acc, dk_acc, dv_acc, sems), sizes)

        # ---- 2. one launch: key-tile programs (dK/dV, and dQ in atomic mode), then the dQ pass ----
        kv, dq_tile = cfg.bwd_kv, cfg.bwd_dq
        loop_group = not backend.accumulate_kv(p)
        inputs = (params.q, params.k, params.v, dout)
        dq_target = dq_acc if dq_acc is not None else dq
        tma_mode = backend.tma_plan(p, "backward", *inputs, dq_target, dk, dv,
                                    *(t for t in (dk_acc, dv_acc) if t is not None))
        use_tma = tma_mode != "none"
        prog_heads = p.heads_k if loop_group else p.heads_q
        query_tiles = cdiv(p.seqlen_q, dq_tile.block_m)
        query_programs = 0 if dq_acc is not None else (p.heads_q // prog_heads) * query_tiles
        programs = cdiv(p.seqlen_k, kv.block_n) + query_programs
        if programs > 0:
            scores, features = backend.scores_features(
                p, ("VARLEN", p.varlen), ("LOOP_GROUP", loop_group), ("DQ_ATOMIC", dq_acc is not None),
                ("DETERMINISTIC", p.deterministic), ("USE_TMA", use_tma),
                ("TMA_LOADS", use_tma and tma_mode == "all"), ("DP_FIRST", cfg.bwd_dp_first),
                ("EVEN_K", cfg.bwd_even_k and even_keys(p, kv.block_n, dq_tile.block_n)))
            launch.bwd_main(params.q, params.k, params.v, dout, lse, delta, dq_target, dk, dv, dk_acc, dv_acc, sems,
                            seq, p.batch, sizes, scores, features, kv, dq_tile, block_d,
                            (programs, p.batch * prog_heads)).launch()

        # ---- 3. fp32 accumulators -> output dtype ----
        _postprocess(p, dq, dk, dv, dq_acc, dk_acc, dv_acc, d)


def _postprocess(p: AttentionProblem, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                 dq_acc: torch.Tensor | None, dk_acc: torch.Tensor | None, dv_acc: torch.Tensor | None,
                 d: int) -> None:
    """The fp32 accumulators that this plan has -> dq (atomic dQ), dk/dv (GQA "accumulate")."""
    batch = 1 if p.varlen else p.batch
    if dq_acc is not None:
        cast(dq_acc, dq, launch.bhr(dq_acc, p.varlen), launch.bhr(dq, p.varlen), p.heads_q, batch,
             p.rows_q // batch, d)
    if dk_acc is not None and dv_acc is not None:
        for acc, grad in ((dk_acc, dk), (dv_acc, dv)):
            acc_bhr = (0, acc.stride(0), acc.stride(1)) if p.varlen else acc.stride()[:3]
            cast(acc, grad, acc_bhr, launch.bhr(grad, p.varlen), p.heads_k, batch, p.rows_k // batch, d)


class BwdMainAtomicDq(_OneLaunchBackward):
    """bwd_main whose key-tile programs add dQ into an fp32 accumulator laid out like q: no dQ pass. Where dq_mode
    "auto" runs it the H200 measured it faster (docs/triton.md §Modes): MHA at head block 128 with tiles loaded by
    pointers, past config.SHORT_SEQLEN; GQA keeps the pass (an fp32 dQ the size of q)."""
    name = "bwd_main_atomic_dq"
    dq_atomic = True
    supports_deterministic = False
    option = "dq_mode"
    min_seqlen = MappingProxyType({128: config.SHORT_SEQLEN + 1})
    shorter = "the dQ pass measured faster"
    default_head_dims = frozenset(range(65, 129))
    slower_head_dim = "the dQ pass measured faster"

    @classmethod
    def setting(cls, backend) -> bool | None:
        return {"auto": None, "atomic": True, "pass": False}[backend.dq_mode]

    @classmethod
    def extra_reasons(cls, backend, p: AttentionProblem, setting: bool | None) -> list[str]:
        if setting is not None:
            return []
        reasons = []
        if p.is_gqa:
            reasons.append("GQA (an fp32 dQ the size of q): the dQ pass measured faster")
        if backend.tma_plan(p, "backward") == "all":
            reasons.append("tiles loaded through TMA: the dQ pass measured faster")
        return reasons

    @classmethod
    def describe(cls, backend, p: AttentionProblem) -> str:
        return "bwd_main_atomic_dq (bwd_main: key-tile programs add dQ into fp32, no dQ pass)"


class BwdMain(_OneLaunchBackward):
    """bwd_main with its dQ pass: query-tile programs in the same launch; no dQ accumulator, deterministic."""
    name = "bwd_main"
    dq_atomic = False

    @classmethod
    def describe(cls, backend, p: AttentionProblem) -> str:
        return "bwd_main (one launch: key tiles + dQ pass)"


# ---- the lists: a call runs the first operator of its role with no reasons --------------------------------------
FORWARD: tuple[type[ForwardOperator], ...] = (FwdWs, Forward)
BACKWARD: tuple[type[BackwardOperator], ...] = (BwdWs, BwdWsSplit, BwdMainAtomicDq, BwdMain)
OPERATORS = {"forward": FORWARD, "backward": BACKWARD}


def declared_mask_kinds() -> frozenset[MaskKind]:
    """The mask kinds that some operator of each role runs: what the backend declares."""
    return frozenset.intersection(*(frozenset().union(*(op.mask_kinds for op in ops)) for ops in OPERATORS.values()))


# ---- helpers of the launches ----------------------------------------------------------------------------------
def even_keys(p: AttentionProblem, *key_blocks: int) -> bool:
    """Every key tile of a launch is full: dense, and s_k a multiple of each of its key blocks."""
    return not p.varlen and all(p.seqlen_k % block == 0 for block in key_blocks)


def _dropout(p: AttentionProblem, params: AttentionParams, first_head: int) -> tuple | None:
    """Dropout as the Gluon kernels take it: (the call's rng_state, p, its query heads, the launch's first query head:
    core/dropout.py's counter takes the head's index in the call), or None without dropout."""
    if p.dropout_p == 0:
        return None
    return params.rng_state, p.dropout_p, p.heads_q, first_head


def _alibi(p: AttentionProblem, slopes: torch.Tensor | None) -> tuple[torch.Tensor, int] | None:
    """ALiBi as the Gluon kernels take it: (the fp32 slopes, (heads,) or (batch, heads), and their batch stride, 0 for
    (heads,)), or None without ALiBi."""
    if not p.has_alibi:
        return None
    assert slopes is not None
    return slopes, launch.slope_batch_stride(slopes, True)


def heads_of(t: torch.Tensor, dim: int, heads: slice) -> torch.Tensor:
    """The heads `heads` of `t` (along `dim`): `t` itself when they are all of its heads (one launch covers the
    call), since even a view that changes nothing costs about a microsecond of host time."""
    if heads.start == 0 and heads.stop == t.shape[dim]:
        return t
    return launch.derived(t.narrow(dim, heads.start, heads.stop - heads.start), t)


def _dense_prefix(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first elements of contiguous `t` as a contiguous tensor of `shape`: the warp-specialised kernel indexes its
    semaphores densely by the launch's own head count, so a launch with fewer heads than the buffer was sized for
    needs this layout (a narrowed view would keep the full head stride, and its zeroing would miss what the kernel
    reads: stale counts from the previous launch, and a dQ add that waits forever)."""
    return t if t.shape == shape else launch.derived(t.view(-1)[:math.prod(shape)].view(shape), t)


def cast(src: torch.Tensor, dst: torch.Tensor, src_bhr, dst_bhr, heads: int, batch: int, rows: int, d: int) -> None:
    """fp32 rows -> the output dtype (bwd_postprocess.cast_rows_kernel)."""
    if rows == 0:
        return
    launch.cast_rows(src, dst, src_bhr, dst_bhr, heads, batch, rows, config.head_block(d), d).launch()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
