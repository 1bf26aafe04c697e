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
// fp32 arithmetic (tanh through ex2.approx: tanh_fast), one rounding of out / dpre to Elem; dbias
// sums the unrounded fp32 dpre.
//
// Work split (both kernels): a CTA of kDaThreads threads covers 8 · kDaThreads columns (a
// thread 8 neighbouring columns: 16-byte accesses when kVector) over one row split, gridDim.y =
// splits, rows [split · rows_per_split, ...). A thread walks its split's rows kDaRows at a time,
// all their loads issued before any arithmetic (kept packed: 4 registers per 8 elements), so each
// thread keeps kDaRows · 16 bytes per input in flight with kDaMinBlocks CTAs resident per SM.
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
constexpr int kDaMinBlocks = 8;        // __launch_bounds__' CTAs per SM: at most 64 registers a thread
constexpr int kDaRows = 4;             // rows per step of a thread (loads in flight); 2 without kVector,
                                       // whose bounds-checked chunks take more registers
constexpr int kDaFinishThreads = 256;  // dense_act_bwd_finish: a thread per column

constexpr int kActGeluApprox = 0;
constexpr int kActRelu = 1;
constexpr int kActSqrelu = 2;

// tanh(u) = 1 - 2 / (2^(2u·log2 e) + 1): one ex2.approx and one fast division where tanhf takes a
// longer sequence that made the kernels compute-bound; the error, a few fp32 ulps of 1 (absolute),
// is far below the rounding of bf16 / fp16 outputs. u → +inf: 2 / inf = 0, t = 1; u → -inf: t = -1.
__device__ __forceinline__ float tanh_fast(float u) {
    return 1.f - __fdividef(2.f, exp2_approx(2.8853900817779268f * u) + 1.f);
}

// act(x) and act'(x) in fp32.
template <int kAct>
struct Activation {
    static_assert(kAct == kActGeluApprox || kAct == kActRelu || kAct == kActSqrelu, "kAct: 0, 1 or 2");
    static constexpr float kSqrt2OverPi = 0.7978845608028654f;
    static constexpr float kCubic = 0.044715f;

    static __device__ __forceinline__ float fwd(float x) {
        if (kAct == kActGeluApprox) {
            const float t = tanh_fast(kSqrt2OverPi * (x + kCubic * x * x * x));
            return 0.5f * x * (1.f + t);
        }
        const float r = fmaxf(x, 0.f);
        return kAct == kActRelu ? r : r * r;
    }
    static __device__ __forceinline__ float grad(float x) {
        if (kAct == kActGeluApprox) {
            const float t = tanh_fast(kSqrt2OverPi * (x + kCubic * x * x * x));
            return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kCubic * x * x);
        }
        if (kAct == kActRelu) return x > 0.f ? 1.f : 0.f;
        return 2.f * fmaxf(x, 0.f);
    }
};

// 8 neighbouring 16-bit elements as loaded: element 2k in the low half of w[k]. The loads of a
// step stay packed (4 registers per 8 elements, not 8 floats) and are widened one element at a
// time, so that the unrolled rows fit the 64-register budget of kDaMinBlocks CTAs per SM.
struct DaChunk {
    u32 w[4];
    template <class Elem>
    __device__ __forceinline__ float get(int k) const {
        return to_float<Elem>(static_cast<u16>(k & 1 ? w[k >> 1] >> 16 : w[k >> 1] & 0xffffu));
    }
};

