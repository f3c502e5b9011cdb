// fack_bwd: our fack_bwd_args -> CK's fmha_bwd_traits / fmha_bwd_args (the three-kernel
// dot_do_o, dq_dk_dv, convert_dq pipeline behind fmha_bwd<2>).
#include "fmha_bwd.hpp"

#include "glue.hpp"

namespace fack_detail {

// scripts/ck_generate.py: CK's backward dispatcher with each launch replaced by its instance's bn0.
int bwd_tile_kn0(const fmha_bwd_traits& t, const fmha_bwd_args& a, const std::string& device_name);

namespace {

fmha_bwd_traits bwd_traits(const fack_bwd_args& b)
{
    fmha_bwd_traits t{};
    t.hdim_q           = narrow(b.attn.head_dim_q, "head_dim_q");
    t.hdim_v           = narrow(b.attn.head_dim_v, "head_dim_v");
    t.data_type        = dtype_name(b.attn.dtype);
    t.is_group_mode    = b.attn.group_mode != 0;
    t.mask_type        = mask_of(b.attn.mask_type);
    t.bias_type        = bias_of(b.attn);
    t.has_dbias        = false;
    t.has_dropout      = b.attn.p_drop > 0.0f;
    t.is_store_randval = false;
    t.is_deterministic = b.deterministic != 0;
    return t;
}

fmha_bwd_args bwd_args(const fack_bwd_args& b)
{
    // CK reads lse and D with one set of strides: the frontend allocates D like lse.
    if(b.d.head_stride != b.attn.lse.head_stride || b.d.batch_stride != b.attn.lse.batch_stride)
        throw invalid_argument("d must have the strides of lse");

    fmha_bwd_args c{};
    fill_shared(b.attn, c);
    c.do_ptr     = b.dout.data;
    c.d_ptr      = b.d.data;
    c.dq_ptr     = b.dq.data;
    c.dk_ptr     = b.dk.data;
    c.dv_ptr     = b.dv.data;
    c.dbias_ptr  = nullptr;
    c.dq_acc_ptr = b.dq_acc.data;

    c.max_seqlen_k = narrow(b.attn.max_seqlen_k, "max_seqlen_k");
    c.scale        = b.attn.softmax_scale;

    c.stride_do     = narrow(b.dout.row_stride, "dout.row_stride");
    c.stride_dq     = narrow(b.dq.row_stride, "dq.row_stride");
    c.stride_dk     = narrow(b.dk.row_stride, "dk.row_stride");
    c.stride_dv     = narrow(b.dv.row_stride, "dv.row_stride");
    c.stride_dq_acc = narrow(b.dq_acc.row_stride, "dq_acc.row_stride");
    c.stride_dbias  = 0;

    c.nhead_stride_do     = narrow(b.dout.head_stride, "dout.head_stride");
    c.nhead_stride_dq     = narrow(b.dq.head_stride, "dq.head_stride");
    c.nhead_stride_dk     = narrow(b.dk.head_stride, "dk.head_stride");
    c.nhead_stride_dv     = narrow(b.dv.head_stride, "dv.head_stride");
    c.nhead_stride_dq_acc = narrow(b.dq_acc.head_stride, "dq_acc.head_stride");
    c.nhead_stride_lsed   = narrow(b.attn.lse.head_stride, "lse.head_stride");
    c.nhead_stride_dbias  = 0;

    c.batch_stride_do     = narrow(b.dout.batch_stride, "dout.batch_stride");
    c.batch_stride_dq     = narrow(b.dq.batch_stride, "dq.batch_stride");
    c.batch_stride_dk     = narrow(b.dk.batch_stride, "dk.batch_stride");
    c.batch_stride_dv     = narrow(b.dv.batch_stride, "dv.batch_stride");
    c.batch_stride_dq_acc = narrow(b.dq_acc.batch_stride, "dq_acc.batch_stride");
    c.batch_stride_lsed   = narrow(b.attn.lse.batch_stride, "lse.batch_stride");
    c.batch_stride_dbias  = 0;

    c.split_stride_dq_acc = narrow(b.dq_acc_split_stride, "dq_acc_split_stride");
    c.p_undrop            = b.p_undrop;
    return c;
}

} // namespace
} // namespace fack_detail

extern "C" int fack_bwd(const fack_bwd_args* args, void* stream)
{
    using namespace fack_detail;
    return guarded(args, [&] {
        const fmha_bwd_traits traits = bwd_traits(*args);
        const std::string what = describe(traits) + (traits.is_deterministic ? ", deterministic" : "");
        return check_launch(fmha_bwd<2>(traits, bwd_args(*args), on_stream(stream)), "fmha_bwd", what);
    });
}

extern "C" int fack_bwd_tile(const fack_bwd_args* args, const char* gfx_arch, int32_t* kn0)
{
    using namespace fack_detail;
    return guarded(args, [&] {
        if(!gfx_arch || !kn0)
            throw invalid_argument("fack_bwd_tile needs gfx_arch and kn0");
        // Only sizes and features are read: stand-ins for pointers the caller may not have yet.
        static const int32_t no_seqstart[2] = {0, 0};
        static const int64_t no_rng[2]      = {0, 0};
        fack_bwd_args sizes = *args;
        sizes.attn.seqstart_q  = sizes.attn.seqstart_q ? sizes.attn.seqstart_q : no_seqstart;
        sizes.attn.seqstart_k  = sizes.attn.seqstart_k ? sizes.attn.seqstart_k : no_seqstart;
        sizes.attn.drop_seed   = sizes.attn.drop_seed ? sizes.attn.drop_seed : no_rng;
        sizes.attn.drop_offset = sizes.attn.drop_offset ? sizes.attn.drop_offset : no_rng + 1;
        const fmha_bwd_traits traits = bwd_traits(sizes);
        const int tile = bwd_tile_kn0(traits, bwd_args(sizes), gfx_arch);
        if(tile <= 0)
            return fail(FACK_NO_INSTANCE, "fack_bwd_tile: no CK kernel instance was compiled for " + describe(traits) +
                                              " on " + gfx_arch + " (library targets " FACK_GPU_TARGETS ")");
        *kn0 = tile;
        return static_cast<int>(FACK_OK);
    });
}
