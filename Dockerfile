# flash_attn_ck for AMD Instinct GPUs (MI300 = gfx942): builds libflash_attn_ck against ROCm's
# clang and the pinned CK (the tree vendored in amd-aiter==0.1.7.post2.dev18), puts it inside the
# package (flash_attn_ck/backends/ck/, where the ck backend looks), installs the package, and runs
# the test suite by default. See docs/ck.md.
#
#   docker build -t flash_attn_ck:rocm --build-arg BASE_IMAGE=rocm/pytorch:<tag with torch >= 2.11> \
#       --build-arg GPU_ARCHS=gfx942 .
#   docker run --rm --device=/dev/kfd --device=/dev/dri --group-add video --ipc=host flash_attn_ck:rocm
#   (--ipc=host, or --shm-size=2g: the context-parallel tests' gloo ranks share tensors through /dev/shm)
#
# Build arguments:
#   BASE_IMAGE     (required) an image with Python, a HIP clang at /opt/rocm/llvm/bin/clang++, the HIP runtime
#                  and a ROCm build of torch >= 2.11 (the package's floor; the build stops on an older one):
#                  a rocm/pytorch tag with pytorch_release_2.11 or newer (torch 2.6, as in the tag this file used
#                  to name, fails the torch.compile and main-job tests; the integrations refuse it).
#                  scripts/docker_standin_base.sh makes a registry-free stand-in from Debian's packages (CPU torch
#                  2.13, Debian's clang-19 and HIP 5.2: the library compiles, no kernel ever runs).
#   CK_INSTANCES   all (default): every CK instance the dispatcher can reach, about 1100 files per target;
#                  minimal: the CI compile check's two forward and two backward instances (minutes, not hours).
#   GPU_ARCHS      comma-separated targets (gfx942,gfx950 or gfx90a); each multiplies the build time.
#   JOBS           parallel compiles (memory: about 1-2 GB per job); default: every core.
#   CK_CMAKE_ARGS  extra CMake options, e.g. -DCK_EARLY_INLINE=OFF for a clang older than ROCm 6.2's.
#   HIP_PYTHON_VERSION  must match the image's ROCm release.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN python3 -c "import sys, torch; v = tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])); \
sys.exit(0 if v >= (2, 11) else f'BASE_IMAGE has torch {torch.__version__}; flash_attn_ck needs torch >= 2.11')"

ARG GPU_ARCHS=gfx942
ARG CK_INSTANCES=all
ARG JOBS=
ARG CK_CMAKE_ARGS=
ARG HIP_PYTHON_VERSION=6.4.3.555.40
# The `test` extra less its Triton (the image's torch brings its own; none of these replaces torch).
ARG TEST_DEPS="pytest>=8 hypothesis>=6.100 numpy>=1.26 pytest-timeout>=2.3 setuptools>=77 matplotlib>=3.8 \
transformers>=5.0"

WORKDIR /opt/flash_attn_ck
# The library first, from what it is built of, so a change elsewhere does not rebuild it.
COPY csrc_ck/ csrc_ck/
COPY scripts/ scripts/
RUN case "${CK_INSTANCES}" in \
        all) minimal=OFF ;; \
        minimal) minimal=ON ;; \
        *) echo "CK_INSTANCES is all or minimal, not '${CK_INSTANCES}'" >&2; exit 1 ;; \
    esac \
 && python3 scripts/ck_fetch.py \
 && cmake -S csrc_ck -B build/ck -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_COMPILER=/opt/rocm/llvm/bin/clang++ -DROCM_PATH=/opt/rocm -DGPU_ARCHS="${GPU_ARCHS}" \
        -DCK_MINIMAL_INSTANCES="${minimal}" ${CK_CMAKE_ARGS} \
 && cmake --build build/ck -j"${JOBS:-$(nproc)}" \
 && test -f build/ck/libflash_attn_ck.so \
 && rm -rf .ck/wheel build/ck/CMakeFiles

RUN python3 -m pip install --no-cache-dir "hip-python==${HIP_PYTHON_VERSION}" ${TEST_DEPS}

COPY . .
# --no-deps: the image's ROCm torch (and its Triton) must not be replaced by the PyPI builds the
# `test` extra would pull in.
RUN cp build/ck/libflash_attn_ck.so flash_attn_ck/backends/ck/ \
 && python3 -m pip install --no-cache-dir --no-deps --no-build-isolation -e .

# tests/ck/test_ck_compiled.py checks the exported C ABI of this library (no GPU needed).
ENV FLASH_ATTN_CK_CHECK_LIBRARY=/opt/flash_attn_ck/flash_attn_ck/backends/ck/libflash_attn_ck.so
CMD ["python3", "-m", "pytest", "-q", "tests"]
