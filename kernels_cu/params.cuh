// params.cuh: the plain argument structs that the host fills and the kernels read.
//
// The Python side reads the field list of each struct straight from this file
// (cuflash/launch.py, struct_dtype) to build a matching NumPy record, so a field added here
// reaches the host with no second definition. Keep to these field types: pointers
// (`const void*`, `void*`, `const float*`, `float*`, `int*`), `i64`, `int`, `float`; one
// field per line.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Forward attention. Layouts (elements; the last dimension is contiguous):
//   q, o : (batch, seqlen_q, nheads,    head_dim)
//   k, v : (batch, seqlen_k, nheads_kv, head_dim)
//   lse  : (batch, nheads, seqlen_q), fp32, contiguous, natural log
struct FwdParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
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
    int batch;
    int nheads;
    int nheads_kv;
    int seqlen_q;
    int seqlen_k;
    int head_dim;          // the real head dim (a multiple of 8, <= the kernel's kHeadDim)
    float softmax_scale;   // natural-log scale, for the LSE
    float scale_log2;      // softmax_scale * log2(e): scores go through exp2, computed on the host
    // Variable-length batches (kernels built with kVarlen; varlen.cuh): q, o are
    // (total_q, nheads, head_dim) and k, v (total_k, nheads_kv, head_dim), batch strides 0;
    // sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (k: cu_seqlens_k);
    // seqlen_q / seqlen_k are the longest sequences (max_seqlen_q/k, the grid's extent);
    // lse is (nheads, total_q). Null and 0 in fixed-length launches.
    int* cu_seqlens_q;     // (batch + 1) int32 offsets
    int* cu_seqlens_k;     // (batch + 1) int32 offsets
    int total_q;
    const void* rng_state;   // dropout (kDropout): int64[2] (seed, offset) in device memory; else null
    int dropout_threshold;   // dropout: drop iff the element's Philox byte < round(p·256) (philox.cuh)
    float dropout_scale;     // dropout: 1 / (1 - p), applied to the kept elements
    // features (appended; unused by a kernel built without them):
    int window_left;       // kWindow: keys before the diagonal a query sees, -1 unbounded
    int window_right;      // kWindow: keys after the diagonal, -1 unbounded
    float softcap_in;      // kSoftcap: scale / softcap (score.cuh)
    float softcap_out;     // kSoftcap: softcap / scale
    const float* alibi_slopes;  // kAlibi: fp32 (nheads) or (batch, nheads); written per call
    i64 alibi_batch_stride;     // kAlibi: 0 for (nheads), nheads for (batch, nheads)
};

// Backward attention (three kernels share it: preprocess, main, and the dQ / dK dV epilogues).
// Inputs, layouts as in FwdParams (elements; last dimension contiguous):
//   dout, q, o, dq : (batch, seqlen_q, nheads,    head_dim)
//   k, v, dk, dv   : (batch, seqlen_k, nheads_kv, head_dim)
//   lse            : (batch, nheads, seqlen_q), fp32, natural log (the forward's output)
// fp32 workspace, contiguous, rows padded to seqlen_q_rounded (a multiple of every Br) and
// columns to head_dim_rounded (the kernel's compile-time head dim):
//   lse_log2, D    : (batch, nheads, seqlen_q_rounded)   LSE·log2(e) (+inf on padding), D = rowsum(dO∘O)
//   dq_accum       : (batch, nheads, seqlen_q_rounded, head_dim_rounded), unscaled dQ sums
//   dk_accum, dv_accum : (batch, nheads, seqlen_k, head_dim_rounded), per query head; GQA only
//   dq_semaphore   : (batch, nheads, seqlen_q_rounded / 16) ints; deterministic mode only
struct BwdParams {
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
    // features (appended; unused by a kernel built without them):
    int window_left;       // kWindow: keys before the diagonal a query sees, -1 unbounded
    int window_right;      // kWindow: keys after the diagonal, -1 unbounded
    float softcap_in;      // kSoftcap: scale / softcap (score.cuh)
    float softcap_out;     // kSoftcap: softcap / scale
    const float* alibi_slopes;  // kAlibi: fp32 (nheads) or (batch, nheads); written per call
    i64 alibi_batch_stride;     // kAlibi: 0 for (nheads), nheads for (batch, nheads)
};

}  // namespace cuflash
