// fack_fwd: our fack_attention -> CK's fmha_fwd_traits / fmha_fwd_args.
#include "fmha_fwd.hpp"

#include "glue.hpp"

namespace fack_detail {
namespace {

fmha_fwd_traits fwd_traits(const fack_attention& a)
{
    fmha_fwd_traits t{};
    t.hdim_q              = narrow(a.head_dim_q, "head_dim_q");
    t.hdim_v              = narrow(a.head_dim_v, "head_dim_v");
    t.data_type           = dtype_name(a.dtype);
    t.is_group_mode       = a.group_mode != 0;
    t.is_v_rowmajor       = true;
    t.has_logits_soft_cap = false; // softcap is refused by the Python backend, never ignored
    t.mask_type           = mask_of(a.mask_type);
    t.bias_type           = bias_of(a);
    t.has_lse             = true; // the backward needs it
    t.has_dropout         = a.p_drop > 0.0f;
    t.do_fp8_static_quant = false;
    t.skip_min_seqlen_q   = false;
    return t;
}

fmha_fwd_args fwd_args(const fack_attention& a)
{
    fmha_fwd_args c{};
    fill_shared(a, c);
    c.scale_s          = a.softmax_scale;
    c.scale_p          = 1.0f;
    c.scale_o          = 1.0f;
    c.logits_soft_cap  = 0.0f;
    c.nhead_stride_lse = narrow(a.lse.head_stride, "lse.head_stride");
    c.batch_stride_lse = narrow(a.lse.batch_stride, "lse.batch_stride");
    c.min_seqlen_q     = 0;
    c.s_randval        = false;
    return c;
}

} // namespace
} // namespace fack_detail

extern "C" int fack_fwd(const fack_attention* args, void* stream)
{
    using namespace fack_detail;
    return guarded(args, [&] {
        const fmha_fwd_traits traits = fwd_traits(*args);
        // fmha_fwd returns -1 both for "no instance" and when its CU-count query fails: ask first, so
        // a negative result below means "no instance" only.
        if(const int status = check_device(); status != FACK_OK)
            return status;
        return check_launch(fmha_fwd(traits, fwd_args(*args), on_stream(stream)), "fmha_fwd",
                            describe(traits));
    });
}
