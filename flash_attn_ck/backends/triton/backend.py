"""TritonBackend: the CUDA (Hopper-first) kernels behind the common pipeline.

Forward: forward.py, or the warp-specialised fwd_ws.py (Gluon, sm_90) where `fwd_ws_reasons` names no
reason (`forward_kernel` says which, and why). Backward, in launch order:
  1. bwd_preprocess: delta = rowsum(dO * O) into workspace['softmax_d']; zero the fp32 accumulators
     and semaphores of this plan.
  2. bwd_main: one launch with two program roles: one program per key tile (dK/dV on chip;
     epilogue per bwd_epilogue, docs/semantics.md) and, in dq_mode "pass" (always when deterministic), one
     per query tile (bwd_dq: dQ).
  3. bwd_postprocess: fp32 accumulators -> dk/dv (GQA "accumulate") and dq (dq_mode "atomic").

Options (constructor arguments, defaults from the environment):
  gqa_epilogue  "loop" (default): a key-tile program loops over its group's query heads, dK/dV
                stay on chip, no fp32 accumulators. "accumulate": the Hopper epilogue, one program
                per query head adding into fp32 (b, h_k, s_k, d) accumulators (+ semaphores when
                deterministic).            env FLASH_ATTN_CK_TRITON_GQA
  dq_mode       "auto" (default): "atomic" only where the H200 measured it faster and memory allows
                (MHA, head block 128, not deterministic, tiles loaded by pointers, longest sequence
                over config.SHORT_SEQLEN: 385 vs 329 TF/s at s8192; with TMA loads, and on short
                sequences, the pass wins), else "pass".
                "pass": separate query-tile pass, no dQ accumulator, deterministic.
                "atomic": fp32 dQ accumulator laid out like q, added by the key-tile programs
                (refused in deterministic mode).       env FLASH_ATTN_CK_TRITON_DQ
  use_tma       None = TMA tensor descriptors (row_io.py) on sm_90+ when the tensors are dense and 16-byte
                aligned, for the forward when config.Configs.fwd_tma and for the backward tiles that
                Configs.bwd_tma names (neither for short sequences); True: every tile, forward and
                backward, where the tensors allow; False: masked pointers.
  varlen_schedule  None = config.VARLEN_SCHEDULE; True: the warp-specialised kernels run varlen calls on a
                grid over the call's real (sequence, tile) items, longest first (varlen_schedule.py, built on
                the device per call; `_schedule_walk` says where); False: on the grid over every (batch,
                tile of the longest sequence).
The choice of defaults and the measurements behind it: docs/triton.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings

import torch

from ...core.errors import KernelCompileError
from ...core.mask import WINDOW_MASK_KINDS, MaskType
from ...core.plan import BufferSpec, WorkspacePlan
from ...core.problem import AttentionParams, AttentionProblem
from ..base import Backend
from . import config
from .gluon.bwd_ws_shapes import semaphore_tiles as bwd_ws_semaphore_tiles
from .runtime import launch, replay, triton_versions

GQA_ENV = "FLASH_ATTN_CK_TRITON_GQA"
DQ_ENV = "FLASH_ATTN_CK_TRITON_DQ"


# Read once, like triton itself, which decides when the kernels' modules are imported.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device (a tensor's device: its index is set); read up to three
    times per call, so cached."""
    return torch.cuda.get_device_capability(device)


# Warp-specialised kernel families (GluonRule.option) that failed to compile in this process, with the reason
# their refusal gives: such a call ran, and every later one runs, on the one-launch kernels.
_FAILED_TO_COMPILE: dict[str, str] = {}
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A RuntimeWarning, once per process for each message: the Gluon kernels give way to the one-launch ones."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(f"flash_attn_ck: {message}", RuntimeWarning, stacklevel=4)


def _failed_to_compile(rule: config.GluonRule, error: KernelCompileError) -> None:
    """Note that `rule`'s kernel failed to compile (every later call refuses it in words), and warn once."""
    _FAILED_TO_COMPILE[rule.option] = f"{error.kernel_name} failed to compile with Triton " \
                                      f"{triton_versions.installed()} ({error.first_error})"
    _warn_once(f"{_FAILED_TO_COMPILE[rule.option]}; its calls run on the one-launch Triton kernels")


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _prepare_launch() -> None:
    """Device-side tensor descriptors (and, seen on the H200, the dropout variants of the kernels)
    need global scratch from triton.set_allocator. The allocator lives in a context variable, so
    it is set before every launch: autograd runs the backward on its own thread."""
    if not _INTERPRETING:
        import triton
        triton.set_allocator(_scratch)


def _per_problem(method):
    """A TritonBackend method whose result follows from the problem and the method's other (hashable) arguments
    alone, computed once per problem: kept in `problem.memo` under (backend, method, arguments). The pipeline reuses
    a problem per call signature, so a repeated call decides nothing again; a backend's settings are fixed once
    it is made (TritonBackend.__setattr__). Results are immutable (tuples, named tuples, frozen dataclasses)."""
    name = method.__name__

    @functools.wraps(method)
    def memoised(self, p, *args):
        key = (self, name, *args)
        found = p.memo.get(key, _MISSING)
        if found is _MISSING:
            found = p.remember(key, method(self, p, *args))
        return found
    return memoised


