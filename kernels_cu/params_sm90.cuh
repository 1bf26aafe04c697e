// params_sm90.cuh: the argument structs of the Hopper (sm_90a) families, same rules as
// params.cuh (cuflash/launch.py mirrors both files: one field per line, the field types of
// params.cuh) plus one more field type, `TmaDesc`: a TMA tensor map (CUtensorMap), 128 bytes,
// 64-byte aligned, built on the host by cuTensorMapEncodeTiled and written into the packed
// params per call (it embeds the tensor's global address). The struct is passed as a
// `const __grid_constant__` kernel parameter, so the kernel hands TMA the address of the map
// in parameter space, with no copy to global memory.
//
// A separate file from params.cuh so that the sm_80 families' rendered source (and with it
// their code hash, which stamps the tuned tables) does not change when a Hopper struct does.
#pragma once
#include "ptx.cuh"
#include "params.cuh"

namespace cuflash {

// A CUtensorMap, opaque to the kernel: 128 bytes, 64-byte aligned as TMA requires.
struct alignas(64) TmaDesc {
    u64 opaque[16];
};

// Forward attention on sm_90a (sm90_fwd). Layouts as FwdParams (elements; last dimension
// contiguous):
//   q, o : (batch, seqlen_q, nheads,    head_dim)
//   k, v : (batch, seqlen_k, nheads_kv, head_dim)
//   lse  : (batch, nheads, seqlen_q), fp32, contiguous, natural log
// q, k, v are read only through their tensor maps (rank 4, innermost first: head_dim, seqlen,
// heads, batch; box 64 columns x BM or BN rows, 128-byte swizzle, out-of-bounds zero fill).
// Their pointers stay because every params struct starts with its per-call pointers: the launch
// plan writes them, and the family's call_writer encodes the maps from them.
struct Sm90FwdParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    TmaDesc tma_q;         // box 64 x BM
    TmaDesc tma_k;         // box 64 x BN
    TmaDesc tma_v;         // box 64 x BN
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    int batch;
    int nheads;
    int nheads_kv;
    int seqlen_q;
    int seqlen_k;
    int head_dim;          // the real head dim (a multiple of 8, <= the kernel's kHeadDim)
    float softmax_scale;   // natural-log scale, for the LSE
    float scale_log2;      // softmax_scale * log2(e), computed on the host
};

// Backward attention on sm_90a (sm90_bwd). BwdParams (params.cuh) field for field as an exact
// prefix: the family reuses fa2_bwd's preprocess, dQ convert and GQA reduction kernels, which
// take `const BwdParams` and so read only this prefix of the same packed buffer
// (sm90_bwd.cu static_asserts the offsets; tests/test_sm90_bwd_cpu.py checks the mirror).
// Then the TMA maps of the main kernel (rank 4, innermost first: head_dim, seqlen, heads, batch;
// box 64 columns x BM or BN rows, 128-byte swizzle, out-of-bounds zero fill): q, dO (the
// preprocess's dout_copy when that piece exists) with BM-row boxes, k, v with BN-row boxes.
struct Sm90BwdParams {
    const void* dout;
    const void* q;
    const void* k;
    const void* v;
    const void* o;
    const float* lse;
    void* dq;
    void* dk;
    void* dv;
    float* lse_log2;
    float* D;
    float* dq_accum;
    float* dk_accum;
    float* dv_accum;
    int* dq_semaphore;
    void* dout_copy;        // workspace: dO made contiguous by the preprocess (null: read dout)
    i64 q_batch_stride;
    i64 q_row_stride;
    i64 q_head_stride;
    i64 k_batch_stride;
    i64 k_row_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    i64 v_row_stride;
    i64 v_head_stride;
    i64 o_batch_stride;
    i64 o_row_stride;
    i64 o_head_stride;
    i64 do_batch_stride;
    i64 do_row_stride;
    i64 do_head_stride;
    i64 do_src_batch_stride;  // dout as the caller passed it (any strides, the head dim's too):
    i64 do_src_row_stride;    // what the preprocess reads; do_* above are what the main
    i64 do_src_head_stride;   // kernel reads (dout itself, or dout_copy)
    i64 do_src_col_stride;
    i64 dq_batch_stride;
    i64 dq_row_stride;
    i64 dq_head_stride;
    i64 dk_batch_stride;
    i64 dk_row_stride;
    i64 dk_head_stride;
    i64 dv_batch_stride;
    i64 dv_row_stride;
    i64 dv_head_stride;
    int batch;
    int nheads;
    int nheads_kv;
    int seqlen_q;
    int seqlen_k;
    int seqlen_q_rounded;
    int head_dim;
    int head_dim_rounded;
    int head_group;        // fa2_bwd launch order: K/V blocks of head_group (batch, head) pairs interleaved
    float softmax_scale;
    float scale_log2;
    TmaDesc tma_q;         // box 64 x BM
    TmaDesc tma_k;         // box 64 x BN
    TmaDesc tma_v;         // box 64 x BN
    TmaDesc tma_do;        // box 64 x BM
};

}  // namespace cuflash
