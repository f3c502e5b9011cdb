#!/usr/bin/env bash
# Prepares a Triton release for the GPU machine, which has its own Triton but no network: the cp312 wheel
# without its profiler parts (cupti, proton), the AMD backend and a test library (the NVIDIA compiler does not
# load them), packed with xz and split into two folders that each fit the 64 MiB one device call carries.
#
#   bash scripts/triton_wheel_parts.sh [VERSION]        (default 3.9.0) -> .triton-parts-a/, .triton-parts-b/
#
# On the device, first call (carry .triton-parts-a):  mkdir -p /root/triton-parts && cp .triton-parts-a/* /root/triton-parts/
# Second call, while the machine is still warm (carry .triton-parts-b):
#   cat /root/triton-parts/part.* .triton-parts-b/part.* | xz -d | tar -x -C /tmp/triton-new
#   export PYTHONPATH=/tmp/triton-new       # then: python3 -c "import triton; print(triton.__version__)"
set -euo pipefail
version=${1:-3.9.0}
root=$(git rev-parse --show-toplevel)
cd "$root"
for d in .triton-parts-a .triton-parts-b; do
  grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$tmp" "triton==$version"
mkdir "$tmp/tree" && (cd "$tmp/tree" && unzip -q "$tmp"/triton-*.whl)
rm -rf "$tmp/tree/triton/backends/nvidia/lib/cupti" "$tmp/tree/triton/backends/nvidia/lib/cupti-blackwell" \
  "$tmp/tree/triton/_C/libproton.so" "$tmp/tree/triton/instrumentation/libGPUInstrumentationTestLib.so" \
  "$tmp/tree/triton/backends/amd"
sed -i '/backends.amd/d' "$tmp"/tree/triton-*.dist-info/entry_points.txt    # backends are found by entry point
tar -C "$tmp/tree" -c . | xz -6 -T0 > "$tmp/triton.tar.xz"
size=$(stat -c %s "$tmp/triton.tar.xz")
rm -rf .triton-parts-a .triton-parts-b && mkdir -p .triton-parts-a .triton-parts-b
split -b $(( (size + 1) / 2 + 1 )) "$tmp/triton.tar.xz" "$tmp/part."
mv "$tmp/part.aa" .triton-parts-a/ && mv "$tmp/part.ab" .triton-parts-b/
du -sh .triton-parts-a .triton-parts-b
