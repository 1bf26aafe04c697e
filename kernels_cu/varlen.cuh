// varlen.cuh: where one sequence of a batch lies, so that a kernel built for variable-length
// batches (kVarlen) runs the fixed-length code on it unchanged.
//
// A fixed-length batch is (batch, seqlen, heads, head_dim): sequence b starts at batch index b
// and has seqlen_q queries, seqlen_k keys. A variable-length batch packs the sequences without
// padding, (total, heads, head_dim), sequence b being rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1
// (params.cuh). The grid is sized for the longest sequence (max_seqlen); a CTA reads its
// sequence's bounds first and leaves when its block lies past the sequence's end, so no
// padding is computed. Every mask is then per sequence (causal bottom-right per sequence,
// seqlen_q != seqlen_k, empty sequences), because the kernels build their mask from the
// SeqSpan's lengths.
//
// kVarlen = false reads nothing and yields constants (start 0, the params' lengths): the
// fixed-length instantiations compile to the code they had before this header.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Rows of the backward's fp32 workspace reserved per sequence beyond its length: a Q block
// of up to 128 rows (every Br) read past a sequence's end stays inside that sequence's rows,
// and the first row of each sequence can be rounded down to a multiple of 8 (32-byte aligned
// LSE_i, D_i chunks) without overlapping the previous one: 128 + 8 is enough
// (cuflash/families/fa2_bwd.py VARLEN_ROW_PAD mirrors it).
constexpr int kVarlenRowPad = 136;

struct SeqSpan {
    int q_start;   // first row of the sequence in q, o (and dout, dq): 0 for fixed-length batches
    int k_start;   // first row in k, v (dk, dv)
    int seqlen_q;  // its queries
    int seqlen_k;  // its keys
};

// (q_start, k_start, seqlen_q, seqlen_k) of sequence `batch`; Params: FwdParams or BwdParams.
template <bool kVarlen, class Params>
__device__ __forceinline__ SeqSpan seq_span(const Params& p, int batch) {
    if constexpr (kVarlen) {
        const int q0 = p.cu_seqlens_q[batch], k0 = p.cu_seqlens_k[batch];
        return {q0, k0, p.cu_seqlens_q[batch + 1] - q0, p.cu_seqlens_k[batch + 1] - k0};
    } else {
        return {0, 0, p.seqlen_q, p.seqlen_k};
    }
}

// Offset of the LSE of (batch, head)'s first query: (batch, nheads, seqlen_q) for fixed
// lengths, (nheads, total_q) for variable ones (flash-attn's varlen layout).
template <bool kVarlen, class Params>
__device__ __forceinline__ i64 lse_offset(const Params& p, int batch, int head, const SeqSpan& seq) {
    if constexpr (kVarlen)
        return static_cast<i64>(head) * p.total_q + seq.q_start;
    else
        return (static_cast<i64>(batch) * p.nheads + head) * p.seqlen_q;
}

// First row of (batch, head) in the backward's fp32 workspace (lse_log2, D, and dq_accum in
// units of head_dim_rounded floats): (batch, nheads, seqlen_q_rounded) for fixed lengths;
// (nheads, ws_rows) indexed by tokens for variable ones, sequence b from
// cu_seqlens_q[b] + kVarlenRowPad·b (rounded down to 8) on.
template <bool kVarlen, class Params>
__device__ __forceinline__ i64 ws_row_offset(const Params& p, int batch, int head, const SeqSpan& seq) {
    if constexpr (kVarlen)
        return static_cast<i64>(head) * p.ws_rows + ((seq.q_start + kVarlenRowPad * batch) & ~7);
    else
        return (static_cast<i64>(batch) * p.nheads + head) * p.seqlen_q_rounded;
}

// First row of (batch, head)'s fp32 dK / dV accumulators (GQA / MQA): (batch, nheads, seqlen_k)
// for fixed lengths, (nheads, total_k) for variable ones.
template <bool kVarlen, class Params>
__device__ __forceinline__ i64 dkv_row_offset(const Params& p, int batch, int head, const SeqSpan& seq) {
    if constexpr (kVarlen)
        return static_cast<i64>(head) * p.total_k + seq.k_start;
    else
        return (static_cast<i64>(batch) * p.nheads + head) * p.seqlen_k;
}

}  // namespace cuflash
