"""Check and time the warp-specialised Gluon forward kernel (backends/triton/gluon/fwd_ws.py): out and lse against
an fp32 PyTorch reference (the 2x rule: error <= 2x that of the same math in the input dtype; lse = +inf
exactly on the rows with no key), then forward TFLOP/s of each tile variant beside the current Triton
forward and torch SDPA (flash, cuDNN) in the same process.

    python3 scripts/lab/fwd_ws_check.py [--check-only] [--time-only] [--tiles BLOCK=TILE[,TILE...]]...
        [--shapes 128:16:16,96:21:21,...] [--seqlens 4096,8192]

Tiles: config.FWD_WS_SM90's (each head block's causal and non-causal tiles), or per head block (config.head_block
of a head dim: d96 and d80 run in the 128 tiles, d192 in the 256 ones) the list of a --tiles spec, a tile in
config.FwdWsTile.parse's 'BMxBNxSTAGESxOVERLAPxPINGPONG[xQUERY_MAJOR[xSPLIT_MASK]]' (BM 192: three consumer
warpgroups), e.g. --tiles 128=128x128x2x1x0,128x128x2x1x1. Every case runs with every tile of its block. Prints
PASS/FAIL per case and a TIME line per shape; a variant that fails to compile or run prints its error and the script
goes on. Exits non-zero if a check fails. Needs an sm_90 GPU.
"""

from __future__ import annotations

import sys
import traceback

import torch
import triton
from ws_reference import arguments, attention, each_sequence, make_inputs, mask_args, tile_spec, within_2x

import flash_attn_ck as fa
from flash_attn_ck.backends.triton import TritonBackend
from flash_attn_ck.backends.triton.config import FWD_WS_SM90, FwdWsTile, head_block
from flash_attn_ck.backends.triton.gluon import fwd_ws


def ws_forward(q, k, v, causal, window, tile, cu_q=None, cu_k=None, max_q=0, max_k=0):
    """out, lse of fwd_ws.launch with an explicit tile ((b, h, s_q) or varlen (h, total_q) lse)."""
    varlen = cu_q is not None
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1]),
                      dtype=torch.float32, device=q.device)
    batch = cu_q.numel() - 1 if varlen else q.shape[0]
    s_q, s_k = (max_q, max_k) if varlen else (q.shape[1], k.shape[1])
    fwd_ws.launch(q, k, v, out, lse, cu_q, cu_k, varlen=varlen, batch=batch, seqlen_q=s_q, seqlen_k=s_k,
                  scale=q.shape[-1] ** -0.5, tile=tile, mask=mask_args(causal, window))
    return out, lse


def reference(q, k, v, causal, window, dtype, cu_q=None, cu_k=None):
    """out and lse ((b, h, s_q) or varlen (h, total_q)) of attention computed in `dtype`, per sequence."""
    parts = [attention(qs, ks, vs, causal, window, dtype)[:2]
             for (qs,), (ks, vs) in each_sequence((q,), (k, v), cu_q, cu_k)]
    outs, lses = [o.detach() for o, _ in parts], [lse for _, lse in parts]
    if cu_q is None:
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses, dim=1)


def check(name, b, h, h_k, s_q, s_k, d, causal, window, tile, varlen_lens=None, dtype=torch.bfloat16):
    q, k, v, (cu_q, cu_k, max_q, max_k) = make_inputs(b, h, h_k, s_q, s_k, d, dtype, varlen_lens)
    got = ws_forward(q, k, v, causal, window, tile, cu_q, cu_k, max_q, max_k)
    ref32 = reference(q, k, v, causal, window, torch.float32, cu_q, cu_k)
    ref_same = reference(q, k, v, causal, window, dtype, cu_q, cu_k)
    results = [within_2x(label, g, r32, r16) for label, g, r32, r16 in zip(("out", "lse"), got, ref32, ref_same)]
    ok = all(r[0] for r in results)
    print(f"{'PASS' if ok else 'FAIL'} {name} [{tile}]: " + ", ".join(r[1] for r in results), flush=True)
    return ok


