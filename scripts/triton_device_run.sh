#!/usr/bin/env bash
# One device call: GPU tests of the Triton backend, then a quick benchmark; logs under $OUT.
#   bash scripts/triton_device_run.sh [pytest-seconds] [bench args...]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
secs=${1:-300}; shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
export PYTHONPATH=$PWD:$PWD/tests
timeout "$secs" python3 -m pytest -q -p no:cacheprovider -rf tests/test_triton.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|Timeout" "$OUT/pytest.log" | tail -25
if [ $# -gt 0 ]; then
  python3 scripts/bench_bwd.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
  grep -E "bwd TF/s|not importable|Error" "$OUT/bench.log" | tail -40
fi
