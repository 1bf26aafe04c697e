// params_rotary.cuh: the argument struct of the rotary embedding kernel (rotary.cu). A separate
// file so that no attention family's code hash changes; cuflash/launch.py (struct_dtype) reads
// the fields from here.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Layouts (elements; the head dim of x and out is contiguous):
//   x, out          : (batch, seqlen, nheads, headdim), or with cu_seqlens (total, nheads, headdim)
//                     (the batch strides are then unused); out may be x itself (in place)
//   cos, sin        : (seqlen_ro, rotary_dim / 2), row stride trig_row_stride, columns contiguous
//   cu_seqlens      : int32 (batch + 1), sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1
//                     of the packed x; null: fixed-length batches of seqlen rows
//   seqlen_offsets  : int32 or int64 (offsets_i64) (batch,), the position of each sequence's first
//                     token; null: seqlen_offset for every sequence
struct RotaryParams {
    const void* x;
    void* out;
    const void* cos;
    const void* sin;
    int* cu_seqlens;
    const void* seqlen_offsets;
    i64 x_batch_stride;
    i64 x_row_stride;
    i64 x_head_stride;
    i64 out_batch_stride;
    i64 out_row_stride;
    i64 out_head_stride;
    i64 trig_row_stride;
    int seqlen;              // rows per sequence (varlen: the grid's max_seqlen; longer ones are covered too)
    int nheads;
    int headdim;
    int rotary_dim;          // even, <= headdim; columns from rotary_dim on pass through
    int seqlen_ro;           // rows of cos / sin; a position at or past it is not rotated
    int seqlen_offset;
    int offsets_i64;
    int copy_tail;           // out != x: copy the columns rotary_dim .. headdim - 1
    int row_lanes_log2;      // log2 of the lanes that share a row (0 .. 5)
    float sin_sign;          // 1, or -1 for the inverse rotation (the backward: R(-θ) = R(θ)ᵀ)
};

}  // namespace cuflash