// One chunk of columns col .. col + 7 (col < n): one 16-byte access (kVector: the whole chunk is
// in the row) or eight bounds-checked ones (columns >= n load as 0 and are not stored). kNc:
// ld.global.nc, for tensors no thread of the kernel writes.
template <bool kVector, bool kNc>
__device__ __forceinline__ DaChunk da_load(const void* base, i64 i, int col, int n) {
    const u16* p = static_cast<const u16*>(base) + i;
    DaChunk c;
    if (kVector) {
        const uint4 v = kNc ? __ldg(reinterpret_cast<const uint4*>(p)) : *reinterpret_cast<const uint4*>(p);
        c.w[0] = v.x, c.w[1] = v.y, c.w[2] = v.z, c.w[3] = v.w;
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 lo = col + 2 * k < n ? p[2 * k] : 0u;
            const u32 hi = col + 2 * k + 1 < n ? p[2 * k + 1] : 0u;
            c.w[k] = lo | (hi << 16);
        }
    }
    return c;
}
template <bool kVector>
__device__ __forceinline__ void da_store(void* base, i64 i, int col, int n, const DaChunk& c) {
    u16* p = static_cast<u16*>(base) + i;
    if (kVector) {
        *reinterpret_cast<u32x4*>(p) = u32x4{c.w[0], c.w[1], c.w[2], c.w[3]};
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k)
            if (col + k < n) p[k] = static_cast<u16>(k & 1 ? c.w[k >> 1] >> 16 : c.w[k >> 1] & 0xffffu);
    }
}

// The rows [row_begin, row_end) of this CTA's split.
__device__ __forceinline__ void da_split_rows(const DenseActParams& p, int& row_begin, int& row_end) {
    row_begin = blockIdx.y * p.rows_per_split;
    row_end = min(p.rows, row_begin + p.rows_per_split);
}

// out = act(pre).
template <class Elem, int kAct, bool kVector>
__global__ void __launch_bounds__(kDaThreads, kDaMinBlocks) dense_act_fwd(const DenseActParams p) {
    constexpr int kRows = kVector ? kDaRows : 2;
    const int col = (blockIdx.x * kDaThreads + threadIdx.x) * 8;
    if (col >= p.n) return;
    int row_begin, row_end;
    da_split_rows(p, row_begin, row_end);
    for (int r0 = row_begin; r0 < row_end; r0 += kRows) {
        DaChunk x[kRows];
#pragma unroll
        for (int j = 0; j < kRows; ++j)
            if (r0 + j < row_end) x[j] = da_load<kVector, true>(p.pre, i64(r0 + j) * p.n + col, col, p.n);
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
            if (r0 + j >= row_end) break;
            DaChunk y;
#pragma unroll
            for (int k = 0; k < 4; ++k)
                y.w[k] = pack2<Elem>(Activation<kAct>::fwd(x[j].template get<Elem>(2 * k)),
                                     Activation<kAct>::fwd(x[j].template get<Elem>(2 * k + 1)));
            da_store<kVector>(p.out, i64(r0 + j) * p.n + col, col, p.n, y);
        }
    }
}

// dpre = grad · act'(pre); partials[split] = Σ_split's rows dpre (kBias).
template <class Elem, int kAct, bool kVector, bool kBias>
__global__ void __launch_bounds__(kDaThreads, kDaMinBlocks) dense_act_bwd(const DenseActParams p) {
    constexpr int kRows = kVector ? kDaRows : 2;
    const int col = (blockIdx.x * kDaThreads + threadIdx.x) * 8;
    if (col >= p.n) return;
    int row_begin, row_end;
    da_split_rows(p, row_begin, row_end);
    float dbias[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int r0 = row_begin; r0 < row_end; r0 += kRows) {
        DaChunk g[kRows], x[kRows];
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
            if (r0 + j < row_end) {
                const i64 i = i64(r0 + j) * p.n + col;
                g[j] = da_load<kVector, false>(p.grad, i, col, p.n);   // may alias dpre
                x[j] = da_load<kVector, true>(p.pre, i, col, p.n);
            }
        }
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
            if (r0 + j >= row_end) break;
            DaChunk d;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float d0 = g[j].template get<Elem>(2 * k) * Activation<kAct>::grad(x[j].template get<Elem>(2 * k));
                const float d1 = g[j].template get<Elem>(2 * k + 1) * Activation<kAct>::grad(x[j].template get<Elem>(2 * k + 1));
                if (kBias) dbias[2 * k] += d0, dbias[2 * k + 1] += d1;
                d.w[k] = pack2<Elem>(d0, d1);
            }
            da_store<kVector>(p.dpre, i64(r0 + j) * p.n + col, col, p.n, d);
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
