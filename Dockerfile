# flash_attn_ck for AMD Instinct GPUs (MI300 = gfx942): builds libflash_attn_ck against ROCm's
# clang and the pinned CK (the tree vendored in amd-aiter==0.1.7.post2.dev18), installs the
# package, and runs the test suite by default. See docs/ck.md.
#
#   docker build -t flash_attn_ck:rocm --build-arg GPU_ARCHS=gfx942 .
#   docker run --rm --device=/dev/kfd --device=/dev/dri --group-add video --ipc=host flash_attn_ck:rocm
#
# GPU_ARCHS takes several targets, comma-separated (gfx942,gfx950 or gfx90a); each multiplies the
# build time (about 1100 instance files per target). JOBS bounds the parallel compiles (memory:
# about 1-2 GB per job).
FROM rocm/pytorch:rocm6.4.3_ubuntu24.04_py3.12_pytorch_release_2.6.0

ARG GPU_ARCHS=gfx942
ARG JOBS=
# hip-python must match the image's ROCm release.
ARG HIP_PYTHON_VERSION=6.4.3.555.40

WORKDIR /opt/flash_attn_ck
COPY . .

RUN python3 scripts/ck_fetch.py \
 && cmake -S csrc_ck -B build/ck -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_COMPILER=/opt/rocm/llvm/bin/clang++ -DROCM_PATH=/opt/rocm -DGPU_ARCHS="${GPU_ARCHS}" \
 && cmake --build build/ck -j"${JOBS:-$(nproc)}" \
 && test -f build/ck/libflash_attn_ck.so \
 && rm -rf .ck/wheel build/ck/CMakeFiles

# --no-deps: the image's ROCm torch (and its Triton) must not be replaced by the PyPI builds the
# `test` extra would pull in.
RUN python3 -m pip install --no-cache-dir --no-deps -e . \
 && python3 -m pip install --no-cache-dir "hip-python==${HIP_PYTHON_VERSION}" "pytest>=8" "hypothesis>=6.100"

ENV FLASH_ATTN_CK_LIBRARY=/opt/flash_attn_ck/build/ck/libflash_attn_ck.so
CMD ["python3", "-m", "pytest", "-q", "tests"]
