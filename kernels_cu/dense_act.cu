// dense_act.cu: the element-wise steps of the fused MLP (cuflash.ops.fused_dense's
// fused_mlp_func, flash-attn's FusedMLP) that the GEMMs' cuBLASLt epilogues do not cover:
//
//   forward   out  = act(pre)                          pre = x W1ᵀ + b1, fc1's output, kept for
//                                                      the backward (save_pre_act)
//   backward  dpre = grad · act'(pre)                  grad = dout W2, fc2's input gradient
//             dbias = Σ_rows dpre                      fc1's bias gradient, in the same pass
//
// act (kAct): 0 gelu_approx  0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))   (F.gelu(approximate='tanh'))
//             1 relu         max(x, 0)                  act' = 1 where x > 0 (torch's)
//             2 sqrelu       relu(x)²                   act' = 2 relu(x)
// fp32 arithmetic, one rounding of out / dpre to Elem; dbias sums the unrounded fp32 dpre.
//
// Work split (both kernels): a CTA of kDaThreads threads covers 8 · kDaThreads columns (a
// thread 8 neighbouring columns: 16-byte accesses when kVector) over one row split, gridDim.y =
// splits, rows [split · rows_per_split, ...). A thread walks its split's rows kDaRows at a time,
// all their loads issued before any arithmetic, so each thread keeps kDaRows · 32 bytes in flight.
// The backward's thread keeps its 8 columns' dbias sums in registers across the split and writes
// them to partials[split] at the end; dense_act_bwd_finish adds the splits per column in a fixed
// order (no atomics: the same dbias every run).
//
// dpre may alias grad (the host writes it in place into the GEMM's temporary): every element is
// read and then written by the same thread, and grad is read with plain loads (pre with
// ld.global.nc, an input no thread writes).
//
// Template parameters:
//   Elem     bf16 or fp16: pre, out, grad, dpre, dbias
//   kAct     0, 1, 2 (above)
//   kVector  16-byte accesses of whole 8-column chunks (the host takes it when n % 8 == 0 and
//            every pointer is 16-byte aligned); else one element at a time with a bounds check
//   kBias    backward: sum dbias (else no partials are written)
#include "ptx.cuh"
#include "tile.cuh"
#include "params_dense_act.cuh"

namespace cuflash {

constexpr int kDaThreads = 128;        // threads per CTA: 1024 columns
constexpr int kDaRows = 4;             // rows per step of a thread (loads in flight)
constexpr int kDaFinishThreads = 256;  // dense_act_bwd_finish: a thread per column

constexpr int kActGeluApprox = 0;
constexpr int kActRelu = 1;
constexpr int kActSqrelu = 2;

// act(x) and act'(x) in fp32. tanhf, not tanh.approx: the approximate tanh's error (about 2^-11
// relative) would show in fp16's gradients.
template <int kAct>
struct Activation {
    static_assert(kAct == kActGeluApprox || kAct == kActRelu || kAct == kActSqrelu, "kAct: 0, 1 or 2");
    static constexpr float kSqrt2OverPi = 0.7978845608028654f;
    static constexpr float kCubic = 0.044715f;

    static __device__ __forceinline__ float fwd(float x) {
        if (kAct == kActGeluApprox) {
            const float t = tanhf(kSqrt2OverPi * (x + kCubic * x * x * x));
            return 0.5f * x * (1.f + t);
        }
        const float r = fmaxf(x, 0.f);
        return kAct == kActRelu ? r : r * r;
    }
    static __device__ __forceinline__ float grad(float x) {
        if (kAct == kActGeluApprox) {
            const float t = tanhf(kSqrt2OverPi * (x + kCubic * x * x * x));
            return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kCubic * x * x);
        }
        if (kAct == kActRelu) return x > 0.f ? 1.f : 0.f;
        return 2.f * fmaxf(x, 0.f);
    }
};

