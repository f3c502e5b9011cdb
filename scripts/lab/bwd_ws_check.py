"""Check and time the warp-specialised Gluon backward kernel (backends/triton/gluon/bwd_ws.py) on its own,
against an fp32 PyTorch reference (the 2x rule: error <= 2x that of the same math in bf16) and, for
timing, against the current Triton backward and torch SDPA (FA2, cuDNN) in the same process.

    python scripts/lab/bwd_ws_check.py [--check-only] [--time-only] [--tiles BLOCK=TILE[,TILE...]]...
        [--only REGEX] [--case-timeout SECONDS]

Tiles: config.BWD_WS_SM90's, or per head block (config.head_block of a head dim) the list of a --tiles spec,
a tile in config.WsTile.parse's 'BMxBN[xSTAGES[xDQ_STAGES[xWARPS[xMAX_REGISTERS[xKEY_MAJOR[xNAMED_BARRIERS]]]]]]'
(a block whose table tile splits the head dim keeps bwd_ws_split.py), e.g. --tiles 64=64x64x2x1x4x128,64x64x3x1x4x128.
Round i checks the i-th tile of every block.

Prints one line per case; exits non-zero if a check fails, with 3 (after a HANG line) if a case has not finished
within --case-timeout (a deadlocked kernel would otherwise hold the GPU call to its limit). Needs an sm_90 GPU.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
from dataclasses import replace

import torch
from ws_reference import arguments, attention, each_sequence, make_inputs, mask_args, tile_spec, within_2x

import flash_attn_ck as fa
from flash_attn_ck.backends.triton.config import BWD_WS_SM90, WsTile, head_block
from flash_attn_ck.backends.triton.gluon import bwd_ws


def ws_backward(q, k, v, out, dout, lse, causal, window, tile, cu_q=None, cu_k=None, max_q=0, max_k=0):
    varlen = cu_q is not None
    scale = q.shape[-1] ** -0.5
    delta = (out.float() * dout.float()).sum(-1)            # (b, s, h) or (total, h)
    delta = delta.permute(0, 2, 1).contiguous() if not varlen else delta.t().contiguous()
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    batch = q.shape[0] if not varlen else cu_q.numel() - 1
    s_q, s_k = (q.shape[1], k.shape[1]) if not varlen else (max_q, max_k)
    m = mask_args(causal, window)
    bwd_ws.launch(q, k, v, dout, lse, delta, dq_acc, dk, dv, cu_q, cu_k, varlen=varlen, batch=batch, seqlen_q=s_q,
                  seqlen_k=s_k, scale=scale, tile=tile, mask=m)
    return dq_acc.to(q.dtype), dk, dv


def reference(q, k, v, dout, causal, window, dtype, cu_q=None, cu_k=None):
    """Gradients of attention computed in `dtype` (per sequence for varlen)."""
    grads = []
    for (qs, dos), (ks, vs) in each_sequence((q, dout), (k, v), cu_q, cu_k):
        out, _, leaves = attention(qs, ks, vs, causal, window, dtype)
        grads.append(torch.autograd.grad(out, leaves, dos.to(dtype)))
    join = torch.stack if cu_q is None else torch.cat
    return [join([g[i] for g in grads]) for i in range(3)]


def check(name, b, h, h_k, s_q, s_k, d, causal, window, tile, varlen_lens=None, dtype=torch.bfloat16):
    q, k, v, (cu_q, cu_k, max_q, max_k) = make_inputs(b, h, h_k, s_q, s_k, d, dtype, varlen_lens)
    dout = torch.randn_like(q)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k) if varlen_lens else {}
    out, lse, _ = fa.flash_attn_fwd(q, k, v, causal=causal, window_size=window, backend="triton", **varlen)
    got = ws_backward(q, k, v, out, dout, lse, causal, window, tile, cu_q, cu_k, max_q, max_k)
    ref32 = reference(q, k, v, dout, causal, window, torch.float32, cu_q, cu_k)
    ref16 = reference(q, k, v, dout, causal, window, dtype, cu_q, cu_k)
    results = [within_2x(label, g, r32, r16) for label, g, r32, r16 in zip(("dq", "dk", "dv"), got, ref32, ref16)]
    ok = all(r[0] for r in results)
    print(f"{'PASS' if ok else 'FAIL'} {name}: " + ", ".join(r[1] for r in results), flush=True)
    return ok


def time_case(b, h, h_k, s, d, causal, tiles, peers, deterministic=False):
    """Backward TFLOP/s of each tile of the warp-specialised kernel and of `peers` (bench_bwd.py names:
    triton-one-launch, sdpa_flash, sdpa_cudnn, ...), timed by bench_bwd.py's runner (the whole backward
    through the public API, in this process); `deterministic`: the tiles in the deterministic mode (the peers as
    named: triton-det, FA4 is not among measure's)."""
    from bench_bwd import measure

    from flash_attn_ck.backends.triton import TritonBackend
    ours = "triton-det" if deterministic else "triton"
    row = {f"ws{tile}": measure(ours, b, h, h_k, s, d, causal, backend=TritonBackend(ws=True, ws_tile=tile))
           for tile in tiles}
    for name in peers:
        row[name] = measure(name, b, h, h_k, s, d, causal)
    print(f"TIME d{d} h{h}/{h_k} s{s} causal={causal}{' deterministic' if deterministic else ''}: "
          + "  ".join(f"{k} {v['bwd_tflops']:.0f}" for k, v in row.items()), flush=True)


def _hang(name, seconds):
    print(f"HANG {name}: no result after {seconds:.0f} s (a deadlocked kernel?)", flush=True)
    os._exit(3)


# (name, b, h, h_k, s_q, s_k, d, causal, window, varlen (len_q, len_k) pairs or None, dtype)
CASES = [
    ("dense d128 s256", 2, 4, 4, 256, 256, 128, False, (-1, -1), None, torch.bfloat16),
    ("dense d128 s200 (partial tiles)", 2, 4, 4, 200, 200, 128, False, (-1, -1), None, torch.bfloat16),
    ("causal d128 s384", 2, 4, 4, 384, 384, 128, True, (-1, -1), None, torch.bfloat16),
    ("causal s_q 100 != s_k 300", 2, 4, 4, 100, 300, 128, True, (-1, -1), None, torch.bfloat16),
    ("causal s_q 300 != s_k 100", 2, 4, 4, 300, 100, 128, True, (-1, -1), None, torch.bfloat16),
    ("window (64, 32) d128", 2, 4, 4, 384, 384, 128, False, (64, 32), None, torch.bfloat16),
    ("gqa 8/2 causal", 2, 8, 2, 256, 256, 128, True, (-1, -1), None, torch.bfloat16),
    ("gqa 8/1 (mqa)", 1, 8, 1, 256, 256, 128, False, (-1, -1), None, torch.bfloat16),
    ("gqa 8/4", 1, 8, 4, 256, 256, 128, True, (-1, -1), None, torch.bfloat16),
    ("fp16 causal", 2, 4, 4, 256, 256, 128, True, (-1, -1), None, torch.float16),
    ("d64 causal", 2, 4, 4, 384, 384, 64, True, (-1, -1), None, torch.bfloat16),
    ("varlen causal gqa", 0, 4, 2, 0, 0, 128, True, (-1, -1), [(100, 100), (0, 50), (257, 300), (64, 0), (130, 70)],
     torch.bfloat16),
    ("varlen d64", 0, 4, 4, 0, 0, 64, False, (-1, -1), [(200, 130), (1, 1), (129, 255)], torch.bfloat16),
    # head dims padded to 128 in shared memory
    ("d96 causal gqa 8/2 s300", 2, 8, 2, 300, 300, 96, True, (-1, -1), None, torch.bfloat16),
    ("d96 varlen window (64, 32)", 0, 4, 2, 0, 0, 96, False, (64, 32), [(100, 100), (0, 50), (257, 300)],
     torch.bfloat16),
    ("d80 dense s_q 100 != s_k 333", 2, 4, 4, 100, 333, 80, False, (-1, -1), None, torch.bfloat16),
    # head dims above 128: the split kernel (bwd_ws_split.py)
    ("d256 dense s200 (partial tiles)", 2, 4, 4, 200, 200, 256, False, (-1, -1), None, torch.bfloat16),
    ("d256 causal gqa 8/2 s384", 2, 8, 2, 384, 384, 256, True, (-1, -1), None, torch.bfloat16),
    ("d256 window (64, 32) s_q 300 != s_k 200", 2, 4, 4, 300, 200, 256, False, (64, 32), None, torch.bfloat16),
    ("d192 varlen causal gqa, empty sequences", 0, 4, 2, 0, 0, 192, True, (-1, -1),
     [(100, 100), (0, 50), (257, 300), (64, 0)], torch.bfloat16),
]


def main():
    ap = arguments()
    ap.add_argument("--peers", default="triton-one-launch,sdpa_flash,sdpa_cudnn", help="timed beside the tiles")
    ap.add_argument("--only", default="", help="run the check cases whose name matches this regex")
    ap.add_argument("--case-timeout", type=float, default=180.0, help="seconds a check case may take, compiling")
    ap.add_argument("--shapes", default="128:16:16:8192,128:32:8:8192,64:32:32:8192,128:16:16:2048",
                    help="timed shapes d:h:h_k:s, each causal and not (b = 16384 / s)")
    ap.add_argument("--deterministic", action="store_true", help="time the tiles in the deterministic mode")
    args = ap.parse_args()
    tiles = tile_spec(args.tiles, {block: [tile] for block, tile in BWD_WS_SM90.items()}, WsTile.parse)
    for block, listed in tiles.items():   # bwd_ws_split's blocks keep it
        table = BWD_WS_SM90.get(block)
        tiles[block] = [replace(t, split_d=table.split_d, mma_regs=table.mma_regs) if table else t for t in listed]
    blocks = sorted(tiles)
    ok = True
    rounds = [] if args.time_only else list(itertools.zip_longest(*(tiles[block] for block in blocks)))
    for round_tiles in rounds:
        print("-- checks with " + ", ".join(f"d{block} tile {t}" for block, t in zip(blocks, round_tiles)))
        for name, b, h, h_k, s_q, s_k, d, causal, window, lens, dtype in CASES:
            tile = round_tiles[blocks.index(head_block(d))] if head_block(d) in blocks else None
            if tile is None or not re.search(args.only, name):
                continue
            watchdog = threading.Timer(args.case_timeout, _hang, (name, args.case_timeout))
            watchdog.start()
            try:
                ok &= check(name, b, h, h_k, s_q, s_k, d, causal, window, tile, lens, dtype)
            except Exception as e:
                ok = False
                print(f"FAIL {name}: {type(e).__name__}: {str(e)[:600]}", flush=True)
            finally:
                watchdog.cancel()
    if not args.check_only:
        peers = [p for p in args.peers.split(",") if p]
        for shape in args.shapes.split(","):
            d, h, h_k, s = map(int, shape.split(":"))
            for causal in (False, True):
                time_case(16384 // s, h, h_k, s, d, causal, tiles[head_block(d)], peers, args.deterministic)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
