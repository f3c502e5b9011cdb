#!/usr/bin/env bash
# Compile check of the CK path for gfx942 on a Debian 12 machine without ROCm or an AMD GPU (CI).
#
# Builds the C ABI glue (csrc_ck/src) and a minimal generated CK instance set (forward: one
# instance + its API dispatcher; backward: dot_do_o, convert_dq, one dq_dk_dv + the dispatcher)
# into real gfx942 code objects with Debian's clang-19 and HIP 5.2, and links them into
# build/ck_compile_check/libflash_attn_ck.so with -Wl,--no-undefined.
#
# This proves the code compiles and links for gfx942; it never runs (there is no GPU), and the
# library uses Debian's HIP 5.2 ABI. MI300 users build against ROCm 6 with the Dockerfile.
# The compile flags mirror csrc_ck/CMakeLists.txt, minus `-mllvm -amdgpu-early-inline-all=true
# -mllvm -amdgpu-function-calls=false`: with clang-19 they keep the dq_dk_dv kernel over 35 minutes
# in LLVM's loop passes (CK itself only adds them for HIP newer than 6.2).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${CK_CHECK_OUT:-build/ck_compile_check}
JOBS=${JOBS:-$(nproc)}
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)
fi
PACKAGES=(clang-19 clang-tools-19 lld-19 llvm-19 libamdhip64-dev rocm-device-libs)
ARCH=gfx942

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
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
mkdir -p "$OUT/obj"
python3 scripts/ck_debian_overlay.py "$OUT/overlay" >/dev/null

step "minimal instance set"
python3 scripts/ck_generate.py --ck "$CK" --out "$OUT/gen" --targets "$ARCH" --minimal >/dev/null

CXXFLAGS=(
    -x hip --offload-arch="$ARCH" -std=c++20 -O3 -fPIC -fbracket-depth=1024
    -fgpu-flush-denormals-to-zero -DCK_TILE_FMHA_FWD_FAST_EXP2=1 -DCK_TILE_FLOAT_TO_BFLOAT16_DEFAULT=3
    -DCK_TILE_FMHA_FWD_SPLITKV_API=0 -DCK_TILE_FMHA_FWD_APPENDKV_API=0 -DCK_TILE_FMHA_FWD_PAGEDKV_API=0
    -Wno-undefined-func-template -Wno-float-equal
    --rocm-device-lib-path="$OUT/overlay/bitcode" -I"$OUT/overlay/include"
    -Icsrc_ck/include -I"$CK/include" -I"$CK/example/ck_tile/01_fmha"
    "-DFACK_GPU_TARGETS=\"$ARCH\""
)

compile_one() {
    local src=$1 start obj
    obj="$OUT/obj/$(basename "${src%.cpp}").o"
    start=$(now)
    if clang++-19 "${CXXFLAGS[@]}" -c "$src" -o "$obj" 2>"$obj.log"; then
        printf '   %6s s  %s\n' "$(since "$start")" "$(basename "$src")"
    else
        cat "$obj.log" >&2
        touch "$obj.failed"
    fi
}

# Longest first (the dq_dk_dv and forward kernels), so the two cores finish together.
mapfile -t SOURCES < <(ls "$OUT"/gen/fmha_bwd_d[0-9]*.cpp "$OUT"/gen/fmha_fwd_d*.cpp \
    "$OUT"/gen/fmha_bwd_dot_do_o_*.cpp "$OUT"/gen/fmha_bwd_convert_dq_*.cpp "$OUT"/gen/fmha_*_api.cpp \
    csrc_ck/src/*.cpp)
step "compiling ${#SOURCES[@]} files for $ARCH on $JOBS jobs"
for src in "${SOURCES[@]}"; do
    while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
    compgen -G "$OUT/obj/*.failed" >/dev/null && break
    compile_one "$src" &
done
wait
if compgen -G "$OUT/obj/*.failed" >/dev/null; then
    echo "ck compile check: compilation failed" >&2
    exit 1
fi

step "linking with -Wl,--no-undefined"
clang++-19 -shared -fuse-ld=lld -o "$OUT/libflash_attn_ck.so" "$OUT"/obj/*.o -lamdhip64 -Wl,--no-undefined

step "checking the result"
# Each kernel instance must carry a gfx942 code object with kernels in it (MFMA code, not stubs).
for obj in "$OUT"/obj/fmha_*.o; do
    [[ $obj == *_api.o ]] && continue     # the dispatchers are host code
    llvm-objcopy-19 --dump-section .hip_fatbin="$obj.fatbin" "$obj"
    clang-offload-bundler-19 --unbundle --type=o --input="$obj.fatbin" \
        --targets="hipv4-amdgcn-amd-amdhsa--$ARCH" --output="$obj.$ARCH.co"
    kernels=$(llvm-readelf-19 -sW "$obj.$ARCH.co" | awk '$8 ~ /\.kd$/ { print $8 }' | sort -u | wc -l)
    mfma=$(llvm-objdump-19 -d "$obj.$ARCH.co" | grep -c 'v_mfma' || true)
    printf '   %s: %s kernels, %s MFMA instructions  %s\n' "$ARCH" "$kernels" "$mfma" "$(basename "$obj")"
    if ((kernels == 0)); then
        echo "ck compile check: $obj holds no $ARCH kernel" >&2
        exit 1
    fi
done
EXPORTED=$(nm -D --defined-only "$OUT/libflash_attn_ck.so" | awk '$3 ~ /^fack_/ { print $3 }' | sort | tr '\n' ' ')
echo "   exported: $EXPORTED"
step "done: $OUT/libflash_attn_ck.so ($(du -h "$OUT/libflash_attn_ck.so" | cut -f1))"
