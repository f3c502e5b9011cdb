#!/usr/bin/env bash
# One device call (~8 min) that re-checks the Triton backward after a kernel or config change: the GPU
# test file, compute-sanitizer, then the short-sequence rows (s <= 2048, where config.SHORT_SEQLEN
# switches the backward to pointer tiles) timed beside FA2 and cuDNN, and their per-kernel GPU times with
# TMA descriptors on and off. Logs and bench files under $OUT.   bash scripts/device_recheck.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
timeout 260 python3 -m pytest -q -p no:cacheprovider -rf tests/test_triton.py > "$OUT/triton.log" 2>&1
echo "test_triton rc=$?"; grep -E "passed|failed|^FAILED" "$OUT/triton.log" | tail -8
timeout 120 bash scripts/triton_sanitize.sh 2>&1 | grep -E "rc=|SUMMARY"
shapes=64:32:32:512:0,64:32:32:512:1,64:32:32:1024:1,128:16:16:512:0,128:16:16:512:1,128:16:16:1024:1,128:16:16:2048:1,256:8:8:512:1
timeout 100 python3 scripts/bench_bwd.py --peers triton,sdpa_flash,sdpa_cudnn --shapes "$shapes" --out "$OUT" \
  --tag=-short 2>&1 | grep "bwd TF/s"
for tma in on off; do
  timeout 60 python3 scripts/launch_overhead.py --kernels --dq-mode pass --tma "$tma" \
    --shapes 128:16:16:512:1,128:16:16:1024:1 2>&1 | grep -E "^d|all kernels" | sed "s/^/tma=$tma /"
done