_MISSING = object()

# Replays kept per (backend, problem): the layouts of one call signature's tensors (alignment, a caller's strides;
# emptied when full; 0: none).
REPLAYS_PER_PROBLEM = 16
# Replays of the varlen outside-rows fill, by layout (the process's recent ones; cleared when full; 0: none).
FILL_REPLAYS = 256
_FILL_REPLAYS: dict[tuple, replay.Replay | None] = {}


def _replayed(method):
    """A TritonBackend entry point (forward, backward) whose launches are recorded on the first call of a
    (problem, layout of its tensors) and replayed on later ones (replay.py): `method(p, params, *tensors,
    [workspace])` reads and writes only params' tensors, `tensors` and the workspace's. Interpreted and CPU calls,
    and calls while a profiler hook is installed, run the method. The current device and stream are read once per
    call: the device for the key, the stream for the replay's launches."""
    name = method.__name__

    @functools.wraps(method)
    def run(self, p, params, *rest):
        if _INTERPRETING or not params.q.is_cuda or launch.hooked() or not REPLAYS_PER_PROBLEM:
            return method(self, p, params, *rest)
        has_workspace = isinstance(rest[-1], dict)
        workspace, positional = (rest[-1], rest[:-1]) if has_workspace else ({}, rest)
        tensors = (params.q, params.k, params.v, params.cu_seqlens_q, params.cu_seqlens_k, params.alibi_slopes,
                   params.rng_state, *positional, *workspace.values())
        replays = p.memo.get((self, name, "replays"))
        if replays is None:
            replays = p.remember((self, name, "replays"), {})
        device, stream = launch.current_device_and_stream()
        key = replay.layout_key(tensors, device)
        if workspace:
            key = (*key, *workspace)        # the workspace's names: which roles its tensors hold
        found = replays.get(key, _MISSING)
        if found is None:           # a layout that cannot be replayed
            method(self, p, params, *rest)
        elif found is _MISSING:     # recorded (replay.run_through, which empties a full store)
            replay.run_through(replays, key, lambda: method(self, p, params, *rest), tensors, REPLAYS_PER_PROBLEM,
                               stream)
        else:
            found.run(tensors, stream)
    return run


