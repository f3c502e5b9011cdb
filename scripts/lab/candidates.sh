#!/usr/bin/env bash
# The next tiles to try on the GPU, checked and timed beside the defaults: run by `bash scripts/device.sh candidates`
# (from the repository root, logs to $OUT, each step under device.sh's `limit`). Edit the lists here; the decisions
# they lead to go into config.py and their numbers into bench/nvidia-h200.md §The measurements behind the design decisions.
#   forward, split mask (360 s): the table's d64 and d128 tiles beside each with split_mask (the key tiles a consumer's
#     rows see in full in a loop without mask code; FwdWsTile.parse's seventh flag) -> candidates-fwd-split.log
#   forward (400 s): three consumer warpgroups (192 query rows, FA3's d64 shape; at d128 with 64 key rows) and three
#     K/V stages (d128: 225 KB of shared memory) -> candidates-fwd.log
#   backward (200 s): deeper Q/dO and dQ rings on the two-CTAs d64 tile (three stages, two dQ buffers: up to 108 KB a
#     CTA) -> candidates-bwd.log
set -u
limit 360 python3 scripts/lab/fwd_ws_check.py \
  --tiles 64=128x128x2x1x0,128x128x2x1x0x0x1,128x128x2x1x1,128x128x2x1x1x0x1 \
  --tiles 128=128x128x2x1x0,128x128x2x1x0x0x1,128x128x2x1x1,128x128x2x1x1x0x1 \
  --shapes 128:16:16,64:32:32 --seqlens 2048,8192 2>&1 | tee "$OUT/candidates-fwd-split.log" \
  | grep -E "^(PASS|FAIL|TIME|ERROR)"
limit 400 python3 scripts/lab/fwd_ws_check.py \
  --tiles 64=128x128x2x1x0,128x128x2x1x1,192x128x2x0x0,192x128x2x0x1,128x128x3x1x0 \
  --tiles 128=128x128x2x1x0,128x128x2x1x1,128x128x3x1x0,128x128x3x1x1,192x64x2x0x0 --tiles 256=128x64x2x1x0 \
  --shapes 64:32:32,128:16:16,128:32:8 --seqlens 2048,8192 2>&1 | tee "$OUT/candidates-fwd.log" \
  | grep -E "^(PASS|FAIL|TIME|ERROR)"
limit 200 python3 scripts/lab/bwd_ws_check.py --case-timeout 120 \
  --tiles 64=64x64x2x1x4x128,64x64x3x1x4x128,64x64x2x2x4x128,64x64x3x2x4x128 --peers sdpa_cudnn \
  --shapes 64:32:32:8192,64:32:32:2048 2>&1 | tee "$OUT/candidates-bwd.log" | grep -E "^(PASS|FAIL|TIME|HANG|ERROR)"
