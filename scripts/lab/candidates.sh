#!/usr/bin/env bash
# The next tiles to try on the GPU, checked and timed beside the defaults: run by `bash scripts/device.sh candidates
# [EXPERIMENT ...]` (from the repository root, logs to $OUT, each step under device.sh's `limit`; the experiments named,
# by default all of them). Edit the lists here; the decisions they lead to go into config.py and their numbers into
# bench/nvidia-h200.md §The measurements behind the design decisions.
#   fwd-split (360 s): the d64 and d128 table tiles beside each with config.FwdWsTile.split_mask (the key tiles a
#     consumer's rows see in full in a loop without mask code) -> candidates-fwd-split.log
#   fwd (400 s): three consumer warpgroups (192 query rows, FA3's d64 shape; at d128 with 64 key rows) and three
#     K/V stages (d128: 225 KB of shared memory) -> candidates-fwd.log
#   bwd (200 s): deeper Q/dO and dQ rings on the two-CTAs d64 tile (three stages, two dQ buffers: up to 108 KB a
#     CTA) -> candidates-bwd.log
#   bwd-named (450 s): the d128 and d64 table tiles with config.WsTile.named_barriers (two of the MMA partition's
#     four barriers a step left), checked alone, then timed beside the table tiles and the one-launch kernel and
#     cuDNN -> candidates-bwd-named.log
#   bwd-det (300 s): the deterministic backward at d64 and d256 on the key-major grid (config.BWD_WS_KEY_MAJOR holds
#     d128's only: concurrent CTAs of one head wait on each other's ordered dQ adds, of different heads they do not)
#     beside the table tiles and the default deterministic call -> candidates-bwd-det.log
#   fwd-dv (300 s): fwd_ws at MLA's (192, 128), v at its own head dim, on the d256 tile and two others, then with
#     config.FWD_WS_QK_TAIL (q/k as a 128-column block and a 64-column tail, the d128 tile; the default, measured
#     faster than the d256 tile) with and without the intra-warpgroup overlap (spills without it: none), beside the
#     one-launch forward and the padded (192, 192) call -> candidates-fwd-dv.log
#   bwd-tail (300 s): bwd_ws_split with q/k as a 128-column block and a tail block (config.BWD_WS_QK_TAIL) against the
#     256-column head block and the one-launch backward at (192, 128) and (192, 192), both settings checked first
#     (scripts/lab/bwd_qk_tail.py) -> candidates-bwd-tail.log
set -u
experiments=("$@")
[ ${#experiments[@]} -eq 0 ] && experiments=(fwd-split fwd bwd bwd-named bwd-det fwd-dv bwd-tail)
for experiment in "${experiments[@]}"; do
  case $experiment in
    fwd-split)
      limit 360 python3 scripts/lab/fwd_ws_check.py \
        --tiles 64=128x128x2x1x0,128x128x2x1x0x0x1,128x128x2x1x1,128x128x2x1x1x0x1 \
        --tiles 128=128x128x2x1x0,128x128x2x1x0x0x1,128x128x2x1x1,128x128x2x1x1x0x1 \
        --shapes 128:16:16,64:32:32 --seqlens 2048,8192 2>&1 | tee "$OUT/candidates-fwd-split.log" \
        | grep -E "^(PASS|FAIL|TIME|ERROR)"
      ;;
    fwd)
      limit 400 python3 scripts/lab/fwd_ws_check.py \
        --tiles 64=128x128x2x1x0,128x128x2x1x1,192x128x2x0x0,192x128x2x0x1,128x128x3x1x0 \
        --tiles 128=128x128x2x1x0,128x128x2x1x1,128x128x3x1x0,128x128x3x1x1,192x64x2x0x0 --tiles 256=128x64x2x1x0 \
        --shapes 64:32:32,128:16:16,128:32:8 --seqlens 2048,8192 2>&1 | tee "$OUT/candidates-fwd.log" \
        | grep -E "^(PASS|FAIL|TIME|ERROR)"
      ;;
    bwd)
      limit 200 python3 scripts/lab/bwd_ws_check.py --case-timeout 120 \
        --tiles 64=64x64x2x1x4x128,64x64x3x1x4x128,64x64x2x2x4x128,64x64x3x2x4x128 --peers sdpa_cudnn \
        --shapes 64:32:32:8192,64:32:32:2048 2>&1 | tee "$OUT/candidates-bwd.log" | grep -E "^(PASS|FAIL|TIME|HANG|ERROR)"
      ;;
    bwd-named)
      { limit 200 python3 scripts/lab/bwd_ws_check.py --check-only --case-timeout 120 --only '^(?!d(192|256) )' \
          --tiles 128=64x128x2x1x8x0x0x1 --tiles 64=64x64x2x1x4x128x0x1 \
        && limit 250 python3 scripts/lab/bwd_ws_check.py --time-only \
          --tiles 128=64x128x2x1,64x128x2x1x8x0x0x1 --tiles 64=64x64x2x1x4x128,64x64x2x1x4x128x0x1 \
          --peers triton-one-launch,sdpa_cudnn --shapes 128:16:16:8192,128:32:8:8192,64:32:32:8192,128:16:16:2048
      } 2>&1 | tee "$OUT/candidates-bwd-named.log" | grep -E "^(PASS|FAIL|TIME|HANG|ERROR)"
      ;;
    bwd-det)
      limit 300 python3 scripts/lab/bwd_ws_check.py --time-only --deterministic \
        --tiles 64=64x64x2x1x4x128,64x64x2x1x4x128x1 --tiles 256=64x64x1x1x4x0,64x64x1x1x4x0x1 \
        --peers triton-det --shapes 64:32:32:8192,256:8:8:8192,64:32:32:2048,256:8:8:2048 2>&1 \
        | tee "$OUT/candidates-bwd-det.log" | grep -E "^(PASS|FAIL|TIME|HANG|ERROR)"
      ;;
    fwd-dv)
      {
        limit 150 python3 scripts/lab/fwd_value_head_dim.py --pairs 192:128 --tiles 128x64x2x1x1,128x64x3x1x0 \
        && limit 150 python3 scripts/lab/fwd_value_head_dim.py --pairs 192:128 --qk-tail \
          --tiles 128x128x2x0x1,128x128x2x0x0
      } 2>&1 | tee "$OUT/candidates-fwd-dv.log" | grep -E "^(PASS|FAIL|TIME|ERROR)"
      ;;
    bwd-tail)
      limit 300 python3 scripts/lab/bwd_qk_tail.py 2>&1 | tee "$OUT/candidates-bwd-tail.log" | grep -E "^(PASS|FAIL|TIME)"
      ;;
    *) echo "unknown experiment $experiment (fwd-split, fwd, bwd, bwd-named, bwd-det, fwd-dv, bwd-tail)" >&2; exit 2 ;;
  esac
done
