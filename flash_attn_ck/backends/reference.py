"""The reference backend: CK's kernel contract (docs/semantics.md) written in PyTorch, for any device.

It computes in fp32 and walks the keys in tiles of CK's `kN0` rows, so memory stays
O(s_q * kN0) per head and long sequences run on a CPU. The backward honours the same buffers as
CK's `fmha_bwd`: it fills `softmax_d`, adds dQ into `dq_accum` (split 0, or the key tile's own
split in deterministic mode) and converts it, and writes dK/dV per query head into the expanded
buffers for MQA/GQA, leaving the group sum to the pipeline. The pipeline therefore runs the same
steps on CPU as on MI300. The scores themselves (core/scores.py) are shared with `return_attn_probs`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..core.mask import MaskKind
from ..core.plan import BufferSpec, WorkspacePlan
from ..core.problem import AttentionParams, AttentionProblem
from ..core.scores import ScoreTile, heads_first, kept_matmul, sequences, without_autocast
from ..core.sink import fold_sink
from .base import Backend
from .ck.plan import CkBwdTile, ck_backward_plan


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    device_types = frozenset({"cpu", "cuda", "mps", "xpu"})
    auto_select_devices = frozenset({"cpu"})     # a slow oracle on accelerators: only when asked for
    mask_kinds = frozenset(MaskKind)     # any keep rule core/mask.py states, so any query-row chunk of one
    supports_chunks = True
    supports_row_chunks = True
    supports_chunked_dropout = True
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    fp32_outputs_refusal = None      # it computes in fp32: only its final copy into out, dq, dk, dv rounds

    # ---- forward -------------------------------------------------------------------------------
    @without_autocast
    def forward(self, problem: AttentionProblem, params: AttentionParams,
                out: torch.Tensor, lse: torch.Tensor) -> None:
        tile = CkBwdTile.for_problem(problem).kN0
        cdt = problem.accum_dtype
        for seq in sequences(problem, params):
            if seq.seqlen_q == 0:
                continue
            q = heads_first(seq.rows_q(params.q), cdt)
            k = heads_first(seq.rows_k(params.k), cdt, problem.group_size)
            v = heads_first(seq.rows_k(params.v), cdt, problem.group_size)
            row_max = torch.full(q.shape[:2], float("-inf"), dtype=cdt, device=q.device)
            row_sum = torch.zeros(q.shape[:2], dtype=cdt, device=q.device)
            acc = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=cdt, device=q.device)      # v's head dim
            # ---- online softmax over key tiles: rescale the running sums when the max grows ----
            for start in range(0, seq.seqlen_k, tile):
                end = min(start + tile, seq.seqlen_k)
                st = ScoreTile(problem, params, seq, q, k, start, end)
                new_max = torch.maximum(row_max, st.scores.amax(dim=-1))
                safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                probs = torch.exp(st.scores - safe_max[..., None])
                rescale = torch.exp(row_max - safe_max)
                row_sum = row_sum * rescale + probs.sum(-1)
                acc = acc * rescale[..., None] + kept_matmul(st.dropped(probs, problem.dropout_p), v[:, start:end],
                                                             st.kept)
                row_max = new_max
            empty = row_sum == 0
            safe_max = torch.where(empty, torch.zeros_like(row_max), row_max)
            row_lse = torch.where(empty, torch.full_like(row_max, float("inf")), safe_max + torch.log(row_sum))
            result = torch.where(empty[..., None], torch.zeros_like(acc), acc / row_sum.clamp_min(1e-30)[..., None])
            result = result.transpose(0, 1)
            if params.learnable_sink is not None:   # in the accumulation dtype: out is rounded once, as in a kernel
                fold_sink(params.learnable_sink, result, row_lse)
            seq.rows_q(out).copy_(result)
            seq.lse(lse).copy_(row_lse)

    def forward_takes_sink(self, problem: AttentionProblem) -> bool:
        return True

    # ---- backward ------------------------------------------------------------------------------
    def backward_plan(self, problem: AttentionProblem) -> WorkspacePlan:
        """The CK contract's buffers, plus this backend's own fp32 temporaries (a CK kernel keeps
        them in registers) so that a workspace cap also bounds what the reference allocates."""
        plan = ck_backward_plan(problem, self.name)
        return replace(plan, buffers=(*plan.buffers, self._scratch(problem)))

    @staticmethod
    def _scratch(problem: AttentionProblem) -> BufferSpec:
        """Upper bound of the temporaries live during one key tile of the largest sequence: fp32
        heads-first copies of q, dO, k, v (k/v repeated per query head), dQ/dK/dV tile products,
        and about eight score-shaped tiles (plus Philox's int64 words with dropout). q, k, dQ and dK have q's head
        dim d; dO, v and dV have v's d_v."""
        p, d, d_v = problem, problem.head_dim_padded, problem.head_dim_v_padded
        width = min(CkBwdTile.for_problem(p).kN0, max(p.seqlen_k, 1))
        size = torch.empty((), dtype=_backward_dtype(p)).element_size()
        scores = p.heads_q * p.seqlen_q * width
        per_score = size * (8 + (2 if p.softcap else 0)) + (12 * 8 + 1 if p.dropout_p > 0 else 0)
        per_head = d * (2 * p.seqlen_q + p.seqlen_k + width) + d_v * (p.seqlen_q + p.seqlen_k + width)
        nbytes = size * p.heads_q * per_head + per_score * scores
        return BufferSpec("fp32_tiles", (-(-nbytes // size),), _backward_dtype(p), False,
                          "reference: fp32 copies and score tiles of one key tile", internal=True)

    @without_autocast
    def backward(self, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor, workspace: dict[str, torch.Tensor]) -> None:
        p = problem
        dq_accum = workspace["dq_accum"]
        dk_target = workspace["dk_expanded"] if p.is_gqa else dk
        dv_target = workspace["dv_expanded"] if p.is_gqa else dv
        tile = CkBwdTile.for_problem(p).kN0
        cdt = _backward_dtype(p)

        # ---- dot_do_o: D = rowsum(dO * O), stored in fp32 laid out like lse -----------------------
        softmax_d = workspace["softmax_d"]
        for seq in sequences(p, params):
            d_rows = (seq.rows_q(dout).to(cdt) * seq.rows_q(out).to(cdt)).sum(-1)
            seq.lse(softmax_d).copy_(d_rows.transpose(0, 1))

        # ---- dq_dk_dv: one pass per key tile, dK/dV per query head, dQ into its split ------------
        for seq in sequences(p, params):
            if seq.seqlen_k == 0:
                continue
            if seq.seqlen_q == 0:
                seq.rows_k(dk_target).zero_()
                seq.rows_k(dv_target).zero_()
                continue
            q = heads_first(seq.rows_q(params.q), cdt)
            k = heads_first(seq.rows_k(params.k), cdt, p.group_size)
            v = heads_first(seq.rows_k(params.v), cdt, p.group_size)
            do = heads_first(seq.rows_q(dout), cdt)
            row_lse = seq.lse(lse)[..., None]
            row_d = (do * heads_first(seq.rows_q(out), cdt)).sum(-1)[..., None]     # D in cdt (softmax_d's values)
            dq_splits = seq.rows_q(dq_accum, dim=1)            # (splits, s_q, h, d)
            dk_rows, dv_rows = seq.rows_k(dk_target), seq.rows_k(dv_target)
            for split, start in enumerate(range(0, seq.seqlen_k, tile)):
                end = min(start + tile, seq.seqlen_k)
                st = ScoreTile(p, params, seq, q, k, start, end)
                probs = torch.exp(st.scores - row_lse)           # lse = +inf on empty rows -> 0
                if st.kept is not None:     # exactly 0 where a row does not attend, even if its lse is NaN
                    probs = torch.where(st.kept, probs, torch.zeros((), dtype=cdt, device=probs.device))
                dv_tile = torch.matmul(st.dropped(probs, p.dropout_p).transpose(1, 2), do)
                dprobs = st.dropped(torch.matmul(do, v[:, start:end].transpose(1, 2)), p.dropout_p)
                dscores = probs * (dprobs - row_d)
                if p.softcap:
                    dscores = dscores * (1.0 - st.tanh * st.tanh)
                dscores = dscores * p.softmax_scale
                if st.kept is not None:     # a key a row does not attend adds nothing, not even a NaN of its V
                    dscores = torch.where(st.kept, dscores, torch.zeros((), dtype=cdt, device=dscores.device))
                dk_tile = torch.matmul(dscores.transpose(1, 2), q)
                dq_part = kept_matmul(dscores, k[:, start:end], st.kept).transpose(0, 1)
                dq_splits[split if p.deterministic else 0] += dq_part
                # MHA writes dk/dv directly; GQA writes per query head into the expanded buffers.
                dk_rows[start:end] = dk_tile.transpose(0, 1)
                dv_rows[start:end] = dv_tile.transpose(0, 1)

        # ---- convert_dq: sum the splits, cast to the output dtype --------------------------------
        dq.copy_(dq_accum.sum(0))


def _backward_dtype(problem: AttentionProblem) -> torch.dtype:
    """What the backward computes in: fp32, or fp64 for fp32 and fp64 calls. In fp64 a row that attends one key gets
    dS = P (dP - D) = 0 to fp64's rounding, as autograd's softmax gives it, where fp32's rowsum(dO * O) and dO . v
    differ by a unit of their own rounding (docs/semantics.md §Correctness: the 2x rule)."""
    return torch.float64 if problem.dtype == torch.float32 else problem.accum_dtype


BACKEND = ReferenceBackend
