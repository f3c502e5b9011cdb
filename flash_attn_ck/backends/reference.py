"""The reference backend: CK's kernel contract (docs/semantics.md) written in PyTorch, for any device.

It computes in fp32 and walks the keys in tiles of CK's `kN0` rows, so memory stays
O(s_q * kN0) per head and long sequences run on a CPU. The backward honours the same buffers as
CK's `fmha_bwd`: it fills `softmax_d`, adds dQ into `dq_accum` (split 0, or the key tile's own
split in deterministic mode) and converts it, and writes dK/dV per query head into the expanded
buffers for MQA/GQA, leaving the group sum to the frontend. The frontend therefore runs the same
steps on CPU as on MI300.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch

from ..frontend.dropout import keep_mask
from ..frontend.plan import BufferSpec, CkBwdTile, WorkspacePlan, ck_backward_plan
from ..frontend.problem import AttentionParams, AttentionProblem
from .base import Backend


@dataclass(frozen=True)
class Sequence:
    """One sequence of the batch: its index, lengths, and row offsets into packed tensors."""
    index: int
    seqlen_q: int
    seqlen_k: int
    start_q: int
    start_k: int
    varlen: bool

    def rows_q(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Rows of a q-shaped tensor: (b, s_q, ...) or varlen (total_q, ...) starting at `dim`."""
        return t.narrow(dim, self.start_q, self.seqlen_q) if self.varlen else t.select(dim, self.index)

    def rows_k(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, self.start_k, self.seqlen_k) if self.varlen else t[self.index]

    def lse(self, t: torch.Tensor) -> torch.Tensor:
        """(h, s_q) view of an lse-shaped tensor: (b, h, s_q) or varlen (h, total_q)."""
        return t.narrow(1, self.start_q, self.seqlen_q) if self.varlen else t[self.index]


def sequences(problem: AttentionProblem, params: AttentionParams) -> Iterator[Sequence]:
    if not problem.varlen:
        for i in range(problem.batch):
            yield Sequence(i, problem.seqlen_q, problem.seqlen_k, 0, 0, False)
        return
    cu_q = params.cu_seqlens_q.tolist()
    cu_k = params.cu_seqlens_k.tolist()
    for i in range(problem.batch):
        yield Sequence(i, cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i], cu_q[i], cu_k[i], True)


class _ScoreTile:
    """Scores of all query heads of one sequence against one key tile, with everything applied
    that CK applies before the softmax: scale, softcap, ALiBi, mask; plus the dropout keep mask."""

    def __init__(self, problem: AttentionProblem, params: AttentionParams, seq: Sequence,
                 q: torch.Tensor, k: torch.Tensor, key_start: int, key_end: int):
        p = problem
        rows = torch.arange(seq.seqlen_q, device=q.device)
        cols = torch.arange(key_start, key_end, device=q.device)
        raw = torch.matmul(q, k[:, key_start:key_end].transpose(1, 2)) * p.softmax_scale
        if p.softcap:
            self.tanh = torch.tanh(raw / p.softcap)
            raw = p.softcap * self.tanh
        if params.alibi_slopes is not None:
            slopes = params.alibi_slopes
            slopes = (slopes[seq.index] if slopes.dim() == 2 else slopes).to(raw.dtype)
            distance = (rows[:, None] + seq.seqlen_k - seq.seqlen_q - cols[None, :]).abs()
            raw = raw - slopes[:, None, None] * distance
        mask = p.mask.for_lengths(seq.seqlen_q, seq.seqlen_k)
        if mask.is_masked:
            raw = raw.masked_fill(~mask.keep(rows, cols), float("-inf"))
        self.scores = raw
        self.keep: Optional[torch.Tensor] = None
        if p.dropout_p > 0:
            # Global coordinates: a chunk of a call draws the same pattern as the whole call.
            where = p.placement
            heads = torch.arange(p.heads_q, device=q.device) + where.head_offset
            seed_offset = tuple(params.rng_state.tolist())
            self.keep = keep_mask(seed_offset, p.dropout_p, seq.index + where.batch_offset, where.heads,
                                  where.seqlen_q, p.seqlen_k, heads, rows + where.row_offset, cols)

    def dropped(self, probs: torch.Tensor, dropout_p: float) -> torch.Tensor:
        return probs if self.keep is None else probs * self.keep / (1.0 - dropout_p)


