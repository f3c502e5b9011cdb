#!/usr/bin/env bash
# A stand-in for the Dockerfile's ROCm base image, made from Debian 12's packages without an image
# registry: debootstrap + `docker import`. It lets the unmodified Dockerfile build and run its tests on
# a machine without ROCm or an AMD GPU (the CK library is compiled for gfx942 and never launched).
#
#   scripts/docker_standin_base.sh [IMAGE]          # default flash_attn_ck-standin:bookworm
#   docker build --build-arg BASE_IMAGE=flash_attn_ck-standin:bookworm --build-arg CK_INSTANCES=minimal \
#       --build-arg CK_CMAKE_ARGS=-DCK_EARLY_INLINE=OFF --build-arg JOBS=2 -t flash_attn_ck:standin .
#
# What stands in for ROCm: Debian's clang-19, HIP 5.2 (libamdhip64-dev) and device libraries, with the
# gfx942 overlays of scripts/ck_debian_overlay.py, behind /opt/rocm/llvm/bin/clang++ (a wrapper that adds
# the overlays to HIP compiles). torch is a CPU build (TORCH, default torch==2.13.0 from TORCH_INDEX), with
# TRITON (default triton==3.6.0) for the tests that compile the Hopper kernels on the CPU.
# CK_EARLY_INLINE=OFF: clang-19 spends over 35 minutes on a backward kernel with it (docs/ck.md).
# Needs root, debootstrap and a running dockerd; the rootfs (about 1.5 GB) stays in ROOTFS for reuse.
set -euo pipefail

IMAGE=${1:-flash_attn_ck-standin:bookworm}
ROOTFS=${ROOTFS:-/var/tmp/flash_attn_ck-standin-rootfs}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
TORCH=${TORCH:-torch==2.13.0}          # a requirement, or the path of a wheel (copied in)
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}   # this machine's, for pip behind a proxy
# The Triton a ROCm image brings with its torch; here the one the CPU tests run under (CI's).
TRITON=${TRITON:-triton==3.6.0}
PACKAGES=python3,python3-dev,python3-pip,python3-venv,ca-certificates,clang-19,clang-tools-19,lld-19,llvm-19
PACKAGES+=,libamdhip64-dev,rocm-device-libs,cmake,make,gcc,g++
cd "$(dirname "${BASH_SOURCE[0]}")/.."

in_root() { chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }

if [[ ! -x $ROOTFS/usr/bin/clang++-19 ]]; then
    rm -rf "$ROOTFS"
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$ROOTFS" "$MIRROR"
fi
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
# A rootfs kept from an earlier run gets what PACKAGES has gained since.
in_root apt-get install -y -q --no-install-recommends ${PACKAGES//,/ } > /dev/null
cp "$CA_BUNDLE" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
rm -f "$ROOTFS"/usr/lib/python3*/EXTERNALLY-MANAGED       # pip installs into the image's Python, as in ROCm's

echo "== gfx942 overlays and /opt/rocm/llvm/bin/clang++"
cp scripts/ck_debian_overlay.py "$ROOTFS/tmp/"
in_root python3 /tmp/ck_debian_overlay.py /opt/rocm/overlay
mkdir -p "$ROOTFS/opt/rocm/llvm/bin"
cat >"$ROOTFS/opt/rocm/llvm/bin/clang++" <<'EOF'
#!/bin/sh
# Debian's clang-19 standing in for ROCm's clang++: HIP compiles get the gfx942 overlays.
case " $* " in
    *" -x hip "*) exec clang++-19 --rocm-device-lib-path=/opt/rocm/overlay/bitcode -I/opt/rocm/overlay/include "$@" ;;
esac
exec clang++-19 "$@"
EOF
chmod +x "$ROOTFS/opt/rocm/llvm/bin/clang++"

echo "== $TORCH"
if [[ -f $TORCH ]]; then
    cp "$TORCH" "$ROOTFS/tmp/"
    in_root python3 -m pip install --no-cache-dir "/tmp/$(basename "$TORCH")"
else
    in_root python3 -m pip install --no-cache-dir "$TORCH" --extra-index-url "$TORCH_INDEX"
fi
in_root python3 -m pip install --no-cache-dir --no-deps "$TRITON"
rm -f "$ROOTFS"/tmp/*.whl "$ROOTFS/tmp/ck_debian_overlay.py"
in_root python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== docker import $IMAGE"
tar -C "$ROOTFS" --exclude=./proc --exclude=./sys --exclude=./dev -c . \
    | docker import --change 'CMD ["/bin/bash"]' - "$IMAGE"
