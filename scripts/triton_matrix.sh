#!/usr/bin/env bash
# Compile every kernel family under each Triton release named (default: every supported one), without a GPU:
# per release, the wheel into .triton-matrix/VERSION (pip, --no-deps: the installed torch stays), then
# scripts/triton_compile_check.py and the CPU compile tests with that Triton first on the path.
#
#   bash scripts/triton_matrix.sh [--quick] [VERSION ...]      e.g. bash scripts/triton_matrix.sh 3.7.1 3.9.0
#
# Exits non-zero if any release fails to compile a kernel or fails a compile test.
set -uo pipefail
cd "$(dirname "$0")/.."
quick=()
if [[ "${1:-}" == "--quick" ]]; then quick=(--quick); shift; fi
versions=("$@")
[[ ${#versions[@]} -eq 0 ]] && versions=(3.6.0 3.7.1 3.8.0 3.9.0)
python=${PYTHON:-python3}
status=0
for version in "${versions[@]}"; do
  target=.triton-matrix/$version
  if [[ ! -d $target/triton ]]; then
    "$python" -m pip install -q --no-deps --target "$target" "triton==$version" || { status=1; continue; }
  fi
  echo "== triton $version"
  PYTHONPATH="$PWD/$target" "$python" scripts/triton_compile_check.py "${quick[@]}" 2>/dev/null | tail -n 1 || status=1
  PYTHONPATH="$PWD/$target" "$python" -m pytest -q -p no:cacheprovider tests/triton/test_triton_versions.py \
    tests/triton/test_triton_ws.py tests/triton/test_triton_ws_named_barriers.py \
    tests/triton/test_triton_fwd_ws.py tests/triton/test_fwd_ws_split_mask.py \
    tests/triton/test_varlen_schedule_launch.py tests/triton/test_triton_softmax_terms.py \
    tests/scripts/test_ptx_compare.py \
    2>&1 | tail -n 3 || status=1
done
exit $status
