#!/usr/bin/env bash
# One device call (~6 min) that re-runs the GPU tests after a change, two pytest processes side by side
# (the Triton feature grid; the ops / torch.compile / CUDA graphs / chunking files), then the host-time
# breakdown of a small backward. With WARM_FLEX=1 it also fills FlexAttention's compile caches for a
# bench_bwd.py grid run in the next call (the machine stays warm ~30 s between calls).
#     bash scripts/device_verify.sh          logs under $OUT
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
warm=()
if [ "${WARM_FLEX:-0}" = 1 ]; then
  for i in 0 1; do
    python3 scripts/bench_bwd.py --warm-only --peers flex --shard "$i/2" > "$OUT/warm$i.log" 2>&1 &
    warm+=($!)
  done
fi
timeout 420 python3 -m pytest -q -p no:cacheprovider -rf tests/test_triton.py > "$OUT/triton.log" 2>&1 &
triton_pid=$!
timeout 420 python3 -m pytest -q -p no:cacheprovider -rf -m gpu tests/test_ops.py tests/test_compile.py \
  tests/test_cuda_graphs.py tests/test_chunking_gpu.py > "$OUT/ops.log" 2>&1
echo "ops/compile/graphs/chunking rc=$?"; grep -E "passed|failed|^FAILED" "$OUT/ops.log" | tail -6
wait "$triton_pid"; echo "test_triton rc=$?"; grep -E "passed|failed|^FAILED" "$OUT/triton.log" | tail -6
for pid in "${warm[@]}"; do wait "$pid"; done
[ ${#warm[@]} -gt 0 ] && echo "flex warm-up done: $(grep -c . "$OUT"/warm*.log) log lines"
python3 scripts/launch_overhead.py --breakdown --shapes 128:16:16:512:1,64:32:32:512:0 2>&1 | grep -v Warn
