#!/usr/bin/env bash
# Compile check of the CK path for gfx942 on a Debian 12 machine without ROCm or an AMD GPU (CI).
#
# Builds csrc_ck/CMakeLists.txt with CK_MINIMAL_INSTANCES: the C ABI glue plus a minimal generated
# instance set (forward: a plain and a featureful instance + their API dispatcher; backward: a plain
# and a featureful dq_dk_dv with their dot_do_o and convert_dq + the dispatcher), compiled to real
# gfx942 code objects by Debian's clang-19 against HIP 5.2, and linked into
# build/ck_compile_check/libflash_attn_ck.so with -Wl,--no-undefined.
# Then checks that every kernel object holds gfx942 kernels and lists the exported C functions.
#
# This proves the code compiles and links for gfx942; it never runs (there is no GPU), and the
# library uses Debian's HIP 5.2 ABI. MI300 users build against ROCm 6 with the Dockerfile.
# CK_EARLY_INLINE is off: with `-mllvm -amdgpu-early-inline-all=true -amdgpu-function-calls=false`
# clang-19 keeps the dq_dk_dv kernel over 35 minutes in LLVM's loop passes (CK itself only adds
# them for HIP newer than 6.2).
#
# Internal: `ck_compile_check.sh --time COMPILER ARGS...` is the compiler launcher that prints
# each file's compile time.
set -euo pipefail

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

if [[ ${1:-} == --time ]]; then
    shift
    start=$(now)
    "$@"
    source_file=${*: -1}   # CMake's compile rules end with `-c SOURCE`
    printf '   %6s s  %s\n' "$(since "$start")" "$(basename "$source_file")"
    exit 0
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${CK_CHECK_OUT:-build/ck_compile_check}
JOBS=${JOBS:-$(nproc)}
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)
fi
PACKAGES=(clang-19 clang-tools-19 lld-19 llvm-19 libamdhip64-dev rocm-device-libs cmake make)
ARCH=gfx942
T0=$(now)
step() { echo "== ck compile check [$(since "$T0") s] $*"; }

step "toolchain: ${PACKAGES[*]}"
if ! dpkg -s "${PACKAGES[@]}" >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
fi

step "CK sources (amd-aiter wheel)"
CK=$("$PYTHON" scripts/ck_fetch.py)

step "gfx942 device-library and HIP header overlays"
rm -rf "$OUT"
OVERLAY=$PWD/$OUT/overlay
python3 scripts/ck_debian_overlay.py "$OVERLAY" >/dev/null

step "configure (CI instance set: fwd and bwd fp16 d128 batch; fwd bf16 d256/psskddv qr group mask ALiBi dropout; bwd bf16 d96/pd8 group mask ALiBi dropout deterministic)"
cmake -S csrc_ck -B "$OUT" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_COMPILER=clang++-19 -DCMAKE_CXX_COMPILER_LAUNCHER="$PWD/scripts/ck_compile_check.sh;--time" \
    -DCK_ROOT="$CK" -DGPU_ARCHS="$ARCH" -DCK_MINIMAL_INSTANCES=ON -DCK_EARLY_INLINE=OFF \
    -DFACK_EXTRA_HIP_FLAGS="--rocm-device-lib-path=$OVERLAY/bitcode;-I$OVERLAY/include" \
    -DPython3_EXECUTABLE="$(command -v python3)" >"$OUT.configure.log" 2>&1 || { cat "$OUT.configure.log"; exit 1; }
grep "CK instances" "$OUT.configure.log"

step "compile and link for $ARCH on $JOBS jobs"
cmake --build "$OUT" -j "$JOBS" -- --no-print-directory | grep --line-buffered -v '^\[' || true
LIB=$OUT/libflash_attn_ck.so
[[ -f $LIB ]] || { echo "ck compile check: build failed" >&2; exit 1; }

step "checking the result"
# Each kernel instance must carry a gfx942 code object with kernels in it (MFMA code, not stubs).
mapfile -t OBJECTS < <(find "$OUT/CMakeFiles" -name 'fmha_*.o' ! -name '*_api.cpp.o' | sort)
for obj in "${OBJECTS[@]}"; do
    llvm-objcopy-19 --dump-section .hip_fatbin="$obj.fatbin" "$obj"
    clang-offload-bundler-19 --unbundle --type=o --input="$obj.fatbin" \
        --targets="hipv4-amdgcn-amd-amdhsa--$ARCH" --output="$obj.$ARCH.co"
    kernels=$(llvm-readelf-19 -sW "$obj.$ARCH.co" | awk '$8 ~ /\.kd$/ { print $8 }' | sort -u | wc -l)
    mfma=$(llvm-objdump-19 -d "$obj.$ARCH.co" | grep -c 'v_mfma' || true)
    printf '   %s: %s kernel(s), %4s MFMA instructions  %s\n' "$ARCH" "$kernels" "$mfma" "$(basename "$obj")"
    if ((kernels == 0)); then
        echo "ck compile check: $obj holds no $ARCH kernel" >&2
        exit 1
    fi
done
EXPORTED=$(nm -D --defined-only "$LIB" | awk '$3 ~ /^fack_/ { print $3 }' | sort | tr '\n' ' ')
echo "   exported: $EXPORTED"
step "done: $LIB ($(du -h "$LIB" | cut -f1))"
