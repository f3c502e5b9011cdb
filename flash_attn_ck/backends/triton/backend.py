"""TritonBackend: the CUDA (Hopper-first) kernels behind the common pipeline.

Which kernel runs a call: operators.py's FORWARD and BACKWARD lists, fastest first; a call runs the first operator
with no reasons (`operator`), and `kernel_choice` (the forward's `forward_kernel`, a backward plan's `kernel`) names
it and why each one before it does not run. This class holds the settings the operators read, the workspace plan,
the replay of a call's launches, and the fall back to the next operator when a Gluon kernel fails to compile.

Settings (constructor arguments, defaults from the environment):
  gqa_epilogue  "loop" (default): a key-tile program of bwd_main loops over its group's query heads, dK/dV
                stay on chip, no fp32 accumulators. "accumulate": the Hopper epilogue, one program
                per query head adding into fp32 (b, h_k, s_k, d) accumulators (+ semaphores when
                deterministic).            env FLASH_ATTN_CK_TRITON_GQA
  dq_mode       "auto" (default): operators.BwdMainAtomicDq where its declarations say it measured faster, else
                the dQ pass (BwdMain). "pass": never atomic dQ. "atomic": atomic dQ wherever it can run
                (not in deterministic mode).       env FLASH_ATTN_CK_TRITON_DQ
  use_tma       None = TMA tensor descriptors (runtime/launch.py's row_io) on sm_90+ when the tensors are dense and
                16-byte aligned, for the forward when config.Configs.fwd_tma and for the backward tiles that
                Configs.bwd_tma names (neither for short sequences); True: every tile, forward and
                backward, where the tensors allow; False: masked pointers.
  configs       the one-launch kernels' tiles (None: config.select's).
  fwd_ws, ws    the Gluon operators: None where their declarations say they measured faster, True wherever they
                can run, False never; fwd_ws_tile, ws_tile: their tiles (None: their tables').
  varlen_schedule  None = config.VARLEN_SCHEDULE; True: the warp-specialised kernels run varlen calls on a
                grid over the call's real (sequence, tile) items, longest first (runtime/varlen_schedule.py, built on
                the device per call; `GluonOperator.schedule_walk` says where); False: on the grid over every (batch,
                tile of the longest sequence).
The choice of defaults and the measurements behind it: docs/triton.md.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from ...core.errors import KernelCompileError
from ...core.plan import BufferSpec, WorkspacePlan
from ...core.problem import AttentionParams, AttentionProblem
from ..base import Backend
from . import config, operators
from .operators import (
    BackwardOperator,
    BwdMain,
    ForwardOperator,
    GluonOperator,
    Operator,
    mask_args,
    per_problem,
    value_head_dim,
)
from .runtime import launch, replay, target

GQA_ENV = "FLASH_ATTN_CK_TRITON_GQA"
DQ_ENV = "FLASH_ATTN_CK_TRITON_DQ"


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _prepare_launch() -> None:
    """Device-side tensor descriptors (and, seen on the H200, the dropout variants of the kernels)
    need global scratch from triton.set_allocator. The allocator lives in a context variable, so
    it is set before every launch: autograd runs the backward on its own thread."""
    if not target.INTERPRETING:
        import triton
        triton.set_allocator(_scratch)


_MISSING = object()

# Replays kept per (backend, problem): the layouts of one call signature's tensors (alignment, a caller's strides;
# emptied when full; 0: none).
REPLAYS_PER_PROBLEM = 16
# Replays of the varlen outside-rows fill, by layout (the process's recent ones; cleared when full; 0: none).
FILL_REPLAYS = 256
_FILL_REPLAYS: dict[tuple, replay.Replay | None] = {}


def _replayed(method):
    """A TritonBackend entry point (forward, backward) whose launches are recorded on the first call of a
    (problem, layout of its tensors) and replayed on later ones (runtime/replay.py): `method(p, params, *tensors,
    [workspace])` reads and writes only params' tensors, `tensors` and the workspace's. Interpreted and CPU calls,
    and calls while a profiler hook is installed, run the method. The current device and stream are read once per
    call: the device for the key, the stream for the replay's launches."""
    name = method.__name__

    @functools.wraps(method)
    def run(self, p, params, *rest):
        if target.INTERPRETING or not params.q.is_cuda or launch.hooked() or not REPLAYS_PER_PROBLEM:
            return method(self, p, params, *rest)
        has_workspace = isinstance(rest[-1], dict)
        workspace, positional = (rest[-1], rest[:-1]) if has_workspace else ({}, rest)
        tensors = (params.q, params.k, params.v, params.cu_seqlens_q, params.cu_seqlens_k, params.alibi_slopes,
                   params.rng_state, params.learnable_sink, *positional, *workspace.values())
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
    gqa_epilogue: str
    dq_mode: str
    name = "triton"
    priority = 100
    device_types = frozenset({"cuda"})
    # Chunks of whole batch entries, KV groups or query-head slices are views the kernels read by their
    # strides, so a workspace cap below the warp-specialised kernel's fp32 dq_accum chunks the call
    # instead of failing. Not query rows, and not with dropout: the kernels draw the keep pattern at
    # launch-local (batch, head) coordinates.
    supports_chunks = True
    # What some operator of each role runs (operators.py): the one-launch kernels run every feature, fp32 results
    # included (they store through row_io's casts).
    mask_kinds = operators.declared_mask_kinds()
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

    def _with(self, **settings) -> TritonBackend:
        """This backend with `settings` changed."""
        current = dict(gqa_epilogue=self.gqa_epilogue, dq_mode=self.dq_mode, use_tma=self.use_tma,
                       configs=self.configs, ws=self.ws, ws_tile=self.ws_tile, fwd_ws=self.fwd_ws,
                       fwd_ws_tile=self.fwd_ws_tile, varlen_schedule=self.varlen_schedule)
        return TritonBackend(**{**current, **settings})

    def leaner(self) -> TritonBackend | None:
        """The one-launch backward, which needs no fp32 dQ accumulator, where the warp-specialised one may run."""
        if self.ws is False:
            return None
        return self._with(ws=False, ws_tile=None)

    # ---- capabilities --------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not importable"
        if torch.version.hip is not None:
            return "this is a ROCm build of torch (the Triton backend targets CUDA)"
        if not target.INTERPRETING and not torch.cuda.is_available():
            return "no CUDA device"
        return None

    # ---- which kernel runs: the first operator of the role with no reasons ------------------------------------
    def reasons(self, p: AttentionProblem, operator: type[Operator]) -> list[str]:
        """Why `operator` does not run this call, in words; empty when it may."""
        return list(operator.reasons(self, p))

    @per_problem(owners=1)
    def operator(self, p: AttentionProblem, role: str) -> type[Operator]:
        """The operator that runs the call's `role` ("forward" or "backward"): the first of operators.FORWARD or
        BACKWARD with no reasons. The last of each list refuses nothing the backend accepts, so it is also the answer
        for a call the backend refuses (a workspace plan asked of every backend): its reasons are the backend's."""
        ops = operators.OPERATORS[role]
        return next((op for op in ops if not op.reasons(self, p)), ops[-1])

    def kernel_choice(self, p: AttentionProblem, role: str) -> str:
        """The kernel that runs the call's `role` and how, then why each operator before it does not run."""
        chosen = self.operator(p, role)
        passed = operators.OPERATORS[role][:operators.OPERATORS[role].index(chosen)]
        return "; ".join([chosen.describe(self, p), *(f"{op.name} not used: {', '.join(op.reasons(self, p))}"
                                                       for op in passed)])

    def forward_kernel(self, problem: AttentionProblem) -> str:
        return self.kernel_choice(problem, "forward")

    def forward_takes_sink(self, problem: AttentionProblem) -> bool:
        return self.operator(problem, "forward").takes_sink

    def fp32_outputs_slower(self, problem: AttentionProblem) -> str | None:
        """The operators that write input-dtype results only (the Gluon ones): a call they run takes a later operator
        for fp32 results."""
        uses = [op.name for op in (self.operator(problem, "forward"), self.operator(problem, "backward"))
                if op.fp32_outputs_refusal]
        return f"{' and '.join(uses)} would give way to the older kernels" if uses else None

    # ---- what the operators read ---------------------------------------------------------------------------
    @per_problem(owners=1)
    def configs_for(self, p: AttentionProblem) -> config.Configs:
        """The one-launch kernels' tiles for the call."""
        if self.configs is not None:
            return self.configs
        capability = target.capability(p.device) if p.device.type == "cuda" else None
        # The tiles of the wider head block: v's where it is wider (its dV and out tiles are the larger ones).
        return config.select(p.widest_head_dim_padded, p.mask.is_causal, capability, target.INTERPRETING,
                             max(p.seqlen_q, p.seqlen_k))

    def accumulate_kv(self, p: AttentionProblem) -> bool:
        """Whether bwd_main sums a GQA call's dK/dV in fp32 accumulators (gqa_epilogue "accumulate"): rows of one
        width, so only where q/k and v have one kernel head dim; else the key-tile programs loop over the group."""
        return p.is_gqa and self.gqa_epilogue == "accumulate" and value_head_dim(p) is None

    def tma_plan(self, p: AttentionProblem, role: str, *tensors: torch.Tensor) -> str:
        """Which tiles of a one-launch `role` ("forward" or "backward") launch move through TMA descriptors: "all"
        (loads and stores), "stores" (loads by pointers) or "none". TMA needs sm_90+ and dense tensors
        with 16-byte aligned bases and row strides; `tensors` are checked when given (at launch),
        before that the plan is what the problem and the configs tell."""
        mode = self._tma_mode(p, role)
        if mode == "none" or all(t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0
                                                                for s in t.stride()[:-1]) for t in tensors):
            return mode
        return "none"

    @per_problem(owners=1)
    def _tma_mode(self, p: AttentionProblem, role: str) -> str:
        """`tma_plan` before the tensors are seen."""
        if self.use_tma is False or p.varlen:
            return "none"
        if self.use_tma is True:
            return "all"     # forced: every tile, forward and backward, where the tensors allow
        architecture = target.architecture(p.device)
        if architecture is None or architecture < 9:
            return "none"
        cfg = self.configs_for(p)
        return cfg.bwd_tma if role == "backward" else "all" if cfg.fwd_tma else "none"

    @staticmethod
    def sequence_args(p: AttentionProblem, params: AttentionParams, dummy: torch.Tensor) -> launch.SequenceArgs:
        """The per-call pointers of the score features (`dummy` where a feature is off)."""
        slopes = params.alibi_slopes
        cu_seqlens_q, cu_seqlens_k = (params.cu_seqlens_q, params.cu_seqlens_k) if p.varlen else (dummy, dummy)
        rng_state = params.rng_state if p.dropout_p > 0 else dummy
        assert cu_seqlens_q is not None and cu_seqlens_k is not None and rng_state is not None
        return launch.SequenceArgs(cu_seqlens_q, cu_seqlens_k,
                                   slopes.to(torch.float32).contiguous() if slopes is not None else dummy, rng_state)

    @per_problem(owners=1)
    def sizes(self, p: AttentionProblem, head_dim: int) -> launch.Sizes:
        return launch.Sizes(p.heads_q, p.group_size, p.seqlen_q, p.seqlen_k, head_dim)

    @per_problem(owners=1)
    def scores_features(self, p: AttentionProblem,
                        *flags: tuple[str, bool]) -> tuple[launch.ScoreArgs, launch.Features]:
        """The ScoreArgs and Features of a one-launch kernel's launch: the problem's score features and mask, plus
        `flags` ((Features field, value) pairs: the launch's own)."""
        named = dict(HAS_ALIBI=p.has_alibi, HAS_SOFTCAP=p.softcap != 0.0, HAS_DROPOUT=p.dropout_p > 0,
                     scale=p.softmax_scale, softcap=p.softcap, dropout_p=p.dropout_p, **mask_args(p))
        value = value_head_dim(p)
        if value is not None:       # else HEAD_DIM_V 0 and BLOCK_DV q/k's (launch.py): the one-head-dim kernels
            named.update(HEAD_DIM_V=value[0], BLOCK_DV=value[1])
        return launch.split_named(named, **dict(flags))

    def fill_outside_sequences(self, *fills: tuple[torch.Tensor, torch.Tensor, int, float]) -> None:
        """Every fill of the call in one launch (runtime/outside_rows.py) on a GPU: the generic form costs two launches
        per offset tensor and one per tensor, which a small varlen call pays in host time."""
        if target.INTERPRETING or fills[0][0].device.type != "cuda":
            super().fill_outside_sequences(*fills)
            return
        if launch.hooked() or not FILL_REPLAYS:
            self._fill_outside(fills)
            return
        # Replayed per layout (runtime/replay.py): the launch follows from the tensors' layouts, dims and values alone.
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
        operator = self.operator(p, "forward")
        assert issubclass(operator, ForwardOperator)
        if issubclass(operator, GluonOperator):     # a Gluon kernel may fail to compile under this Triton
            try:
                operator.run(self, p, params, out, lse)
                return
            except KernelCompileError as error:     # nothing was written: the next operator runs the call
                operators.failed_to_compile(operator, error)
                p.memo.clear()
                operator = self.operator(p, "forward")
                assert issubclass(operator, ForwardOperator)
        with _naming_the_call(p):
            operator.run(self, p, params, out, lse)

    # ---- backward ------------------------------------------------------------------------------
    @per_problem(owners=1)
    def backward_plan(self, problem: AttentionProblem) -> WorkspacePlan:
        p = problem
        operator = self.operator(p, "backward")
        assert issubclass(operator, BackwardOperator)
        buffers = [BufferSpec("softmax_d", p.lse_shape, torch.float32, False,
                              "delta = rowsum(dO * O), strided like lse"), *operator.buffers(self, p)]
        return WorkspacePlan(self.name, tuple(buffers), reduce_expanded_kv=False,
                             kernel=self.kernel_choice(p, "backward"))

    @_replayed
    def backward(self, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor, workspace: dict[str, torch.Tensor]) -> None:
        _prepare_launch()
        p = problem
        operator = self.operator(p, "backward")
        assert issubclass(operator, BackwardOperator)
        if issubclass(operator, GluonOperator):     # a Gluon kernel may fail to compile under this Triton
            if operator.name not in operators.FAILED_TO_COMPILE:
                try:
                    operator.run(self, p, params, out, lse, dout, dq, dk, dv, workspace)
                    return
                except KernelCompileError as error:    # dq, dk, dv not written yet: the one-launch kernels
                    operators.failed_to_compile(operator, error)
                    p.memo.clear()
            # this call's plan is the Gluon operator's: its softmax_d is all that the accumulator-free one-launch
            # backward needs
            with _naming_the_call(p):
                BwdMain.run(self._with(gqa_epilogue="loop", dq_mode="pass", ws=False), p, params, out, lse, dout, dq,
                            dk, dv, {"softmax_d": workspace["softmax_d"]})
            return
        with _naming_the_call(p):
            operator.run(self, p, params, out, lse, dout, dq, dk, dv, workspace)


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
