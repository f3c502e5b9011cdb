// The C ABI's error state and self-description (no CK needed here).
#include "flash_attn_ck.h"

#include <string>

#ifndef FACK_GPU_TARGETS
#define FACK_GPU_TARGETS "unknown"
#endif

namespace fack_detail {

namespace {
thread_local std::string last_error;
thread_local int last_hip_error = 0;
} // namespace

void reset_error()
{
    last_error.clear();
    last_hip_error = 0;
}

int fail(int status, std::string message)
{
    last_error = std::move(message);
    return status;
}

void set_hip_error(int error) { last_hip_error = error; }

} // namespace fack_detail

extern "C" {

const char* fack_last_error(void) { return fack_detail::last_error.c_str(); }

int fack_last_hip_error(void) { return fack_detail::last_hip_error; }

int fack_abi_version(void) { return FACK_ABI_VERSION; }

int64_t fack_attention_size(void) { return static_cast<int64_t>(sizeof(fack_attention)); }

int64_t fack_bwd_args_size(void) { return static_cast<int64_t>(sizeof(fack_bwd_args)); }

const char* fack_gpu_targets(void) { return FACK_GPU_TARGETS; }

} // extern "C"
