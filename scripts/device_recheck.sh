#!/usr/bin/env bash
# Second device call of the day: the GPU op/compile tests after the d <= 16 tile fix, the new small
# head dims, and the main job on the H200. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf -m gpu tests/test_ops.py tests/test_compile.py \
  tests/test_chunking_gpu.py > "$OUT/frontend.log" 2>&1
echo "frontend rc=$?"; grep -E "passed|failed|^FAILED" "$OUT/frontend.log" | tail -8
timeout 60 python3 -m pytest -q -p no:cacheprovider -rf "tests/test_triton.py::test_head_dims[8-fp16]" \
  "tests/test_triton.py::test_head_dims[8-bf16]" "tests/test_triton.py::test_head_dims[16-fp16]" \
  "tests/test_triton.py::test_head_dims[16-bf16]" > "$OUT/triton.log" 2>&1
echo "triton rc=$?"; grep -E "passed|failed|^FAILED" "$OUT/triton.log" | tail -5
timeout 90 python3 -m flash_attn_ck --batch 2 --seqlen 8192 --heads 32 --heads-k 8 --head-dim 128 --causal \
  --repeats 10 2>&1 | tee "$OUT/main.log" | head -12