class TritonBackend(Backend):
    name = "triton"
    priority = 100
    device_types = frozenset({"cuda"})
    # Chunks of whole batch entries, KV groups or query-head slices are views the kernels read by their
    # strides, so a workspace cap below the warp-specialised kernel's fp32 dq_accum chunks the call
    # instead of failing. Not query rows, and not with dropout: the kernels draw the keep pattern at
    # launch-local (batch, head) coordinates.
    supports_chunks = True
    # Every kernel, the warp-specialised ones included, rebuilds its diagonal per sequence from the
    # alignment and left/right; none takes CK's generic (y, x).
    mask_kinds = WINDOW_MASK_KINDS
    # forward.py and bwd_main (with bwd_dq, bwd_postprocess) store through row_io.store_rows / cast_rows, which
    # convert to the output's element type: fp32 outputs of fp16/bf16 inputs need nothing else. The
    # warp-specialised kernels cannot (`_gluon_reasons`), so such calls run these.
    fp32_outputs_refusal = None

    def __init__(self, gqa_epilogue: str | None = None, dq_mode: str | None = None,
                 use_tma: bool | None = None, configs: config.Configs | None = None,
                 ws: bool | None = None, ws_tile: config.WsTile | None = None,
                 fwd_ws: bool | None = None, fwd_ws_tile: config.FwdWsTile | None = None,
                 varlen_schedule: bool | None = None):
        # An option given here wins; else its environment variable (empty: unset); errors name the source.
        for option, value, env, default, allowed in (
                ("gqa_epilogue", gqa_epilogue, GQA_ENV, "loop", ("loop", "accumulate")),
                ("dq_mode", dq_mode, DQ_ENV, "auto", ("auto", "pass", "atomic"))):
            source = f"{option}={value!r}"
            if not value:
                value = os.environ.get(env, "") or default
                source = f"{env}={value!r}"
            if value not in allowed:
                raise ValueError(f"{source}: expected one of {', '.join(map(repr, allowed))}")
            setattr(self, option, value)
        self.use_tma = use_tma
        self.configs = configs
        self.ws = ws
        self.ws_tile = ws_tile
        self.fwd_ws = fwd_ws
        self.fwd_ws_tile = fwd_ws_tile
        if varlen_schedule is not None and not isinstance(varlen_schedule, bool):
            raise ValueError(f"varlen_schedule={varlen_schedule!r}: expected None, True or False")
        self.varlen_schedule = varlen_schedule
        self._made = True

    def __setattr__(self, name, value):
        # decisions are memoised per (backend, problem): a changed setting would leave them stale
        if getattr(self, "_made", False):
            raise AttributeError(f"TritonBackend settings are fixed once made ({name}); make another backend")
        super().__setattr__(name, value)

    def leaner(self) -> TritonBackend | None:
        """The one-launch backward, which needs no fp32 dQ accumulator, where the warp-specialised one may run."""
        if self.ws is False:
            return None
        return TritonBackend(self.gqa_epilogue, self.dq_mode, self.use_tma, self.configs, ws=False,
                             fwd_ws=self.fwd_ws, fwd_ws_tile=self.fwd_ws_tile, varlen_schedule=self.varlen_schedule)

    # ---- capabilities --------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not importable"
        if torch.version.hip is not None:
            return "this is a ROCm build of torch (the Triton backend targets CUDA)"
        if not _INTERPRETING and not torch.cuda.is_available():
            return "no CUDA device"
        return None

    # ---- configuration -------------------------------------------------------------------------
    @_per_problem
    def _configs(self, p: AttentionProblem) -> config.Configs:
        if self.configs is not None:
            return self.configs
        cap = _capability(p.device) if p.device.type == "cuda" else None
        return config.select(p.head_dim_padded, p.mask.is_causal, cap, _INTERPRETING, max(p.seqlen_q, p.seqlen_k))

    @_per_problem
    def _dq_atomic(self, p: AttentionProblem) -> bool:
        if p.deterministic:
            return False
        if self.dq_mode == "auto":
            return config.auto_dq_atomic(p.head_dim_padded, p.is_gqa, self._tma_plan(p, "backward"),
                                         max(p.seqlen_q, p.seqlen_k))
        return self.dq_mode == "atomic"

    def ws_reasons(self, p: AttentionProblem) -> list[str]:
        """Why the warp-specialised backward (bwd_ws.py) does not run this call; empty when it does.
        ws=None: where it measured faster (config.BWD_WS_RULE); True: wherever it can run; False: never."""
        return list(self._gluon_reasons(p, config.BWD_WS_RULE))

    def fwd_ws_reasons(self, p: AttentionProblem) -> list[str]:
        """Why the warp-specialised forward (fwd_ws.py) does not run this call; empty when it does.
        fwd_ws=None: where it measured faster (config.FWD_WS_RULE); True: wherever it can run; False: never."""
        return list(self._gluon_reasons(p, config.FWD_WS_RULE))

    @_per_problem
    def _gluon_reasons(self, p: AttentionProblem, rule: config.GluonRule) -> tuple[str, ...]:
        setting = getattr(self, rule.option)
        if setting is False:
            return [f"turned off (TritonBackend({rule.option}=False))"]
        reasons = []
        if _INTERPRETING or p.device.type != "cuda" or _capability(p.device)[0] != 9:
            reasons.append("needs an sm_90 GPU (Gluon wgmma/TMA kernel)")
        elif setting is not True and (outside := triton_versions.gluon_refusal()):
            _warn_once(f"{outside}: the one-launch Triton kernels run instead (TritonBackend(fwd_ws=True, ws=True) "
                       "forces them)")
            reasons.append(outside)
        if rule.option in _FAILED_TO_COMPILE:
            reasons.append(_FAILED_TO_COMPILE[rule.option])
        if p.dtype not in (torch.bfloat16, torch.float16):
            reasons.append(f"{p.dtype} inputs (bf16/fp16 only)")
        if p.out_dtype != p.dtype:
            reasons.append(f"out_dtype {str(p.out_dtype).removeprefix('torch.')} (its TMA stores go through shared "
                           "tiles of the input dtype)")
        d = p.head_dim_padded
        if rule.tile(d, p.mask.is_causal, p.group_size) is None:
            reasons.append(f"head dim {d}: the kernel has tiles for head dims (padded to a power of two) "
                           f"{sorted(rule.tiles)}")
        elif setting is None and d not in rule.default_head_dims:
            reasons.append(f"head dim {d}: {rule.slower_head_dim}")
        if setting is None and d in rule.default_head_dims \
                and max(p.seqlen_q, p.seqlen_k) < (shortest := rule.min_seqlen[config.head_block(d)]):
            reasons.append(f"sequences shorter than {shortest}: {rule.shorter}")
        if p.dropout_p > 0:
            reasons.append("dropout")
        if p.has_alibi:
            reasons.append("ALiBi")
        if p.softcap != 0.0:
            reasons.append("softcap")
        if rule.positive_scale and p.softmax_scale <= 0:
            reasons.append(f"softmax scale {p.softmax_scale} (the kernel takes the running max on raw scores)")
        return tuple(reasons)

    def fp32_outputs_slower(self, problem: AttentionProblem) -> str | None:
        """The warp-specialised kernels write input-dtype results only: a call they run takes the older kernels
        for fp32 ones."""
        uses = [name for name, reasons in (("fwd_ws", self.fwd_ws_reasons(problem)),
                                           ("bwd_ws", self.ws_reasons(problem))) if not reasons]
        return f"{' and '.join(uses)} would give way to the older kernels" if uses else None

    def forward_kernel(self, problem: AttentionProblem) -> str:
        reasons = self.fwd_ws_reasons(problem)
        if not reasons:
            scheduled = "; varlen schedule: the longest query tiles first" if self._schedule_walk(problem, "forward") \
                else ""
            return f"fwd_ws (warp-specialised Gluon, sm_90{scheduled})"
        return "forward (one program per query tile); fwd_ws not used: " + ", ".join(reasons)

    @_per_problem
    def _fwd_ws_tile(self, p: AttentionProblem) -> config.FwdWsTile:
        return config.fwd_ws_tile(p.head_dim_padded, p.mask.is_causal)

    @_per_problem
    def _ws_tile(self, p: AttentionProblem) -> config.WsTile:
        return self.ws_tile or config.bwd_ws_tile(p.head_dim_padded, p.mask.is_causal, p.group_size, p.deterministic)

    @_per_problem
    def _ws_kv_heads_per_launch(self, p: AttentionProblem) -> int:
        """KV heads per launch of the warp-specialised kernel: its fp32 dQ accumulator (a launch's query
        heads) stays under config.BWD_WS_DQ_ACCUM_BYTES."""
        per_kv_head = p.rows_q * p.group_size * p.head_dim_padded * 4
        return max(1, min(p.heads_k, config.BWD_WS_DQ_ACCUM_BYTES // max(per_kv_head, 1)))

    @_per_problem
    def _schedule_walk(self, p: AttentionProblem, role: str):
        """(varlen_schedule.TileWalk, bound) of the schedule a warp-specialised `role` launch ("forward": fwd_ws,
        "backward": bwd_ws / bwd_ws_split) of this call runs, or None where it keeps the grid over every (batch,
        tile): varlen_schedule off (None: config.VARLEN_SCHEDULE), a dense call, more items than a grid's y dimension
        takes, or a deterministic backward with a left window bound.

        The walk is the launch's: forward CTAs own query tiles of the tile's block_m rows and walk key tiles of
        block_n, backward CTAs own key tiles of block_n and walk query tiles of block_m; the window is the kernels'
        own (launch.GluonMask: its bounds where its flags set them, bottom-right unless top-left). The bound is
        known from shapes (varlen_schedule.schedule_bound of the owned axis's rows): no host sync.

        Deterministic backward: the writer of key tile n adds into a query tile only after every key tile of the
        sequence before n that sees it has added, so a CTA waits on CTAs of the same sequence and kv
        head with lower key tiles. That cannot hang if each of those starts no later than the waiter (CTAs start in
        grid order, as the key-major grid already relies on): within a kv head the schedule's order is steps
        descending, ties in (sequence, tile) order, so it holds when a sequence's steps never increase with the key
        tile. Without a left bound a key tile sees queries [lo(n), len_q) with lo non-decreasing in n (0 without a
        right bound): its steps never increase, and the ordered adds keep today's order, bit for bit. With a left
        bound the first key tiles see more query tiles as n grows (their windows are cut at query 0), so a later
        tile would start first and wait on an earlier one behind it: those calls keep the grid."""
        setting = config.VARLEN_SCHEDULE if self.varlen_schedule is None else self.varlen_schedule
        if not setting or not p.varlen:
            return None
        from .runtime.varlen_schedule import TileWalk, schedule_bound
        mask = self._gluon_mask(p)
        if role == "backward":
            if p.deterministic and mask.flags.HAS_LEFT:
                return None
            tile = self._ws_tile(p)
            own, walk, rows = tile.block_n, tile.block_m, p.total_k
        else:
            tile = self.fwd_ws_tile or self._fwd_ws_tile(p)
            own, walk, rows = tile.block_m, tile.block_n, p.total_q
        bound = schedule_bound(rows, p.batch, own)
        if bound > config.GRID_Y_MAX:
            return None
        left, right = mask.window
        return TileWalk(own, walk, owns_keys=role == "backward", left=left if mask.flags.HAS_LEFT else -1,
                        right=right if mask.flags.HAS_RIGHT else -1, top_left=mask.flags.TOP_LEFT), bound

    def _schedule(self, p: AttentionProblem, params: AttentionParams, role: str) -> torch.Tensor | None:
        """The call's schedule for a `role` launch (`_schedule_walk`), built on the device, or None."""
        found = self._schedule_walk(p, role)
        if found is None:
            return None
        from .runtime.varlen_schedule import build_schedule
        return build_schedule(params.cu_seqlens_q, params.cu_seqlens_k, *found)

    def _accumulate_kv(self, p: AttentionProblem) -> bool:
        return p.is_gqa and self.gqa_epilogue == "accumulate"

    def _tma_plan(self, p: AttentionProblem, role: str, *tensors: torch.Tensor) -> str:
        """Which tiles of a `role` ("forward" or "backward") launch move through TMA descriptors: "all"
        (loads and stores), "stores" (loads by pointers) or "none". TMA needs sm_90+ and dense tensors
        with 16-byte aligned bases and row strides; `tensors` are checked when given (at launch),
        before that the plan is what the problem and the configs tell."""
        mode = self._tma_mode(p, role)
        if mode == "none" or all(t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0
                                                                for s in t.stride()[:-1]) for t in tensors):
            return mode
        return "none"

    @_per_problem
    def _tma_mode(self, p: AttentionProblem, role: str) -> str:
        """`_tma_plan` before the tensors are seen."""
        if self.use_tma is False or p.varlen:
            return "none"
        if self.use_tma is True:
            return "all"     # forced: every tile, forward and backward, where the tensors allow
        if _INTERPRETING or p.device.type != "cuda" or _capability(p.device)[0] < 9:
            return "none"
        cfg = self._configs(p)
        return cfg.bwd_tma if role == "backward" else "all" if cfg.fwd_tma else "none"

    @staticmethod
    def _even_keys(p: AttentionProblem, *key_blocks: int) -> bool:
        """Every key tile of a launch is full: dense, and s_k a multiple of each of its key blocks."""
        return not p.varlen and all(p.seqlen_k % block == 0 for block in key_blocks)

    @staticmethod
    def _mask_args(p: AttentionProblem) -> dict:
        m = p.mask
        masked = m.type != MaskType.NO_MASK
        return dict(window_left=max(m.left, 0), window_right=max(m.right, 0),
                    TOP_LEFT=m.type == MaskType.TOP_LEFT, HAS_LEFT=masked and m.left >= 0,
                    HAS_RIGHT=masked and m.right >= 0)

    @_per_problem
    def _gluon_mask(self, p: AttentionProblem) -> launch.GluonMask:
        """The mask as the warp-specialised kernels' launch functions (fwd_ws.launch, bwd_ws.launch) take it."""
        m = TritonBackend._mask_args(p)
        return launch.GluonMask((m["window_left"], m["window_right"]),
                                launch.MaskFlags(m["TOP_LEFT"], m["HAS_LEFT"], m["HAS_RIGHT"]))

    @staticmethod
    def _sequence_args(p: AttentionProblem, params: AttentionParams, dummy: torch.Tensor) -> launch.SequenceArgs:
        """The per-call pointers of the score features (`dummy` where a feature is off)."""
        slopes = params.alibi_slopes
        return launch.SequenceArgs(
            params.cu_seqlens_q if p.varlen else dummy, params.cu_seqlens_k if p.varlen else dummy,
            slopes.to(torch.float32).contiguous() if slopes is not None else dummy,
            params.rng_state if p.dropout_p > 0 else dummy)

    @_per_problem
    def _sizes(self, p: AttentionProblem, head_dim: int) -> launch.Sizes:
        return launch.Sizes(p.heads_q, p.group_size, p.seqlen_q, p.seqlen_k, head_dim)

    @_per_problem
    def _scores_features(self, p: AttentionProblem,
                         *flags: tuple[str, bool]) -> tuple[launch.ScoreArgs, launch.Features]:
        """The ScoreArgs and Features of a launch: the problem's score features and mask, plus `flags`
        ((Features field, value) pairs: the launch's own)."""
        named = dict(HAS_ALIBI=p.has_alibi, HAS_SOFTCAP=p.softcap != 0.0, HAS_DROPOUT=p.dropout_p > 0,
                     scale=p.softmax_scale, softcap=p.softcap, dropout_p=p.dropout_p, **self._mask_args(p))
        return launch.split_named(named, **dict(flags))

    def fill_outside_sequences(self, *fills: tuple[torch.Tensor, torch.Tensor, int, float]) -> None:
        """Every fill of the call in one launch (outside_rows.py) on a GPU: the generic form costs two launches
        per offset tensor and one per tensor, which a small varlen call pays in host time."""
        if _INTERPRETING or fills[0][0].device.type != "cuda":
            super().fill_outside_sequences(*fills)
            return
        if launch.hooked() or not FILL_REPLAYS:
            self._fill_outside(fills)
            return
        # Replayed per layout (replay.py): the launch follows from the tensors' layouts, dims and values alone.
        tensors = tuple(t for cu_seqlens, t, _, _ in fills for t in (cu_seqlens, t))
        device, stream = launch.current_device_and_stream()
        key = (*replay.layout_key(tensors, device), *[(dim, float(value).hex()) for _, _, dim, value in fills])
        replay.run_through(_FILL_REPLAYS, key, lambda: self._fill_outside(fills), tensors, FILL_REPLAYS, stream)

    @staticmethod
    def _fill_outside(fills) -> None:
        spec = launch.fill_outside(fills)
        if spec is not None:
            _prepare_launch()
            spec.launch()

    # ---- forward -------------------------------------------------------------------------------
    @_replayed
    def forward(self, problem: AttentionProblem, params: AttentionParams,
                out: torch.Tensor, lse: torch.Tensor) -> None:
        p = problem
        _prepare_launch()
        if not self._gluon_reasons(p, config.FWD_WS_RULE) and config.FWD_WS_RULE.option not in _FAILED_TO_COMPILE:
            try:
                self._forward_ws(p, params, out, lse)
                return
            except KernelCompileError as error:     # nothing was written: the older forward runs the call
                _failed_to_compile(config.FWD_WS_RULE, error)
                p.memo.clear()
        with _naming_the_call(p):
            self._forward_one_launch(p, params, out, lse)

    def _forward_one_launch(self, p: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                            lse: torch.Tensor) -> None:
        """forward.py: one program per query tile."""
        cfg = self._configs(p)
        tile = cfg.forward
        use_tma = self._tma_plan(p, "forward", params.q, params.k, params.v, out) == "all"
        scores, features = self._scores_features(p, ("VARLEN", p.varlen), ("USE_TMA", use_tma), ("TMA_LOADS", use_tma),
                                                 ("EVEN_K", self._even_keys(p, tile.block_n)))
        sizes = self._sizes(p, params.q.shape[-1])
        launch.forward(params.q, params.k, params.v, out, lse, self._sequence_args(p, params, lse), sizes, scores,
                       features, tile, config.head_block(sizes.head_dim),
                       (triton_cdiv(p.seqlen_q, tile.block_m), p.batch * p.heads_q)).launch()

    def _forward_ws(self, p: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                    lse: torch.Tensor) -> None:
        """The warp-specialised forward: one launch of fwd_ws."""
        from .gluon import fwd_ws
        tile = self.fwd_ws_tile or self._fwd_ws_tile(p)
        fwd_ws.launch(params.q, params.k, params.v, out, lse, params.cu_seqlens_q, params.cu_seqlens_k,
                      varlen=p.varlen, batch=p.batch, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, scale=p.softmax_scale,
                      tile=tile, mask=self._gluon_mask(p), schedule=self._schedule(p, params, "forward"))

    # ---- backward ------------------------------------------------------------------------------
    @_per_problem
    def backward_plan(self, problem: AttentionProblem) -> WorkspacePlan:
        p, d = problem, problem.head_dim_padded
        buffers = [BufferSpec("softmax_d", p.lse_shape, torch.float32, False,
                                  "delta = rowsum(dO * O), strided like lse")]
        ws_reasons = self.ws_reasons(p)
        if not ws_reasons:
            heads = self._ws_kv_heads_per_launch(p) * p.group_size
            tile = self._ws_tile(p)
            buffers.append(BufferSpec("dq_accum", (*p.q_rows_shape, heads, d), torch.float32, False,
                                      f"fp32 dQ of {heads} query heads per launch "
                                      "(TMA reduce-adds; zeroed by bwd_preprocess, then by a fill "
                                      "before each later launch)"))
            if p.deterministic:
                tiles = bwd_ws_semaphore_tiles(p.seqlen_q, tile)
                buffers.append(BufferSpec("dq_semaphore", (p.batch, heads, tiles), torch.int32, False,
                                          "orders the dQ adds per (batch, head, query tile); zeroed by "
                                          "bwd_preprocess, and before each later launch"))
            notes = ["warp-specialised Gluon, sm_90"]
            if tile.split_d:
                notes.append("two warpgroups split the head dim")
            if self._schedule_walk(p, "backward"):
                notes.append("varlen schedule: the longest key tiles first")
            elif tile.key_major:
                notes.append("key-major grid: the longest causal key tiles first")
            kernel = f"{'bwd_ws_split' if tile.split_d else 'bwd_ws'} ({'; '.join(notes)})"
            return WorkspacePlan(self.name, tuple(buffers), reduce_expanded_kv=False, kernel=kernel)
        kernel = "bwd_main (one launch: key tiles + dQ pass)" if not self._dq_atomic(p) else "bwd_main (atomic dQ)"
        kernel += "; bwd_ws not used: " + ", ".join(ws_reasons)
        if self._dq_atomic(p):
            buffers.append(BufferSpec("dq_accum", (*p.q_rows_shape, p.heads_q, d), torch.float32, False,
                                      "fp32 dQ laid out like q, atomic adds (zeroed by bwd_preprocess)"))
        if self._accumulate_kv(p):
            acc_shape = (p.heads_k, p.total_k, d) if p.varlen else (p.batch, p.heads_k, p.seqlen_k, d)
            for name in ("dk_accum", "dv_accum"):
                buffers.append(BufferSpec(name, acc_shape, torch.float32, False,
                                          f"fp32 {name[:2]} summed over groups of {p.group_size} "
                                          "(zeroed by bwd_preprocess)"))
            if p.deterministic:
                tiles = triton_cdiv(p.seqlen_k, self._configs(p).bwd_kv.block_n)
                buffers.append(BufferSpec("dkv_semaphore", (max(tiles, 1), p.batch, p.heads_k), torch.int32, False,
                                          "orders the group's adds per (key tile, batch, kv head)"))
        return WorkspacePlan(self.name, tuple(buffers), reduce_expanded_kv=False, kernel=kernel)

    @_replayed
    def backward(self, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor, workspace: dict[str, torch.Tensor]) -> None:
        _prepare_launch()
        p = problem
        if not self._gluon_reasons(p, config.BWD_WS_RULE):
            if config.BWD_WS_RULE.option not in _FAILED_TO_COMPILE:
                try:
                    self._backward_ws(p, params, out, lse, dout, dq, dk, dv, workspace)
                    return
                except KernelCompileError as error:    # dq, dk, dv not written yet: the one-launch kernels
                    _failed_to_compile(config.BWD_WS_RULE, error)
                    p.memo.clear()
            # this call's plan is bwd_ws's: its softmax_d is all that the accumulator-free one-launch backward needs
            with _naming_the_call(p):
                self._without_accumulators()._backward_one_launch(p, params, out, lse, dout, dq, dk, dv,
                                                                   {"softmax_d": workspace["softmax_d"]})
            return
        with _naming_the_call(p):
            self._backward_one_launch(p, params, out, lse, dout, dq, dk, dv, workspace)

    def _without_accumulators(self) -> TritonBackend:
        """This backend's one-launch backward with neither fp32 dQ nor dK/dV accumulators (dQ pass, group loop)."""
        return TritonBackend("loop", "pass", self.use_tma, self.configs, ws=False, fwd_ws=self.fwd_ws,
                             fwd_ws_tile=self.fwd_ws_tile, varlen_schedule=self.varlen_schedule)

    def _backward_one_launch(self, p: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                             lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                             dv: torch.Tensor, workspace: dict[str, torch.Tensor]) -> None:
        """bwd_preprocess, the one-launch bwd_main (key-tile and dQ-pass roles), bwd_postprocess."""
        cfg = self._configs(p)
        delta = workspace["softmax_d"]
        dq_acc = workspace.get("dq_accum")
        dk_acc, dv_acc = workspace.get("dk_accum"), workspace.get("dv_accum")
        sems = workspace.get("dkv_semaphore")
        assert (dq_acc is not None) == self._dq_atomic(p) and (dk_acc is not None) == self._accumulate_kv(p)
        seq, sizes = self._sequence_args(p, params, delta), self._sizes(p, params.q.shape[-1])
        d = sizes.head_dim
        block_d = config.head_block(d)
        assert launch.lse_strides(delta, p.varlen) == launch.lse_strides(lse, p.varlen), \
            "softmax_d must be strided like lse"

        # ---- 1. delta = rowsum(dO * O); zero the accumulators and semaphores ----
        self._preprocess(p, out, dout, delta, (dq_acc, dk_acc, dv_acc, sems), sizes)

        # ---- 2. one launch: key-tile programs (dK/dV, and dQ in atomic mode), then the dQ pass ----
        kv, dq_tile = cfg.bwd_kv, cfg.bwd_dq
        loop_group = not self._accumulate_kv(p)
        inputs = (params.q, params.k, params.v, dout)
        dq_target = dq_acc if dq_acc is not None else dq
        tma_mode = self._tma_plan(p, "backward", *inputs, dq_target, dk, dv,
                                  *(t for t in (dk_acc, dv_acc) if t is not None))
        use_tma = tma_mode != "none"
        prog_heads = p.heads_k if loop_group else p.heads_q
        query_tiles = triton_cdiv(p.seqlen_q, dq_tile.block_m)
        query_programs = 0 if dq_acc is not None else (p.heads_q // prog_heads) * query_tiles
        programs = triton_cdiv(p.seqlen_k, kv.block_n) + query_programs
        if programs > 0:
            scores, features = self._scores_features(
                p, ("VARLEN", p.varlen), ("LOOP_GROUP", loop_group), ("DQ_ATOMIC", dq_acc is not None),
                ("DETERMINISTIC", p.deterministic), ("USE_TMA", use_tma),
                ("TMA_LOADS", use_tma and tma_mode == "all"), ("DP_FIRST", cfg.bwd_dp_first),
                ("EVEN_K", cfg.bwd_even_k and self._even_keys(p, kv.block_n, dq_tile.block_n)))
            launch.bwd_main(params.q, params.k, params.v, dout, lse, delta, dq_target, dk, dv, dk_acc, dv_acc, sems,
                            seq, p.batch, sizes, scores, features, kv, dq_tile, block_d,
                            (programs, p.batch * prog_heads)).launch()

        # ---- 3. fp32 accumulators -> output dtype ----
        self._postprocess(p, dq, dk, dv, dq_acc, dk_acc, dv_acc, d)

    @staticmethod
    def _preprocess(p: AttentionProblem, out: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor,
                    accumulators: tuple, sizes: launch.Sizes) -> None:
        """delta = rowsum(dO * O) into `delta`; zero the plan's fp32 accumulators and semaphores (None: absent)."""
        launch.bwd_preprocess(out, dout, delta, accumulators, p.batch, sizes, p.varlen,
                              config.head_block(sizes.head_dim)).launch()

    @staticmethod
    def _postprocess(p: AttentionProblem, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                     dq_acc: torch.Tensor | None, dk_acc: torch.Tensor | None, dv_acc: torch.Tensor | None,
                     d: int) -> None:
        """The fp32 accumulators that this plan has -> dq (atomic dQ), dk/dv (GQA "accumulate")."""
        batch = 1 if p.varlen else p.batch
        if dq_acc is not None:
            _cast(dq_acc, dq, launch.bhr(dq_acc, p.varlen), launch.bhr(dq, p.varlen), p.heads_q, batch,
                  p.rows_q // batch, d)
        if dk_acc is not None:
            for acc, grad in ((dk_acc, dk), (dv_acc, dv)):
                acc_bhr = (0, acc.stride(0), acc.stride(1)) if p.varlen else acc.stride()[:3]
                _cast(acc, grad, acc_bhr, launch.bhr(grad, p.varlen), p.heads_k, batch, p.rows_k // batch, d)

    def _backward_ws(self, p: AttentionProblem, params: AttentionParams, out: torch.Tensor, lse: torch.Tensor,
                     dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                     workspace: dict[str, torch.Tensor]) -> None:
        """The warp-specialised backward: delta (zeroing dq_accum and the semaphores), then per group of kv heads:
        bwd_ws, the dQ cast, and a zeroing of dq_accum and the semaphores where another group follows. Kernel
        launches and views only (`launch.derived`), so that the replay re-issues every group's launches."""
        from .gluon import bwd_ws, gluon_common
        d = params.q.shape[-1]
        tile = self._ws_tile(p)
        delta, dq_acc, sems = workspace["softmax_d"], workspace["dq_accum"], workspace.get("dq_semaphore")
        sizes = self._sizes(p, d)
        self._preprocess(p, out, dout, delta, (dq_acc, None, None, sems), sizes)
        q, k, v = (gluon_common.uniform_rows(t, p.varlen) for t in (params.q, params.k, params.v))
        dout = gluon_common.uniform_rows(dout, p.varlen)
        mask = self._gluon_mask(p)
        schedule = self._schedule(p, params, "backward")     # one for every launch: the same items
        kv_per_launch, group = self._ws_kv_heads_per_launch(p), p.group_size
        batch = 1 if p.varlen else p.batch
        stats_heads_dim = 0 if p.varlen else 1      # lse/delta: (h, total_q) or (b, h, s_q)
        for h0 in range(0, p.heads_k, kv_per_launch):
            kv = slice(h0, min(h0 + kv_per_launch, p.heads_k))
            hq = slice(kv.start * group, kv.stop * group)
            launch_heads = slice(0, hq.stop - hq.start)
            acc = _heads(dq_acc, -2, launch_heads)
            sem = None if sems is None else _dense_prefix(sems, (sems.shape[0], launch_heads.stop, sems.shape[2]))
            lse_h, delta_h = (_heads(t, stats_heads_dim, hq) for t in (lse, delta))
            dk_h, dv_h = _heads(dk, -2, kv), _heads(dv, -2, kv)
            bwd_ws.launch(_heads(q, -2, hq), _heads(k, -2, kv), _heads(v, -2, kv), _heads(dout, -2, hq), lse_h, delta_h,
                          acc, dk_h, dv_h, params.cu_seqlens_q, params.cu_seqlens_k, varlen=p.varlen, batch=p.batch,
                          seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, scale=p.softmax_scale, mask=mask, tile=tile,
                          semaphores=sem, schedule=schedule)
            dq_h = _heads(dq, -2, hq)
            _cast(acc, dq_h, launch.bhr(acc, p.varlen), launch.bhr(dq_h, p.varlen), hq.stop - hq.start, batch,
                  p.rows_q // batch, d)
            if kv.stop < p.heads_k:     # the next launch adds into the accumulator and counts in the semaphores
                launch.zero_flat(*(t for t in (acc, sems) if t is not None)).launch()


@contextlib.contextmanager
def _naming_the_call(p: AttentionProblem):
    """Within the block a kernel that fails to compile raises KernelCompileError naming the call too."""
    try:
        yield
    except KernelCompileError as error:
        if error.call:
            raise
        raise error.for_call(describe(p)) from None


def describe(p: AttentionProblem) -> str:
    """A call's shape and features in a line: what a compile error names."""
    rows = f"varlen b {p.batch}, max s_q {p.seqlen_q}, max s_k {p.seqlen_k}" if p.varlen else \
        f"b {p.batch}, s_q {p.seqlen_q}, s_k {p.seqlen_k}"
    features = [name for name, on in (("ALiBi", p.has_alibi), (f"softcap {p.softcap}", p.softcap),
                                      (f"dropout {p.dropout_p}", p.dropout_p), ("deterministic", p.deterministic))
                if on]
    return ", ".join([rows, f"h {p.heads_q}/{p.heads_k}, d {p.head_dim}", str(p.dtype).removeprefix("torch."),
                      f"mask {p.mask.describe()}", *features])


def _heads(t: torch.Tensor, dim: int, heads: slice) -> torch.Tensor:
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


def _cast(src: torch.Tensor, dst: torch.Tensor, src_bhr, dst_bhr, heads: int, batch: int, rows: int, d: int) -> None:
    if rows == 0:
        return
    launch.cast_rows(src, dst, src_bhr, dst_bhr, heads, batch, rows, config.head_block(d), d).launch()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
