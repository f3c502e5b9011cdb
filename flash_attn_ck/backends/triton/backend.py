"""TritonBackend: the CUDA (Hopper-first) kernels behind the common frontend.

Forward: forward.py. Backward, in launch order:
  1. bwd_preprocess: D = rowsum(dO * O) into workspace['softmax_d']; zero the fp32 accumulators
     and semaphores of this plan.
  2. bwd_main: one launch with two program roles: one program per key tile (dK/dV on chip;
     epilogue per bwd_epilogue, SPEC §4) and, in dq_mode "pass" (always when deterministic), one
     per query tile (bwd_dq: dQ).
  3. bwd_postprocess: fp32 accumulators -> dk/dv (GQA "accumulate") and dq (dq_mode "atomic").

Options (constructor arguments, defaults from the environment):
  gqa_epilogue  "loop" (default): a key-tile program loops over its group's query heads, dK/dV
                stay on chip, no fp32 accumulators. "accumulate": the seed's epilogue, one program
                per query head adding into fp32 (b, h_k, s_k, d) accumulators (+ semaphores when
                deterministic).            env FLASH_ATTN_CK_TRITON_GQA
  dq_mode       "auto" (default): "atomic" only where the H200 measured it faster and memory allows
                (MHA, head block 128, not deterministic, tiles loaded by pointers, longest sequence
                over config.SHORT_SEQLEN: 385 vs 329 TF/s at s8192; with TMA loads, and on short
                sequences, the pass wins), else "pass".
                "pass": separate query-tile pass, no dQ accumulator, deterministic.
                "atomic": fp32 dQ accumulator laid out like q, added by the key-tile programs
                (refused in deterministic mode).       env FLASH_ATTN_CK_TRITON_DQ
  use_tma       None = TMA tensor descriptors (tiles.py) on sm_90+ when the tensors are dense and 16-byte
                aligned, for the forward when config.Configs.fwd_tma and for the backward tiles that
                Configs.bwd_tma names (neither for short sequences); True: every tile, forward and
                backward, where the tensors allow; False: masked pointers.
The choice of defaults and the measurements behind it: docs/triton.md.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from ...frontend.mask import MaskType
from ...frontend.plan import BufferSpec, WorkspacePlan
from ...frontend.problem import AttentionParams, AttentionProblem
from ..base import Backend
from . import config, launch

GQA_ENV = "FLASH_ATTN_CK_TRITON_GQA"
DQ_ENV = "FLASH_ATTN_CK_TRITON_DQ"


# Read once, like triton itself, which decides when the kernels' modules are imported.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device (a tensor's device: its index is set); read up to three
    times per call, so cached."""
    return torch.cuda.get_device_capability(device)


def _scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _prepare_launch() -> None:
    """Device-side tensor descriptors (and, seen on the H200, the dropout variants of the kernels)
    need global scratch from triton.set_allocator. The allocator lives in a context variable, so
    it is set before every launch: autograd runs the backward on its own thread."""
    if not _INTERPRETING:
        import triton
        triton.set_allocator(_scratch)


