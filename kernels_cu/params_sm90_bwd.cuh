// params_sm90_bwd.cuh: the argument struct of the Hopper backward family (sm90_bwd), same rules
// as params.cuh and params_sm90.cuh (cuflash/launch.py mirrors it). A file of its own so that
// sm90_fwd's rendered source, and with it the code hash that stamps its tuned table entries,
// does not change when this struct does.
#pragma once
#include "ptx.cuh"
#include "params.cuh"
#include "params_sm90.cuh"

namespace cuflash {

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
    // Variable-length batches (kernels built with kVarlen; varlen.cuh): the layouts of FwdParams
    // (q, o, dout, dq: (total_q, nheads, ·); k, v, dk, dv: (total_k, nheads_kv, ·); lse
    // (nheads, total_q)); seqlen_q / seqlen_k are the longest sequences and seqlen_q_rounded
    // rounds seqlen_q (the dQ turn counters keep their (batch, nheads, ·) layout). The fp32
    // workspace is indexed by tokens instead: lse_log2, D (nheads, ws_rows), dq_accum
    // (nheads, ws_rows, head_dim_rounded), sequence b from row varlen_ws_row0 (varlen.cuh) on;
    // dk_accum, dv_accum (nheads, total_k, head_dim_rounded). Null and 0 in fixed-length launches.
    int* cu_seqlens_q;
    int* cu_seqlens_k;
    int total_q;
    int total_k;
    int ws_rows;           // workspace rows per head: total_q + kVarlenRowPad·batch, rounded up to 8
    const void* rng_state;   // dropout (kDropout): int64[2] (seed, offset), the forward's; else null
    int dropout_threshold;   // dropout: as FwdParams
    float dropout_scale;     // dropout: 1 / (1 - p)
    // features (as BwdParams; unused: sm90_bwd refuses every feature)
    int window_left;
    int window_right;
    float softcap_in;
    float softcap_out;
    const float* alibi_slopes;
    i64 alibi_batch_stride;
    TmaDesc tma_q;         // box 64 x BM
    TmaDesc tma_k;         // box 64 x BN
    TmaDesc tma_v;         // box 64 x BN
    TmaDesc tma_do;        // box 64 x BM
};

}  // namespace cuflash