// 8 neighbouring 16-bit elements <-> 8 fp32 values: one 16-byte access (kVector) or eight
// bounds-checked ones (columns >= n load as 0 and are not stored). kNc: ld.global.nc, for
// tensors no thread of the kernel writes.
template <class Elem, bool kVector, bool kNc>
__device__ __forceinline__ void da_load8(const void* base, i64 i, int col, int n, float (&v)[8]) {
    const u16* p = static_cast<const u16*>(base) + i;
    if (kVector) {
        if (col < n) {
            const uint4 w = kNc ? __ldg(reinterpret_cast<const uint4*>(p)) : *reinterpret_cast<const uint4*>(p);
            const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[2 * k] = to_float<Elem>(static_cast<u16>(words[k] & 0xffffu));
                v[2 * k + 1] = to_float<Elem>(static_cast<u16>(words[k] >> 16));
            }
            return;
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = 0.f;
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = col + k < n ? to_float<Elem>(p[k]) : 0.f;
    }
}
template <class Elem, bool kVector>
__device__ __forceinline__ void da_store8(void* base, i64 i, int col, int n, const float (&v)[8]) {
    u16* p = static_cast<u16*>(base) + i;
    if (kVector) {
        if (col < n)
            *reinterpret_cast<u32x4*>(p) = u32x4{pack2<Elem>(v[0], v[1]), pack2<Elem>(v[2], v[3]),
                                                 pack2<Elem>(v[4], v[5]), pack2<Elem>(v[6], v[7])};
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k)
            if (col + k < n) p[k] = static_cast<u16>(pack2<Elem>(v[k], 0.f) & 0xffffu);
    }
}

// The rows [row_begin, row_end) of this CTA's split.
__device__ __forceinline__ void da_split_rows(const DenseActParams& p, int& row_begin, int& row_end) {
    row_begin = blockIdx.y * p.rows_per_split;
    row_end = min(p.rows, row_begin + p.rows_per_split);
}

// out = act(pre).
template <class Elem, int kAct, bool kVector>
__global__ void __launch_bounds__(kDaThreads) dense_act_fwd(const DenseActParams p) {
    const int col = (blockIdx.x * kDaThreads + threadIdx.x) * 8;
    if (col >= p.n) return;
    int row_begin, row_end;
    da_split_rows(p, row_begin, row_end);
    for (int r0 = row_begin; r0 < row_end; r0 += kDaRows) {
        float v[kDaRows][8];
#pragma unroll
        for (int j = 0; j < kDaRows; ++j)
            if (r0 + j < row_end) da_load8<Elem, kVector, true>(p.pre, i64(r0 + j) * p.n + col, col, p.n, v[j]);
#pragma unroll
        for (int j = 0; j < kDaRows; ++j) {
            if (r0 + j >= row_end) break;
#pragma unroll
            for (int k = 0; k < 8; ++k) v[j][k] = Activation<kAct>::fwd(v[j][k]);
            da_store8<Elem, kVector>(p.out, i64(r0 + j) * p.n + col, col, p.n, v[j]);
        }
    }
}

// dpre = grad · act'(pre); partials[split] = Σ_split's rows dpre (kBias).
template <class Elem, int kAct, bool kVector, bool kBias>
__global__ void __launch_bounds__(kDaThreads) dense_act_bwd(const DenseActParams p) {
    const int col = (blockIdx.x * kDaThreads + threadIdx.x) * 8;
    if (col >= p.n) return;
    int row_begin, row_end;
    da_split_rows(p, row_begin, row_end);
    float dbias[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int r0 = row_begin; r0 < row_end; r0 += kDaRows) {
        float g[kDaRows][8], x[kDaRows][8];
#pragma unroll
        for (int j = 0; j < kDaRows; ++j) {
            if (r0 + j < row_end) {
                const i64 i = i64(r0 + j) * p.n + col;
                da_load8<Elem, kVector, false>(p.grad, i, col, p.n, g[j]);   // may alias dpre
                da_load8<Elem, kVector, true>(p.pre, i, col, p.n, x[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < kDaRows; ++j) {
            if (r0 + j >= row_end) break;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                g[j][k] *= Activation<kAct>::grad(x[j][k]);
                if (kBias) dbias[k] += g[j][k];
            }
            da_store8<Elem, kVector>(p.dpre, i64(r0 + j) * p.n + col, col, p.n, g[j]);
        }
    }
    if (kBias) {
        float* part = p.partials + i64(blockIdx.y) * p.n + col;
#pragma unroll
        for (int k = 0; k < 8; ++k)
            if (col + k < p.n) part[k] = dbias[k];
    }
}

// dbias[c] = Σ_splits partials[split][c], rounded once to Elem; a thread per column, the splits
// in order.
template <class Elem>
__global__ void __launch_bounds__(kDaFinishThreads) dense_act_bwd_finish(const DenseActParams p) {
    const int col = blockIdx.x * kDaFinishThreads + threadIdx.x;
    if (col >= p.n) return;
    float sum = 0.f;
    for (int s = 0; s < p.splits; ++s) sum += p.partials[i64(s) * p.n + col];
    static_cast<u16*>(p.dbias)[col] = static_cast<u16>(pack2<Elem>(sum, 0.f) & 0xffffu);
}

}  // namespace cuflash
