// params_sm90_fp8.cuh: the argument struct of the FP8 Hopper forward (sm90_fwd_fp8), same rules
// as params_sm90.cuh (cuflash/launch.py mirrors it). A file of its own so that sm90_fwd's rendered
// source, and with it the code hash that stamps its tuned tables, does not change.
#pragma once
#include "params_sm90.cuh"

namespace cuflash {

// FP8 (e4m3) forward on sm_90a (sm90_fwd_fp8). q, k, o, lse as Sm90FwdParams (q, k e4m3, one
// byte per element; o bf16); v is the caller's V (batch, seqlen_k, nheads_kv, head_dim; any
// byte strides v_*_stride), which only the prepare kernel reads: the main kernel reads vt, a
// transposed copy Vᵀ: (batch, nheads_kv, head_dim, vt_keys), keys contiguous and reordered
// inside each group of 16 (the P fragment order, the family's module says why), vt_keys =
// seqlen_k rounded up to 16, padding zeros.
// q_descale, k_descale, v_descale: fp32, (batch, nheads_kv), contiguous: the real tensors are
// descale · the stored e4m3 values. The three and vt are pieces of the launch's workspace,
// written by the prepare kernel (role "prepare", launched first) and read by the main kernel;
// the prepare kernel expands the caller's descales (*_descale_in: null = 1, else per tensor or,
// where bit 0 / 1 / 2 of descale_per_head is set, (batch, nheads_kv) contiguous) into them.
struct Sm90FwdFp8Params {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    float* q_descale;
    float* k_descale;
    float* v_descale;
    void* vt;              // Vᵀ (main kernel: read through tma_v only; the host encodes the map from it)
    TmaDesc tma_q;         // box 128 x BM (128 bytes: the 128B swizzle span)
    TmaDesc tma_k;         // box 128 x BN
    TmaDesc tma_v;         // Vᵀ: box BN keys x kHeadDim rows
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    int batch;
    int nheads;
    int nheads_kv;
    int seqlen_q;
    int seqlen_k;
    int head_dim;
    float softmax_scale;   // natural-log scale, for the LSE (times q_descale · k_descale in the kernel)
    float scale_log2;      // softmax_scale * log2(e) (times q_descale · k_descale in the kernel)
    // the prepare kernel's (appended: the main kernel's fields above keep their offsets)
    i64 v_batch_stride;    // V's strides in bytes (= elements)
    i64 v_row_stride;
    i64 v_head_stride;
    i64 v_col_stride;
    const float* q_descale_in;   // the caller's descales, per call; null = 1
    const float* k_descale_in;
    const float* v_descale_in;
    int vt_keys;           // seqlen_k rounded up to 16: Vᵀ's row length
    int descale_per_head;  // bit 0 / 1 / 2: q / k / v descale_in is (batch, nheads_kv), else one value
};

}  // namespace cuflash
