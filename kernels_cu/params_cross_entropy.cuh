// params_cross_entropy.cuh: the argument struct of the cross-entropy kernels (cross_entropy.cu).
// A separate file so that no attention family's code hash changes; cuflash/launch.py
// (struct_dtype) reads the fields from here.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Layouts (elements; the vocab columns of logits and dlogits are contiguous):
//   logits    : (rows, n_cols), row stride logits_row_stride; this rank's vocab slice
//   labels    : (rows,) int64 (labels_i64) or int32, global class ids (or ignore_index)
//   loss, z_loss, lse, part : (rows,) fp32, forward outputs (lse: the backward's input)
//   partials  : (rows, splits, 3) fp32 forward workspace, one (m, s, zsum) per split (splits > 1)
//   grad_loss : (rows,) fp32, element stride grad_loss_stride (0: one value for every row)
//   dlogits   : (rows, n_cols), row stride dlogits_row_stride; may be logits itself (in place)
// The pointers come first: cuflash/cross_entropy.py writes them per call.
struct CrossEntropyParams {
    const void* logits;
    const void* labels;
    float* loss;
    float* z_loss;
    float* lse;
    float* part;
    float* partials;
    const float* grad_loss;
    void* dlogits;
    i64 grad_loss_stride;
    i64 logits_row_stride;
    i64 dlogits_row_stride;
    i64 ignore_index;
    i64 class_start;          // this rank's first class (rank · n_cols with a process group)
    int rows;
    int n_cols;
    int splits;               // CTAs per row
    int split_cols;           // columns per split (a multiple of 16), the last split takes the rest
    int labels_i64;
    float logit_scale;        // > 0
    float scale_log2;         // logit_scale · log2(e)
    float smoothing;          // label_smoothing s
    float smooth_per_class;   // s / C, C = the classes over all ranks
    float lse_square_scale;
};

}  // namespace cuflash
