// params_dense_act.cuh: the argument struct of the MLP activation kernels (dense_act.cu). A
// separate file so that no attention family's code hash changes; cuflash/launch.py
// (struct_dtype) reads the fields from here.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Layouts: every matrix is (rows, n) with contiguous rows (row stride n elements), n = fc1's
// output features (the MLP's hidden size on this rank).
//   pre       : Elem, fc1's output x W1ᵀ + b1 (the pre-activation)
//   out       : Elem, act(pre) (forward)
//   grad      : Elem, dL/d act(pre), fc2's input gradient dout W2 (backward)
//   dpre      : Elem, grad · act'(pre) (backward; may be grad itself: written in place)
//   partials  : (splits, n) fp32 backward workspace: Σ dpre over each row split
//   dbias     : (n,) W, Σ_rows dpre (fc1's bias gradient); null: no bias gradient
// The pointers come first: cuflash/dense_act.py writes them per call.
struct DenseActParams {
    const void* pre;
    void* out;
    const void* grad;
    void* dpre;
    float* partials;
    void* dbias;
    int rows;
    int n;
    int splits;               // gridDim.y: row splits, each a row of partials
    int rows_per_split;
};

}  // namespace cuflash