class TritonBackend(Backend):
    name = "triton"
    priority = 100
    device_types = frozenset({"cuda"})

    def __init__(self, gqa_epilogue: Optional[str] = None, dq_mode: Optional[str] = None,
                 use_tma: Optional[bool] = None, configs: Optional[config.Configs] = None):
        self.gqa_epilogue = gqa_epilogue or os.environ.get(GQA_ENV, "loop")
        self.dq_mode = dq_mode or os.environ.get(DQ_ENV, "auto")
        if self.gqa_epilogue not in ("loop", "accumulate"):
            raise ValueError(f"gqa_epilogue={self.gqa_epilogue!r}: expected 'loop' or 'accumulate'")
        if self.dq_mode not in ("auto", "pass", "atomic"):
            raise ValueError(f"dq_mode={self.dq_mode!r}: expected 'auto', 'pass' or 'atomic'")
        self.use_tma = use_tma
        self.configs = configs

    # ---- capabilities --------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not importable"
        if torch.version.hip is not None:
            return "this is a ROCm build of torch (the Triton backend targets CUDA)"
        if not _INTERPRETING and not torch.cuda.is_available():
            return "no CUDA device"
        return None

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        if problem.mask.type == MaskType.WINDOW_GENERIC:
            return ["generic (y, x) window masks are not supported"]
        return []

    # ---- configuration -------------------------------------------------------------------------
    def _configs(self, p: AttentionProblem) -> config.Configs:
        if self.configs is not None:
            return self.configs
        cap = _capability(p.device) if p.device.type == "cuda" else None
        return config.select(p.head_dim_padded, p.mask.is_causal, cap, _INTERPRETING, max(p.seqlen_q, p.seqlen_k))

    def _dq_atomic(self, p: AttentionProblem) -> bool:
        if p.deterministic:
            return False
        if self.dq_mode == "auto":
            # bench/h200-2026-11-29-tma-loads.md, d128 MHA s8192: with TMA tile loads the pass wins
            # (392 vs 341 TF/s) and needs no fp32 dQ; with pointer loads atomics won (385 vs 329).
            # GQA keeps the pass: an fp32 dQ the size of q would break the memory target.
            # Short sequences load by pointers but keep the pass: it measured faster there (0.610 vs 0.675 ms
            # of GPU time at d128 s512, 1.841 vs 2.019 at s2048; config.SHORT_SEQLEN).
            return (not p.is_gqa and config.head_block(p.head_dim_padded) == 128 and not self._tma_loads_planned(p)
                    and max(p.seqlen_q, p.seqlen_k) > config.SHORT_SEQLEN)
        return self.dq_mode == "atomic"

    def _tma_loads_planned(self, p: AttentionProblem) -> bool:
        """Whether the backward will load its tiles through TMA, as far as the problem tells (the
        tensors' alignment, checked at launch by `_tma`, can still turn it off)."""
        if self.use_tma is False or p.varlen or _INTERPRETING or p.device.type != "cuda":
            return False
        if self.use_tma is None and _capability(p.device)[0] < 9:
            return False
        return self.use_tma is True or self._configs(p).bwd_tma == "all"

    def _accumulate_kv(self, p: AttentionProblem) -> bool:
        return p.is_gqa and self.gqa_epilogue == "accumulate"

    def _tma(self, p: AttentionProblem, *tensors: torch.Tensor) -> bool:
        """TMA needs sm_90+, dense tensors, 16-byte aligned bases and row strides."""
        if self.use_tma is False or p.varlen:
            return False
        if self.use_tma is None:
            if _INTERPRETING or p.device.type != "cuda" or _capability(p.device)[0] < 9:
                return False
        return all(t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])
                   for t in tensors)

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

    @staticmethod
    def _feature_args(p: AttentionProblem, params: AttentionParams, dummy: torch.Tensor) -> tuple[list, dict]:
        slopes = params.alibi_slopes
        if slopes is not None:
            slopes = slopes.to(torch.float32).contiguous()
        pointers = [params.cu_seqlens_q if p.varlen else dummy, params.cu_seqlens_k if p.varlen else dummy,
                    slopes if slopes is not None else dummy,
                    params.rng_state if p.dropout_p > 0 else dummy]
        stride_slope_b = slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0
        flags = dict(HAS_ALIBI=slopes is not None, HAS_SOFTCAP=p.softcap != 0.0, HAS_DROPOUT=p.dropout_p > 0)
        scalars = dict(scale=p.softmax_scale, softcap=p.softcap, dropout_p=p.dropout_p)
        return pointers, dict(stride_slope_b=stride_slope_b, **flags, **scalars)

    def _launch_args(self, p: AttentionProblem, params: AttentionParams,
                     dummy: torch.Tensor) -> tuple[launch.SequenceArgs, launch.Sizes, dict]:
        """The pointers, sizes and named values (ScoreArgs and Features fields) of a kernel call."""
        pointers, named = self._feature_args(p, params, dummy)
        seq = launch.SequenceArgs(*pointers, named.pop("stride_slope_b"))
        sizes = launch.Sizes(p.heads_q, p.group_size, p.seqlen_q, p.seqlen_k, params.q.shape[-1])
        return seq, sizes, dict(named, **self._mask_args(p))

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, problem: AttentionProblem, params: AttentionParams,
                out: torch.Tensor, lse: torch.Tensor) -> None:
        p = problem
        if p.rows_q == 0:
            return
        _prepare_launch()
        cfg = self._configs(p)
        tile = cfg.forward
        seq, sizes, named = self._launch_args(p, params, lse)
        use_tma = (cfg.fwd_tma or self.use_tma is True) and self._tma(p, params.q, params.k, params.v, out)
        scores, features = launch.split_named(named, VARLEN=p.varlen, USE_TMA=use_tma, TMA_LOADS=use_tma,
                                              EVEN_K=self._even_keys(p, tile.block_n))
        launch.forward(params.q, params.k, params.v, out, lse, seq, sizes, scores, features, tile,
                       config.head_block(sizes.head_dim), (triton_cdiv(p.seqlen_q, tile.block_m), p.batch * p.heads_q)
                       ).launch()

    # ---- backward ------------------------------------------------------------------------------
    def backward_plan(self, problem: AttentionProblem) -> WorkspacePlan:
        p, d = problem, problem.head_dim_padded
        lse_shape = (p.heads_q, p.total_q) if p.varlen else (p.batch, p.heads_q, p.seqlen_q)
        buffers = [BufferSpec("softmax_d", lse_shape, torch.float32, False, "D = rowsum(dO * O), strided like lse")]
        if self._dq_atomic(p):
            rows_q = (p.total_q,) if p.varlen else (p.batch, p.seqlen_q)
            buffers.append(BufferSpec("dq_accum", (*rows_q, p.heads_q, d), torch.float32, False,
                                      "fp32 dQ laid out like q, atomic adds (zeroed by bwd_preprocess)"))
        if self._accumulate_kv(p):
            acc_shape = (p.heads_k, p.total_k, d) if p.varlen else (p.batch, p.heads_k, p.seqlen_k, d)
            for name in ("dk_accum", "dv_accum"):
                buffers.append(BufferSpec(name, acc_shape, torch.float32, False,
                                          f"fp32 {name[:2]} summed over groups of {p.group_size} (zeroed by bwd_preprocess)"))
            if p.deterministic:
                tiles = triton_cdiv(p.seqlen_k, self._configs(p).bwd_kv.block_n)
                buffers.append(BufferSpec("dkv_semaphore", (max(tiles, 1), p.batch, p.heads_k), torch.int32, False,
                                          "orders the group's adds per (key tile, batch, kv head)"))
        return WorkspacePlan(self.name, tuple(buffers), reduce_expanded_kv=False)

    def backward(self, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor, workspace: dict[str, torch.Tensor]) -> None:
        p = problem
        _prepare_launch()
        cfg = self._configs(p)
        delta = workspace["softmax_d"]
        dq_acc = workspace.get("dq_accum")
        dk_acc, dv_acc = workspace.get("dk_accum"), workspace.get("dv_accum")
        sems = workspace.get("dkv_semaphore")
        assert (dq_acc is not None) == self._dq_atomic(p) and (dk_acc is not None) == self._accumulate_kv(p)
        seq, sizes, named = self._launch_args(p, params, delta)
        d = sizes.head_dim
        block_d = config.head_block(d)
        assert launch.lse_strides(delta, p.varlen) == launch.lse_strides(lse, p.varlen), \
            "softmax_d must be strided like lse"

        # ---- 1. D = rowsum(dO * O); zero the accumulators and semaphores ----
        launch.bwd_preprocess(out, dout, delta, seq.cu_seqlens_q, (dq_acc, dk_acc, dv_acc, sems), p.batch, sizes,
                              p.varlen, block_d).launch()

        # ---- 2. one launch: key-tile programs (dK/dV, and dQ in atomic mode), then the dQ pass ----
        kv, dq_tile = cfg.bwd_kv, cfg.bwd_dq
        loop_group = not self._accumulate_kv(p)
        inputs = (params.q, params.k, params.v, dout)
        dq_target = dq_acc if dq_acc is not None else dq
        tma_mode = "all" if self.use_tma is True else cfg.bwd_tma   # use_tma=True forces every tile through TMA
        use_tma = tma_mode != "none" and self._tma(p, *inputs, dq_target, dk, dv,
                                                   *(t for t in (dk_acc, dv_acc) if t is not None))
        prog_heads = p.heads_k if loop_group else p.heads_q
        query_programs = 0 if dq_acc is not None else (p.heads_q // prog_heads) * triton_cdiv(p.seqlen_q, dq_tile.block_m)
        programs = triton_cdiv(p.seqlen_k, kv.block_n) + query_programs
        if programs > 0:
            scores, features = launch.split_named(
                named, VARLEN=p.varlen, LOOP_GROUP=loop_group, DQ_ATOMIC=dq_acc is not None,
                DETERMINISTIC=p.deterministic, USE_TMA=use_tma, TMA_LOADS=use_tma and tma_mode == "all",
                DP_FIRST=cfg.bwd_dp_first, EVEN_K=cfg.bwd_even_k and self._even_keys(p, kv.block_n, dq_tile.block_n))
            launch.bwd_main(params.q, params.k, params.v, dout, lse, delta, dq_target, dk, dv, dk_acc, dv_acc, sems,
                            seq, p.batch, sizes, scores, features, kv, dq_tile, block_d,
                            (programs, p.batch * prog_heads)).launch()

        # ---- 3. fp32 accumulators -> output dtype ----
        batch = 1 if p.varlen else p.batch
        if dq_acc is not None:
            _cast(dq_acc, dq, launch.bhr(dq_acc, p.varlen), launch.bhr(dq, p.varlen), p.heads_q, batch,
                  p.rows_q // batch, d)
        if dk_acc is not None:
            for acc, grad in ((dk_acc, dk), (dv_acc, dv)):
                acc_bhr = (0, acc.stride(0), acc.stride(1)) if p.varlen else acc.stride()[:3]
                _cast(acc, grad, acc_bhr, launch.bhr(grad, p.varlen), p.heads_k, batch, p.rows_k // batch, d)


def _cast(src: torch.Tensor, dst: torch.Tensor, src_bhr, dst_bhr, heads: int, batch: int, rows: int, d: int) -> None:
    if rows == 0:
        return
    launch.cast_rows(src, dst, src_bhr, dst_bhr, heads, batch, rows, config.head_block(d), d).launch()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
