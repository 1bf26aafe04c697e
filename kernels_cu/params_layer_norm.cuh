// params_layer_norm.cuh: the argument struct of the fused RMSNorm / LayerNorm kernels
// (layer_norm.cu). A separate file so that no attention family's code hash changes;
// cuflash/launch.py (struct_dtype) reads the fields from here.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Layouts: every row tensor is (rows, n) with contiguous rows (row stride n elements).
//   x, y, dy, dx            : Elem (x's dtype; y and dx too)
//   residual, residual_out,
//   dresidual_out, dresidual: Res (the residual's dtype, else fp32 / x's dtype)
//   weight, bias, dweight, dbias : W, (n,)
//   mean, rstd              : (rows,) fp32 (mean unused by RMSNorm)
//   partials                : (splits, 2, n) fp32 backward workspace: per row split (or CTA) Σ dy·x̂, Σ dy
// The pointers come first: cuflash/layer_norm.py writes them per call; a null pointer is an
// absent tensor.
struct LayerNormParams {
    const void* x;
    const void* residual;
    const void* weight;
    const void* bias;
    void* y;
    void* residual_out;
    float* mean;
    float* rstd;
    const void* dy;
    const void* dresidual_out;
    void* dx;
    void* dresidual;
    float* partials;
    void* dweight;
    void* dbias;
    int rows;
    int n;
    int is_rms;               // 1: RMSNorm (no mean), 0: LayerNorm
    int h_from_res;           // backward: h is residual_out (fp32), else x [+ residual]
    int splits;               // backward partials rows: gridDim.y of layer_norm_bwd_dw, gridDim.x of layer_norm_bwd
    int rows_per_split;
    float eps;
    float w_offset;           // 1 under zero_centered_weight (w = weight + 1), else 0
};

}  // namespace cuflash
