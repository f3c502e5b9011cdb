/*
 * flash_attn_ck.h: the C ABI of libflash_attn_ck, a thin layer over Composable Kernel's
 * fmha_fwd / fmha_bwd host API (example/ck_tile/01_fmha).
 *
 * Plain C structs only (no torch, no CK, no HIP types), so the Python side can mirror them with
 * ctypes and the library does not depend on the torch version. Every stride is in elements.
 * Integers are 64-bit here; the glue checks that each fits CK's 32-bit index type and reports
 * FACK_INVALID_ARGUMENT when one does not.
 *
 * Layouts (as in flash-attention; q, k, dq, dk have the head dim d, v, out, dout, dv the value head dim d_v):
 *   batch mode: q/dq (b, s_q, h, d), out/dout (b, s_q, h, d_v), k/dk (b, s_k, h_k, d), v/dv (b, s_k, h_k, d_v),
 *               lse/d fp32 (b, h, s_q)
 *   group mode: the same with (total_q, ...) / (total_k, ...) rows, lse/d fp32 (h, total_q), batch strides 0,
 *               seqstart_q/k = cu_seqlens (int32, b + 1)
 */
#ifndef FLASH_ATTN_CK_H
#define FLASH_ATTN_CK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct below changes; the Python side refuses a library of another version. */
#define FACK_ABI_VERSION 3

typedef enum fack_status {
    FACK_OK = 0,
    FACK_INVALID_ARGUMENT = 1, /* a value the glue rejects before calling CK (see fack_last_error) */
    FACK_NO_INSTANCE = 2,      /* CK's dispatcher has no compiled kernel for these traits */
    FACK_HIP_ERROR = 3,        /* a HIP call failed; fack_last_hip_error() gives the hipError_t */
    FACK_INTERNAL_ERROR = 4,   /* an exception escaped CK */
    FACK_LAUNCH_ERROR = 5      /* CK's launch raised a HIP error (e.g. an invalid grid). CK has read and so
                                  cleared it: fack_last_error() carries its text, fack_last_hip_error()
                                  its code where the glue could map the text back, else 0 */
} fack_status;

typedef enum fack_dtype { FACK_FP16 = 0, FACK_BF16 = 1 } fack_dtype;

/* CK's mask_enum; only the type, left and right reach the kernel (it rebuilds the rest). */
typedef enum fack_mask_type {
    FACK_MASK_NONE = 0,
    FACK_MASK_TOP_LEFT = 1,
    FACK_MASK_BOTTOM_RIGHT = 2,
    FACK_MASK_WINDOW_GENERIC = 3
} fack_mask_type;

/* A (batch, rows, heads, head_dim) tensor whose last dimension is contiguous. */
typedef struct fack_tensor {
    void* data;
    int64_t batch_stride;
    int64_t row_stride;
    int64_t head_stride;
} fack_tensor;

/* An fp32 per-row statistic (lse or D = rowsum(dO * O)): (b, h, s_q), or (h, total_q) in group mode. */
typedef struct fack_row_stats {
    void* data;
    int64_t batch_stride;
    int64_t head_stride;
} fack_row_stats;

/* One attention call: what the forward needs, and what the backward shares with it. */
typedef struct fack_attention {
    int32_t dtype;          /* fack_dtype */
    int32_t group_mode;     /* 1: varlen, seqstart_q/k given */
    int64_t batch;
    int64_t seqlen_q;       /* group mode: total_q */
    int64_t seqlen_k;       /* group mode: total_k */
    int64_t max_seqlen_q;
    int64_t max_seqlen_k;
    int64_t nhead_q;
    int64_t nhead_k;
    int64_t head_dim_q;     /* q's and k's, padded to a multiple of 8 (CK's hdim_q) */
    int64_t head_dim_v;     /* v's, out's, dout's and dv's, padded to a multiple of 8 (CK's hdim_v) */
    const int32_t* seqstart_q;
    const int32_t* seqstart_k;
    fack_tensor q;
    fack_tensor k;
    fack_tensor v;
    fack_tensor out;
    fack_row_stats lse;
    float softmax_scale;
    int32_t mask_type;      /* fack_mask_type */
    int64_t window_left;    /* -1: unbounded */
    int64_t window_right;
    const float* alibi_slopes;      /* NULL: no ALiBi; fp32 (h,) or (b, h) */
    int64_t alibi_batch_stride;     /* 0 for (h,) slopes */
    float p_drop;                   /* probability of dropping; 0: no dropout */
    const int64_t* drop_seed;       /* device pointers into rng_state = [seed, offset] */
    const int64_t* drop_offset;
} fack_attention;

typedef struct fack_bwd_args {
    fack_attention attn;
    fack_tensor dout;
    fack_tensor dq;
    fack_tensor dk;                 /* MQA/GQA: the per-query-head dk_expanded (b, s_k, h, d) */
    fack_tensor dv;                 /* MQA/GQA: dv_expanded (b, s_k, h, d_v) */
    fack_row_stats d;               /* same strides as lse */
    fack_tensor dq_acc;             /* fp32 (splits, b, s_q, h, d), zero-initialised */
    int64_t dq_acc_split_stride;
    float p_undrop;                 /* 1 - p_drop */
    int32_t deterministic;
} fack_bwd_args;

/* Launch on `stream` (a hipStream_t; NULL is the default stream). Return a fack_status. */
int fack_fwd(const fack_attention* args, void* stream);
int fack_bwd(const fack_bwd_args* args, void* stream);

/* The key-tile rows (kN0, CK's bn0) of the dq_dk_dv instance that fack_bwd would run for `args` on
 * a device of `gfx_arch` (e.g. "gfx942"), into *kn0: deterministic mode needs ceil(s_k / kN0)
 * dq_acc splits. Only sizes, dtype and features of `args` are read (no pointer is dereferenced).
 * Generated from the same instance list and dispatch conditions as fack_bwd's kernels
 * (scripts/ck_generate.py). FACK_NO_INSTANCE when no instance matches. */
int fack_bwd_tile(const fack_bwd_args* args, const char* gfx_arch, int32_t* kn0);

/* The head-dim buckets of the compiled instances, as "hdim_qxhdim_v" pairs separated by ',' (e.g.
 * "128x128,192x128,256x256"): a call with padded head dims (d, d_v) has an instance only where some bucket has
 * d <= hdim_q and d_v <= hdim_v (CK's dispatch condition). Generated from the same instance list as the
 * kernels (scripts/ck_generate.py); other traits (dtype, mode, mask, ...) still decide at launch. */
const char* fack_fwd_head_dims(void);
const char* fack_bwd_head_dims(void);

/* The message of the last failure on this thread ("" after a success). */
const char* fack_last_error(void);
/* The hipError_t of the last FACK_HIP_ERROR on this thread (0 otherwise). */
int fack_last_hip_error(void);

int fack_abi_version(void);
/* sizeof of the two argument structs as compiled into the library. */
int64_t fack_attention_size(void);
int64_t fack_bwd_args_size(void);
/* The GPU targets the kernels were compiled for, separated by ',' (e.g. "gfx942,gfx950"). */
const char* fack_gpu_targets(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASH_ATTN_CK_H */