CASES = [   # name, b, h, h_k, s_q, s_k, d, causal, window, varlen lengths, dtype
    ("dense d128 s256", 2, 4, 4, 256, 256, 128, False, (-1, -1), None, torch.bfloat16),
    ("dense d128 s200 (partial tiles)", 2, 4, 4, 200, 200, 128, False, (-1, -1), None, torch.bfloat16),
    ("causal d128 s384", 2, 4, 4, 384, 384, 128, True, (-1, -1), None, torch.bfloat16),
    ("causal s_q 100 < s_k 300", 2, 4, 4, 100, 300, 128, True, (-1, -1), None, torch.bfloat16),
    ("causal s_q 300 > s_k 100 (rows with no key)", 2, 4, 4, 300, 100, 128, True, (-1, -1), None, torch.bfloat16),
    ("window (64, 32) d128", 2, 4, 4, 384, 384, 128, False, (64, 32), None, torch.bfloat16),
    ("window (17, -1) s_q 300 > s_k 200", 2, 4, 4, 300, 200, 128, False, (17, -1), None, torch.bfloat16),
    # key tiles masked at a window's left edge, then seen in full, then masked at its right edge and at len_k
    ("window (300, 200) s1000", 2, 4, 4, 1000, 1000, 128, False, (300, 200), None, torch.bfloat16),
    ("varlen window (257, 0) gqa", 0, 4, 2, 0, 0, 128, False, (257, 0),
     [(700, 900), (130, 70), (0, 10), (513, 513)], torch.bfloat16),
    ("d64 causal s_q 700 < s_k 1000", 2, 4, 4, 700, 1000, 64, True, (-1, -1), None, torch.bfloat16),
    ("gqa 8/2 causal", 2, 8, 2, 256, 256, 128, True, (-1, -1), None, torch.bfloat16),
    ("gqa 8/1 (mqa)", 1, 8, 1, 256, 256, 128, False, (-1, -1), None, torch.bfloat16),
    ("d64 dense s300", 2, 4, 4, 300, 300, 64, False, (-1, -1), None, torch.bfloat16),
    ("d64 causal", 2, 4, 4, 384, 384, 64, True, (-1, -1), None, torch.bfloat16),
    ("varlen causal gqa, empty sequences", 0, 4, 2, 0, 0, 128, True, (-1, -1),
     [(100, 100), (0, 50), (257, 300), (64, 0), (130, 70), (1, 1)], torch.bfloat16),
    ("varlen d64", 0, 4, 4, 0, 0, 64, False, (-1, -1), [(200, 130), (1, 1), (129, 255)], torch.bfloat16),
    ("fp16 causal d128", 2, 4, 4, 256, 256, 128, True, (-1, -1), None, torch.float16),
    ("fp16 varlen d64", 0, 4, 2, 0, 0, 64, False, (-1, -1), [(37, 80), (0, 50), (130, 9)], torch.float16),
    # head dims padded in shared memory (96 -> 128, 192 -> 256; 80 -> 128) and d256's 64-key tiles
    ("d96 dense s300", 2, 4, 4, 300, 300, 96, False, (-1, -1), None, torch.bfloat16),
    ("d96 varlen causal gqa, empty sequences", 0, 4, 2, 0, 0, 96, True, (-1, -1),
     [(100, 100), (0, 50), (257, 300), (64, 0), (130, 70)], torch.bfloat16),
    ("d80 causal s_q 300 > s_k 100", 2, 4, 4, 300, 100, 80, True, (-1, -1), None, torch.bfloat16),
    ("d192 causal gqa 8/2", 2, 8, 2, 256, 256, 192, True, (-1, -1), None, torch.bfloat16),
    ("d192 window (64, 32) s200", 2, 4, 4, 200, 200, 192, False, (64, 32), None, torch.bfloat16),
    ("d256 dense s300", 2, 4, 4, 300, 300, 256, False, (-1, -1), None, torch.bfloat16),
    ("d256 varlen causal, empty sequences", 0, 4, 2, 0, 0, 256, True, (-1, -1),
     [(100, 100), (0, 50), (257, 300), (64, 0)], torch.bfloat16),
    ("fp16 d256 causal", 2, 4, 4, 256, 256, 256, True, (-1, -1), None, torch.float16),
]


def run_checks(tiles) -> bool:
    ok = True
    for name, b, h, h_k, s_q, s_k, d, causal, window, lens, dtype in CASES:
        for tile in tiles[head_block(d)]:
            try:
                ok &= check(name, b, h, h_k, s_q, s_k, d, causal, window, tile, lens, dtype)
            except Exception as e:  # a failing variant is reported and the others still run
                ok = False
                print(f"FAIL {name} [{tile}]: {type(e).__name__}: {str(e)[:600]}", flush=True)
    return ok


def flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def time_case(b, h, h_k, s, d, causal, tiles):
    """Forward TFLOP/s through the public API: fwd_ws per tile, the current Triton forward, SDPA flash/cuDNN."""
    from bench_bwd import make_runner
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, hh, d, device="cuda", dtype=torch.bfloat16) for hh in (h, h_k, h_k))
    def through_api(backend):
        def run():
            with fa.use_backend(backend):
                return fa.flash_attn_fwd(q, k, v, causal=causal, backend="triton")
        return run

    runners = {f"fwd_ws {tile}": through_api(TritonBackend(fwd_ws=True, fwd_ws_tile=tile)) for tile in tiles}
    runners["triton forward"] = through_api(TritonBackend(fwd_ws=False))
    row = []
    for name in ("sdpa_flash", "sdpa_cudnn"):
        runners[name] = make_runner(name, q, k, v, causal)
    for name, run in runners.items():
        try:
            with torch.no_grad():
                run()
                ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
            row.append(f"{name} {flops(b, h, s, d, causal) / ms / 1e9:.0f}")
        except Exception as e:  # one variant's failure must not hide the others' timings
            row.append(f"{name} ERROR")
            print(f"ERROR {name} d{d} s{s} causal={causal}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            traceback.print_exc(limit=2)
    print(f"TIME d{d} h{h}/{h_k} s{s} causal={causal} (TFLOP/s): " + "  ".join(row), flush=True)


def main():
    ap = arguments()
    ap.add_argument("--seqlens", default="4096,8192", help="timed lengths (b = 16384 / s)")
    ap.add_argument("--shapes", default="128:16:16,64:32:32,128:32:8", help="timed d:h:h_k (h = 2048 / d)")
    args = ap.parse_args()
    tiles = tile_spec(args.tiles, {block: by_causal.values() for block, by_causal in FWD_WS_SM90.items()},
                      FwdWsTile.parse)
    ok = True if args.time_only else run_checks(tiles)
    if not args.check_only:
        for d, h, h_k in (map(int, shape.split(":")) for shape in args.shapes.split(",")):
            for s in map(int, args.seqlens.split(",")):
                for causal in (False, True):
                    time_case(16384 // s, h, h_k, s, d, causal, tiles[head_block(d)])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
