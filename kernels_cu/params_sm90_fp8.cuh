// params_sm90_fp8.cuh: the argument struct of the FP8 Hopper forward (sm90_fwd_fp8), same rules
// as params_sm90.cuh (cuflash/launch.py mirrors it). A file of its own so that sm90_fwd's rendered
// source, and with it the code hash that stamps its tuned tables, does not change.
#pragma once
#include "params_sm90.cuh"

namespace cuflash {

// FP8 (e4m3) forward on sm_90a (sm90_fwd_fp8). q, k, o, lse as Sm90FwdParams (q, k e4m3, one
// byte per element; o bf16); v is the caller's V, which the kernel does not read: it reads
// vt, a transposed copy Vᵀ that the host writes (cuflash/fp8.py): (batch, nheads_kv, head_dim, seqlen_k_pad),
// keys contiguous and reordered inside each group of 16 (the P fragment order, the family's
// module says why), seqlen_k_pad = seqlen_k rounded up to 16, padding zeros.
// q_descale, k_descale, v_descale: fp32, (batch, nheads_kv), contiguous (the host expands a
// per-tensor factor): the real tensors are descale · the stored e4m3 values. The three and vt
// are pieces of the launch's workspace, filled by the host before the launch; v (the
// caller's V) is not read by the kernel.
struct Sm90FwdFp8Params {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    const float* q_descale;
    const float* k_descale;
    const float* v_descale;
    const void* vt;        // Vᵀ (read through tma_v only; the host encodes the map from it)
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
};

}  // namespace cuflash
