#!/usr/bin/env bash
# One device call that checks what only a CUDA GPU can: the GPU test files, then the workspace-cap
# memory measurement. Logs under $OUT.   bash scripts/device_check.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
run_tests() {  # name seconds pytest-args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest -q -p no:cacheprovider -rf "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/$name.log" | tail -12
}
run_tests frontend 220 -m gpu tests/test_cuda_graphs.py tests/test_chunking_gpu.py tests/test_ops.py tests/test_compile.py
run_tests triton 110 tests/test_triton.py -k "varlen or determin or plan"
timeout 60 python3 scripts/memory_cap.py --seqlen 16384 --backends triton --json "$OUT/memory-triton.json" 2>&1 | tail -6
timeout 100 python3 scripts/memory_cap.py --seqlen 4096 --causal --backends reference --json "$OUT/memory-reference.json" 2>&1 | tail -6
