"""What the checks of the warp-specialised kernels share (scripts/lab/bwd_ws_check.py, scripts/lab/fwd_ws_check.py):
the tiles to run (a tile spec over the config tables), a case's inputs, the kernels' mask of a flash-attn (causal,
window_size) pair, attention in plain PyTorch in a chosen dtype, one sequence at a time (bottom-right aligned masks,
as the kernels), and the 2x rule."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]   # repo, scripts/


def arguments():
    """The check scripts' common options: --check-only, --time-only and the tile spec (--tiles, for tile_spec)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--time-only", action="store_true")
    ap.add_argument("--tiles", action="append", help="BLOCK=TILE[,TILE...] (repeatable): a head block's tiles")
    return ap


def tile_spec(specs, table, parse):
    """{head block: [tiles]} to check and time: `table`'s ({block: tiles}), with each 'BLOCK=TILE[,TILE...]' of
    `specs` (TILE as `parse` reads it) replacing its block's list; a head dim runs its config.head_block's list."""
    tiles = {block: list(dict.fromkeys(default)) for block, default in table.items()}
    for spec in specs or ():
        block, _, text = spec.partition("=")
        tiles[int(block)] = [parse(t) for t in text.split(",")]
    return tiles


def make_inputs(b, h, h_k, s_q, s_k, d, dtype, varlen_lens=None, device="cuda"):
    """(q, k, v, varlen) of a case: dense (b, s, h, d) tensors, or packed ones of the (len_q, len_k) pairs in
    `varlen_lens`; `varlen` is (cu_q, cu_k, max_q, max_k), or (None, None, 0, 0) when dense."""
    if not varlen_lens:
        q = torch.randn(b, s_q, h, d, device=device, dtype=dtype)
        k, v = (torch.randn(b, s_k, h_k, d, device=device, dtype=dtype) for _ in range(2))
        return q, k, v, (None, None, 0, 0)
    lq, lk = zip(*varlen_lens)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (lq, lk))
    q = torch.randn(sum(lq), h, d, device=device, dtype=dtype)
    k, v = (torch.randn(sum(lk), h_k, d, device=device, dtype=dtype) for _ in range(2))
    return q, k, v, (cu_q, cu_k, max(lq), max(lk))


def within_2x(label, got, ref32, ref_same):
    """(ok, text) of the 2x rule (error within twice that of the same math in the input dtype) on the finite
    entries; +inf must match exactly (lse of rows with no key)."""
    inf = torch.isinf(ref32)
    if not torch.equal(torch.isinf(got), inf) or not torch.all(got[inf] == ref32[inf]):
        return False, f"{label} +inf rows differ FAIL"
    err = (got.float() - ref32)[~inf].abs().max().item() if (~inf).any() else 0.0
    base = (ref_same.float() - ref32)[~inf].abs().max().item() if (~inf).any() else 0.0
    ok = math.isfinite(err) and err <= 2 * base + 1e-5
    return ok, f"{label} {err:.2e}/{base:.2e}{'' if ok else ' FAIL'}"


def mask_args(causal, window):
    """The kernels' launch.GluonMask of a (causal, window_size) pair: causal is a right bound of 0."""
    from flash_attn_ck.backends.triton.runtime.launch import GluonMask, MaskFlags
    left, right = window
    if causal:
        right = 0
    return GluonMask((max(left, 0), max(right, 0)), MaskFlags(HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0))


def attention(q, k, v, causal, window, dtype):
    """(out, lse, leaves) of one sequence of (s, h, d) tensors computed in `dtype`: `leaves` are q, k, v in
    `dtype` with requires_grad; a row that sees no key has out 0 and lse +inf."""
    s_q, s_k, h, h_k = q.shape[0], k.shape[0], q.shape[1], k.shape[1]
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qq, kk, vv = leaves
    ke, ve = kk.repeat_interleave(h // h_k, 1), vv.repeat_interleave(h // h_k, 1)
    s = torch.einsum("qhd,khd->hqk", qq, ke) * q.shape[-1] ** -0.5
    i = torch.arange(s_q, device=q.device)[:, None] + s_k - s_q
    j = torch.arange(s_k, device=q.device)[None, :]
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s.float(), -1).to(dtype)                       # -inf on rows with no key
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(dtype)
    out = torch.einsum("hqk,khd->qhd", p, ve)
    return out, lse.masked_fill(lse == float("-inf"), float("inf")), leaves


def each_sequence(q_like, k_like, cu_q=None, cu_k=None):
    """(slices of the q-like tensors, slices of the k-like tensors) per sequence: the batch entries, or the
    cu_seqlens ranges of packed (varlen) tensors."""
    if cu_q is None:
        return [([t[b] for t in q_like], [t[b] for t in k_like]) for b in range(q_like[0].shape[0])]
    bounds = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())
    return [([t[a:b] for t in q_like], [t[c:e] for t in k_like]) for a, b, c, e in bounds]
