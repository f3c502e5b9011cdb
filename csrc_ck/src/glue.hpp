// Shared by fwd.cpp and bwd.cpp: value checks, the fields CK's forward and backward argument
// structs have in common, and the status/message plumbing of the C ABI.
// (CK's fmha_fwd.hpp and fmha_bwd.hpp cannot be included together, hence one file per direction.)
#pragma once

#include "flash_attn_ck.h"

#include "bias.hpp"
#include "mask.hpp"

#include "ck_tile/host/device_prop.hpp"

#include <hip/hip_runtime.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#ifndef FACK_GPU_TARGETS
#define FACK_GPU_TARGETS "unknown"
#endif

namespace fack_detail {

// The per-thread error state behind fack_last_error / fack_last_hip_error (status.cpp).
void reset_error();
int fail(int status, std::string message);
void set_hip_error(int error);

// A value refused before CK sees it.
struct invalid_argument : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// CK indexes with 32-bit integers: refuse what would silently wrap.
inline ck_tile::index_t narrow(int64_t value, const char* name)
{
    if(value < std::numeric_limits<ck_tile::index_t>::min() ||
       value > std::numeric_limits<ck_tile::index_t>::max())
        throw invalid_argument(std::string(name) + " = " + std::to_string(value) +
                               " does not fit CK's 32-bit index type");
    return static_cast<ck_tile::index_t>(value);
}

inline std::string dtype_name(int32_t dtype)
{
    switch(dtype)
    {
    case FACK_FP16: return "fp16";
    case FACK_BF16: return "bf16";
    default: throw invalid_argument("dtype " + std::to_string(dtype) + " is not FACK_FP16 or FACK_BF16");
    }
}

inline mask_enum mask_of(int32_t type)
{
    if(type < FACK_MASK_NONE || type > FACK_MASK_WINDOW_GENERIC)
        throw invalid_argument("mask_type " + std::to_string(type) + " is not a fack_mask_type");
    return static_cast<mask_enum>(type);
}

inline bias_enum bias_of(const fack_attention& a)
{
    return a.alibi_slopes ? bias_enum::alibi : bias_enum::no_bias;
}

// The fields fmha_fwd_args and fmha_bwd_args share (same names in both CK structs).
template <typename CkArgs>
void fill_shared(const fack_attention& a, CkArgs& c)
{
    if(a.group_mode && (!a.seqstart_q || !a.seqstart_k))
        throw invalid_argument("group mode needs seqstart_q and seqstart_k");
    if(a.p_drop > 0.0f && (!a.drop_seed || !a.drop_offset))
        throw invalid_argument("dropout needs the device pointers drop_seed and drop_offset");

    c.q_ptr        = a.q.data;
    c.k_ptr        = a.k.data;
    c.v_ptr        = a.v.data;
    c.o_ptr        = a.out.data;
    c.lse_ptr      = a.lse.data;
    c.bias_ptr     = a.alibi_slopes; // CK reads ALiBi slopes through the bias pointer
    c.rand_val_ptr = nullptr;

    c.seqstart_q_ptr = a.group_mode ? a.seqstart_q : nullptr;
    c.seqstart_k_ptr = a.group_mode ? a.seqstart_k : nullptr;

    c.seqlen_q     = narrow(a.seqlen_q, "seqlen_q");
    c.seqlen_k     = narrow(a.seqlen_k, "seqlen_k");
    c.batch        = narrow(a.batch, "batch");
    c.max_seqlen_q = narrow(a.max_seqlen_q, "max_seqlen_q");
    c.hdim_q       = narrow(a.head_dim_q, "head_dim_q");
    c.hdim_v       = narrow(a.head_dim_v, "head_dim_v");
    c.nhead_q      = narrow(a.nhead_q, "nhead_q");
    c.nhead_k      = narrow(a.nhead_k, "nhead_k");

    c.stride_q       = narrow(a.q.row_stride, "q.row_stride");
    c.stride_k       = narrow(a.k.row_stride, "k.row_stride");
    c.stride_v       = narrow(a.v.row_stride, "v.row_stride");
    c.stride_o       = narrow(a.out.row_stride, "out.row_stride");
    c.nhead_stride_q = narrow(a.q.head_stride, "q.head_stride");
    c.nhead_stride_k = narrow(a.k.head_stride, "k.head_stride");
    c.nhead_stride_v = narrow(a.v.head_stride, "v.head_stride");
    c.nhead_stride_o = narrow(a.out.head_stride, "out.head_stride");
    c.batch_stride_q = narrow(a.q.batch_stride, "q.batch_stride");
    c.batch_stride_k = narrow(a.k.batch_stride, "k.batch_stride");
    c.batch_stride_v = narrow(a.v.batch_stride, "v.batch_stride");
    c.batch_stride_o = narrow(a.out.batch_stride, "out.batch_stride");

    // ALiBi: one slope per (batch, head); a (h,) vector is broadcast with batch stride 0.
    c.stride_bias          = narrow(a.alibi_batch_stride, "alibi_batch_stride");
    c.nhead_stride_bias    = 0;
    c.batch_stride_bias    = 0;
    c.stride_randval       = 0;
    c.nhead_stride_randval = 0;
    c.batch_stride_randval = 0;

    c.window_size_left  = narrow(a.window_left, "window_left");
    c.window_size_right = narrow(a.window_right, "window_right");
    c.mask_type         = static_cast<ck_tile::index_t>(mask_of(a.mask_type));

    c.p_drop = a.p_drop;
    // Device pointers, so a captured graph reads the rng_state of each replay.
    c.drop_seed_offset = std::make_pair(static_cast<const void*>(a.drop_seed),
                                        static_cast<const void*>(a.drop_offset));
}

// "bf16 hdim 192/128 batch mode, bottom-right mask, dropout" (hdim_q/hdim_v) for a no-instance message.
template <typename Traits>
std::string describe(const Traits& t)
{
    static const char* const masks[] = {"no mask", "top-left mask", "bottom-right mask", "generic window"};
    return t.data_type + " hdim " + std::to_string(t.hdim_q) + "/" + std::to_string(t.hdim_v) +
           (t.is_group_mode ? " group mode, " : " batch mode, ") +
           masks[static_cast<int>(t.mask_type)] + (t.bias_type == bias_enum::alibi ? ", ALiBi" : "") +
           (t.has_dropout ? ", dropout" : "");
}

// CK returns a negative time when no generated instance matches the traits.
inline int check_launch(float ck_result, const char* api, const std::string& what)
{
    if(ck_result < 0)
    {
        // CK dispatches on the current device's gfx name: say which one it saw.
        const std::string device = ck_tile::get_device_name();
        return fail(FACK_NO_INSTANCE, std::string(api) + ": no CK kernel instance was compiled for " + what +
                                          " on " + (device.empty() ? "no HIP device" : device) +
                                          " (library targets " FACK_GPU_TARGETS ")");
    }
    const hipError_t err = hipGetLastError();
    if(err != hipSuccess)
    {
        set_hip_error(static_cast<int>(err));
        return fail(FACK_HIP_ERROR, std::string(api) + ": kernel launch failed: " + hipGetErrorName(err));
    }
    return FACK_OK;
}

// The HIP device queries fmha_fwd makes before dispatching (hipGetDevice, hipGetDeviceProperties).
inline int check_device()
{
    int device = 0;
    hipError_t err = hipGetDevice(&device);
    hipDeviceProp_t props{};
    if(err == hipSuccess)
        err = hipGetDeviceProperties(&props, device);
    if(err != hipSuccess)
    {
        set_hip_error(static_cast<int>(err));
        return fail(FACK_HIP_ERROR, std::string("querying the current HIP device failed: ") + hipGetErrorName(err));
    }
    return FACK_OK;
}

// CK's launch path checks hipGetLastError() itself and throws ("HIP runtime error: <text>. ..." or
// "HIP Function Failed (...) <text>"), which clears the error: map the text back to its code.
inline bool is_hip_exception(const std::string& what, int& code)
{
    if(what.rfind("HIP runtime error", 0) != 0 && what.rfind("HIP Function Failed", 0) != 0)
        return false;
    code = 0;
    for(int e = 1; e < 1100; ++e)
    {
        const char* text = hipGetErrorString(static_cast<hipError_t>(e));
        if(text && *text && what.find(text) != std::string::npos && std::string(text) != "unknown error")
        {
            code = e;
            break;
        }
    }
    return true;
}

// Runs one call with the error state reset; no exception may cross the C ABI.
template <typename Call>
int guarded(const void* args, Call&& call)
{
    reset_error();
    if(!args)
        return fail(FACK_INVALID_ARGUMENT, "args is NULL");
    try
    {
        return call();
    }
    catch(const invalid_argument& e)
    {
        return fail(FACK_INVALID_ARGUMENT, e.what());
    }
    catch(const std::exception& e)
    {
        int code = 0;
        if(is_hip_exception(e.what(), code))
        {
            set_hip_error(code);
            return fail(FACK_LAUNCH_ERROR, std::string("kernel launch failed: ") + e.what());
        }
        return fail(FACK_INTERNAL_ERROR, std::string("CK raised: ") + e.what());
    }
    catch(...)
    {
        return fail(FACK_INTERNAL_ERROR, "CK raised a non-standard exception");
    }
}

inline ck_tile::stream_config on_stream(void* stream)
{
    ck_tile::stream_config config{};
    config.stream_id_ = static_cast<hipStream_t>(stream);
    return config;
}

} // namespace fack_detail