def _heads_first(t: torch.Tensor, dtype: torch.dtype, group: int = 1) -> torch.Tensor:
    """(s, h, d) -> (h * group, s, d) in `dtype`, repeating each head `group` times."""
    t = t.to(dtype).transpose(0, 1)
    return t.repeat_interleave(group, dim=0) if group > 1 else t


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    device_types = frozenset({"cpu", "cuda", "mps", "xpu"})
    auto_select_devices = frozenset({"cpu"})     # a slow oracle on accelerators: only when asked for
    supports_chunks = True
    supports_row_chunks = True
    supports_chunked_dropout = True
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, problem: AttentionProblem, params: AttentionParams,
                out: torch.Tensor, lse: torch.Tensor) -> None:
        tile = CkBwdTile.for_head_dim(problem.head_dim_padded).kN0
        cdt = problem.accum_dtype
        for seq in sequences(problem, params):
            if seq.seqlen_q == 0:
                continue
            q = _heads_first(seq.rows_q(params.q), cdt)
            k = _heads_first(seq.rows_k(params.k), cdt, problem.group_size)
            v = _heads_first(seq.rows_k(params.v), cdt, problem.group_size)
            row_max = torch.full(q.shape[:2], float("-inf"), dtype=cdt, device=q.device)
            row_sum = torch.zeros(q.shape[:2], dtype=cdt, device=q.device)
            acc = torch.zeros_like(q)
            # ---- online softmax over key tiles: rescale the running sums when the max grows ----
            for start in range(0, seq.seqlen_k, tile):
                end = min(start + tile, seq.seqlen_k)
                st = _ScoreTile(problem, params, seq, q, k, start, end)
                new_max = torch.maximum(row_max, st.scores.amax(dim=-1))
                safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                probs = torch.exp(st.scores - safe_max[..., None])
                rescale = torch.exp(row_max - safe_max)
                row_sum = row_sum * rescale + probs.sum(-1)
                acc = acc * rescale[..., None] + torch.matmul(st.dropped(probs, problem.dropout_p), v[:, start:end])
                row_max = new_max
            empty = row_sum == 0
            safe_max = torch.where(empty, torch.zeros_like(row_max), row_max)
            row_lse = torch.where(empty, torch.full_like(row_max, float("inf")), safe_max + torch.log(row_sum))
            result = torch.where(empty[..., None], torch.zeros_like(acc), acc / row_sum.clamp_min(1e-30)[..., None])
            seq.rows_q(out).copy_(result.transpose(0, 1))
            seq.lse(lse).copy_(row_lse)

    # ---- backward ------------------------------------------------------------------------------
    def backward_plan(self, problem: AttentionProblem) -> WorkspacePlan:
        """The CK contract's buffers, plus this backend's own fp32 temporaries (a CK kernel keeps
        them in registers) so that a workspace cap also bounds what the reference allocates."""
        plan = ck_backward_plan(problem, self.name)
        return replace(plan, buffers=plan.buffers + (self._scratch(problem),))

    @staticmethod
    def _scratch(problem: AttentionProblem) -> BufferSpec:
        """Upper bound of the temporaries live during one key tile of the largest sequence: fp32
        heads-first copies of q, dO, k, v (k/v repeated per query head), dQ/dK/dV tile products,
        and about eight score-shaped tiles (plus Philox's int64 words with dropout)."""
        p, d = problem, problem.head_dim_padded
        width = min(CkBwdTile.for_head_dim(d).kN0, max(p.seqlen_k, 1))
        size = torch.empty((), dtype=p.accum_dtype).element_size()
        scores = p.heads_q * p.seqlen_q * width
        per_score = size * (8 + (2 if p.softcap else 0)) + (12 * 8 + 1 if p.dropout_p > 0 else 0)
        nbytes = size * p.heads_q * d * (3 * p.seqlen_q + 2 * p.seqlen_k + 2 * width) + per_score * scores
        return BufferSpec("fp32_tiles", (-(-nbytes // size),), p.accum_dtype, False,
                          "reference: fp32 copies and score tiles of one key tile", internal=True)

    def backward(self, problem: AttentionProblem, params: AttentionParams, out: torch.Tensor,
                 lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor, workspace: dict[str, torch.Tensor]) -> None:
        p = problem
        dq_accum = workspace["dq_accum"]
        dk_target = workspace["dk_expanded"] if p.is_gqa else dk
        dv_target = workspace["dv_expanded"] if p.is_gqa else dv
        tile = CkBwdTile.for_head_dim(p.head_dim_padded).kN0
        cdt = p.accum_dtype

        # ---- dot_do_o: D = rowsum(dO * O) in fp32, laid out like lse -----------------------------
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
            q = _heads_first(seq.rows_q(params.q), cdt)
            k = _heads_first(seq.rows_k(params.k), cdt, p.group_size)
            v = _heads_first(seq.rows_k(params.v), cdt, p.group_size)
            do = _heads_first(seq.rows_q(dout), cdt)
            row_lse = seq.lse(lse)[..., None]
            row_d = seq.lse(softmax_d)[..., None]
            dq_splits = seq.rows_q(dq_accum, dim=1)            # (splits, s_q, h, d)
            dk_rows, dv_rows = seq.rows_k(dk_target), seq.rows_k(dv_target)
            for split, start in enumerate(range(0, seq.seqlen_k, tile)):
                end = min(start + tile, seq.seqlen_k)
                st = _ScoreTile(p, params, seq, q, k, start, end)
                probs = torch.exp(st.scores - row_lse)           # lse = +inf on empty rows -> 0
                dv_tile = torch.matmul(st.dropped(probs, p.dropout_p).transpose(1, 2), do)
                dprobs = st.dropped(torch.matmul(do, v[:, start:end].transpose(1, 2)), p.dropout_p)
                dscores = probs * (dprobs - row_d)
                if p.softcap:
                    dscores = dscores * (1.0 - st.tanh * st.tanh)
                dscores = dscores * p.softmax_scale
                dk_tile = torch.matmul(dscores.transpose(1, 2), q)
                dq_part = torch.matmul(dscores, k[:, start:end]).transpose(0, 1)
                dq_splits[split if p.deterministic else 0] += dq_part
                # MHA writes dk/dv directly; GQA writes per query head into the expanded buffers.
                dk_rows[start:end] = dk_tile.transpose(0, 1)
                dv_rows[start:end] = dv_tile.transpose(0, 1)

        # ---- convert_dq: sum the splits, cast to the output dtype --------------------------------
        dq.copy_(dq_accum.sum(0))


def attention_probs(problem: AttentionProblem, params: AttentionParams, lse: torch.Tensor) -> torch.Tensor:
    """Test-only: the softmax probabilities `(b, h, max_s_q, max_s_k)` with the dropout pattern in
    the sign (negative = dropped; flash-attn's `S_dmask` convention). Varlen rows/columns past a
    sequence's end, and masked entries, are 0. Materialises s_q x s_k per head."""
    p = problem
    probs = torch.zeros(p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, dtype=p.accum_dtype, device=p.device)
    for seq in sequences(p, params):
        if seq.seqlen_q == 0 or seq.seqlen_k == 0:
            continue
        q = _heads_first(seq.rows_q(params.q), p.accum_dtype)
        k = _heads_first(seq.rows_k(params.k), p.accum_dtype, p.group_size)
        st = _ScoreTile(p, params, seq, q, k, 0, seq.seqlen_k)
        tile = torch.exp(st.scores - seq.lse(lse)[..., None])
        if st.keep is not None:
            tile = torch.where(st.keep, tile, -tile)
        probs[seq.index, :, :seq.seqlen_q, :seq.seqlen_k] = tile
    return probs


BACKEND = ReferenceBackend
