#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on a small GQA + varlen + deterministic backward of the
# Triton backend (both GQA epilogues), a dense d256 one and a dense
# EVEN_K one (unwindowed, s_k a multiple of the key tiles). Logs to $OUT/sanitizer-*.log.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests
cat > /tmp/sanitize_case.py <<'PY'
import torch, flash_attn_ck as fa
from flash_attn_ck.backends.triton import TritonBackend
torch.manual_seed(0)
lens_q, lens_k = [37, 0, 70, 5], [50, 9, 70, 0]
cu_q = torch.tensor([0] + lens_q).cumsum(0).int().cuda(); cu_k = torch.tensor([0] + lens_k).cumsum(0).int().cuda()
for opts in (dict(), dict(gqa_epilogue="accumulate"), dict(gqa_epilogue="accumulate", use_tma=True)):
    with fa.use_backend(TritonBackend(**opts)):
      q = torch.randn(sum(lens_q), 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
      k = torch.randn(sum(lens_k), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
      v = torch.randn_like(k, requires_grad=True)
      out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                      deterministic=True, backend="triton")
      out.backward(torch.randn_like(out))
      # dense GQA too: with use_tma=True the TMA loads, stores and bulk reduce-add epilogue run under the tools
      qd = torch.randn(2, 70, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
      kd = torch.randn(2, 90, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
      vd = torch.randn_like(kd, requires_grad=True)
      fa.flash_attn_func(qd, kd, vd, causal=True, deterministic=True, backend="triton").sum().backward()
      if not opts:   # head dim 256: its table row orders dO V^T before the exp2 (config.Configs.bwd_dp_first)
          q2, k2, v2 = (torch.randn(2, 150, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                        for _ in range(3))
          fa.flash_attn_func(q2, k2, v2, causal=True, backend="triton").sum().backward()
          # dense, unwindowed, s_k a multiple of every key tile: the EVEN_K kernels (no mask branch), TMA tiles
          q3, k3, v3 = (torch.randn(1, 2304, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                        for _ in range(3))
          fa.flash_attn_func(q3, k3, v3, backend="triton").sum().backward()
torch.cuda.synchronize()
print("case done", opts)
PY
for tool in memcheck racecheck; do
  timeout 240 compute-sanitizer --tool $tool --target-processes all python3 /tmp/sanitize_case.py > "$OUT/sanitizer-$tool.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Device not supported|case done" "$OUT/sanitizer-$tool.log" | tail -4
done
