// params.cuh: the plain argument structs that the host fills and the kernels read.
//
// The Python side reads the field list of each struct straight from this file
// (cuflash/params.py) to build a matching NumPy record, so a field added here reaches the
// host with no second definition. Keep to these field types: pointers (`const void*`,
// `void*`, `float*`), `i64`, `int`, `float`; one field per line.
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
};

}  // namespace cuflash
