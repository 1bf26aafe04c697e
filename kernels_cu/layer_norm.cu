// layer_norm.cu: fused residual add + LayerNorm / RMSNorm, forward and backward, the kernels
// behind cuflash.ops.layer_norm's common case (flash-attn's layer_norm_fn / rms_norm_fn without
// dropout, rowscale, x1 or weight1). Not an attention family: helper kernels that
// cuflash/layer_norm.py compiles and launches itself.
//
// Per row of n features, in fp32, with w = weight + w_offset:
//
//   forward   h = x [+ residual]            residual_out = h rounded to Res (when asked)
//             mean = Σh / n, rstd = 1 / sqrt(Σ(h - mean)² / n + eps)     (LayerNorm)
//             mean = 0,      rstd = 1 / sqrt(Σh² / n + eps)              (RMSNorm)
//             x̂ = (h - mean) · rstd,  y = x̂ · w [+ bias]   (rounded to Elem)
//   backward  g = dy · w,  dh = rstd · (g - mean(g) - x̂ · mean(g · x̂))    (RMSNorm: no mean(g))
//             dh += dresidual_out (prenorm),  dx = dh,  dresidual = dh (residual given)
//             dweight = Σ_rows dy · x̂,  dbias = Σ_rows dy
//
// h in the backward is the forward's fp32 h: read from residual_out when that is fp32
// (h_from_res), else x [+ residual] added again.
//
// Work split: the forward and layer_norm_bwd_dx give one CTA of kThreads to a row; the row lives
// in registers, kChunks chunks of 8 elements per thread (chunk c of thread t: columns
// (c · kThreads + t) · 8 ...), so n <= kThreads · kChunks · 8. kVector: 16-byte loads and stores
// of whole chunks (the host takes it when n % 8 == 0 and every pointer is 16-byte aligned); else
// one element at a time with a bounds check. The row statistics are two-pass over the registers
// (mean first, then the squared deviations), so no cancellation.
// The backward, atomics-free: layer_norm_bwd (the default) gives each of gridDim.x CTAs rows b, b +
// gridDim.x, ..., writes dx (and dresidual) a row at a time and sums dy · x̂ (and dy) of its threads'
// columns in shared memory, written to partials[b] at the end (splits = gridDim.x). The two-pass
// alternative: layer_norm_bwd_dx (dx a row per CTA), then layer_norm_bwd_dw, each CTA 8 · kDwThreads
// columns over rows_per_split rows (gridDim.y = splits). Both write dx through ln_bwd_row, one row's
// code. layer_norm_bwd_dw_finish sums the splits
// per column and rounds into W.
//
// Template parameters:
//   Elem      bf16, fp16 or float: x, y, dy, dx
//   Res       bf16, fp16 or float: residual, residual_out, dresidual_out, dresidual
//   W         bf16, fp16 or float: weight, bias, dweight, dbias
//   kThreads  threads per CTA (a multiple of 32)
//   kChunks   8-element chunks per thread
//   kVector   16-byte accesses (see above)
#include "ptx.cuh"
#include "tile.cuh"
#include "params_layer_norm.cuh"

namespace cuflash {

constexpr int kLnDwThreads = 128;     // layer_norm_bwd_dw: 8 columns per thread
constexpr int kLnFinishCols = 32;       // layer_norm_bwd_dw_finish: a warp's lanes over 32 columns,
constexpr int kLnFinishGroups = 16;     // its 16 warps over the splits
constexpr int kLnFinishThreads = kLnFinishCols * kLnFinishGroups;

// One element type's loads and stores of fp32 values: 8 at a time (16 or 32 bytes) or one. The
// 8-wide loads are of the kernels' inputs, never written while a kernel runs: __ldg (ld.global.nc),
// which also lets the compiler issue a row's later loads before its earlier stores (plain loads may
// alias those stores, and then wait for them one chunk at a time). The one-element loads stay plain
// (hoisting all of them spills).
template <class T>
struct LnIO {
    static __device__ __forceinline__ void load8(const void* base, i64 i, float (&v)[8]) {
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(static_cast<const u16*>(base) + i));
        unpack2(w.x, v[0], v[1]), unpack2(w.y, v[2], v[3]), unpack2(w.z, v[4], v[5]), unpack2(w.w, v[6], v[7]);
    }
    static __device__ __forceinline__ void unpack2(u32 word, float& lo, float& hi) {
        lo = to_float<T>(static_cast<u16>(word & 0xffffu));
        hi = to_float<T>(static_cast<u16>(word >> 16));
    }
    static __device__ __forceinline__ void store8(void* base, i64 i, const float (&v)[8]) {
        *reinterpret_cast<u32x4*>(static_cast<u16*>(base) + i) =
            u32x4{pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7])};
    }
    static __device__ __forceinline__ float load1(const void* base, i64 i) {
        return to_float<T>(static_cast<const u16*>(base)[i]);
    }
    static __device__ __forceinline__ void store1(void* base, i64 i, float v) {
        static_cast<u16*>(base)[i] = static_cast<u16>(pack2<T>(v, 0.f) & 0xffffu);
    }
};
template <>
struct LnIO<float> {
    static __device__ __forceinline__ void load8(const void* base, i64 i, float (&v)[8]) {
        const uint4* p = reinterpret_cast<const uint4*>(static_cast<const float*>(base) + i);
        const uint4 a = __ldg(p), b = __ldg(p + 1);
        v[0] = __uint_as_float(a.x), v[1] = __uint_as_float(a.y), v[2] = __uint_as_float(a.z), v[3] = __uint_as_float(a.w);
        v[4] = __uint_as_float(b.x), v[5] = __uint_as_float(b.y), v[6] = __uint_as_float(b.z), v[7] = __uint_as_float(b.w);
    }
    static __device__ __forceinline__ void store8(void* base, i64 i, const float (&v)[8]) {
        u32x4* p = reinterpret_cast<u32x4*>(static_cast<float*>(base) + i);
        p[0] = u32x4{__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3])};
        p[1] = u32x4{__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7])};
    }
    static __device__ __forceinline__ float load1(const void* base, i64 i) { return static_cast<const float*>(base)[i]; }
    static __device__ __forceinline__ void store1(void* base, i64 i, float v) { static_cast<float*>(base)[i] = v; }
};

// A chunk of 8 columns starting at column col of row offset row0 (elements): loaded / stored whole
// (kVector) or element by element up to n. Absent columns load as 0.
template <class T, bool kVector>
__device__ __forceinline__ void ln_load(const void* base, i64 row0, int col, int n, float (&v)[8]) {
    if (kVector) {
        if (col < n) {
            LnIO<T>::load8(base, row0 + col, v);
            return;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.f;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = col + i < n ? LnIO<T>::load1(base, row0 + col + i) : 0.f;
    }
}
template <class T, bool kVector>
__device__ __forceinline__ void ln_store(void* base, i64 row0, int col, int n, const float (&v)[8]) {
    if (kVector) {
        if (col < n) LnIO<T>::store8(base, row0 + col, v);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (col + i < n) LnIO<T>::store1(base, row0 + col + i, v[i]);
    }
}

// The backward's h: residual_out (h_from_res: fp32, the forward's h exactly), else x [+ residual]
// summed again in fp32 (a 16-bit residual_out is h rounded: its x̂ would be off by the rounding
// times rstd, large where the row's spread is small next to its mean).
template <class Elem, class Res, bool kVector>
__device__ __forceinline__ void ln_load_h(const LayerNormParams& p, i64 row0, int col, float (&h)[8]) {
    if (p.h_from_res) {
        ln_load<Res, kVector>(p.residual_out, row0, col, p.n, h);
        return;
    }
    ln_load<Elem, kVector>(p.x, row0, col, p.n, h);
    if (p.residual) {
        float r[8];
        ln_load<Res, kVector>(p.residual, row0, col, p.n, r);
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] += r[i];
    }
}

// The CTA's sum of v (every thread gets it). red: kThreads / 32 floats; the leading barrier
// lets a previous call's readers finish before red is rewritten.
template <int kThreads>
__device__ __forceinline__ float ln_cta_sum(float v, float* red) {
    constexpr int kWarps = kThreads / 32;
#pragma unroll
    for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
    if (kWarps == 1) return v;
    __syncthreads();   // red's previous readers are done
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();   // every warp's sum is in red
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[w];
    return s;
}

template <class Elem, class Res, class W, int kThreads, int kChunks, bool kVector>
__global__ void __launch_bounds__(kThreads, 1)
layer_norm_fwd(const LayerNormParams p) {
    static_assert(kThreads % 32 == 0, "whole warps");
    __shared__ float red[kThreads / 32];
    const int row = blockIdx.x;
    const i64 row0 = static_cast<i64>(row) * p.n;
    float h[kChunks][8];
    // every load of the row before its first store (a store between them would hold the later ones back)
#pragma unroll
    for (int c = 0; c < kChunks; ++c) ln_load<Elem, kVector>(p.x, row0, (c * kThreads + threadIdx.x) * 8, p.n, h[c]);
    if (p.residual) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            float r[8];
            ln_load<Res, kVector>(p.residual, row0, (c * kThreads + threadIdx.x) * 8, p.n, r);
#pragma unroll
            for (int i = 0; i < 8; ++i) h[c][i] += r[i];
        }
    }
    if (p.residual_out) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
            ln_store<Res, kVector>(p.residual_out, row0, (c * kThreads + threadIdx.x) * 8, p.n, h[c]);
    }
    const float inv_n = 1.f / static_cast<float>(p.n);
    float mean = 0.f;
    if (!p.is_rms) {
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
#pragma unroll
            for (int i = 0; i < 8; ++i) s += h[c][i];   // absent columns hold 0
        mean = ln_cta_sum<kThreads>(s, red) * inv_n;
    }
    float ss = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        const int col = (c * kThreads + threadIdx.x) * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float d = col + i < p.n ? h[c][i] - mean : 0.f;
            ss = fmaf(d, d, ss);
        }
    }
    const float rstd = 1.f / sqrtf(fmaf(ln_cta_sum<kThreads>(ss, red), inv_n, p.eps));
    if (threadIdx.x == 0) {
        p.rstd[row] = rstd;
        p.mean[row] = mean;   // 0 for RMSNorm
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        const int col = (c * kThreads + threadIdx.x) * 8;
        float w[8], b[8];
        ln_load<W, kVector>(p.weight, 0, col, p.n, w);
        if (p.bias) ln_load<W, kVector>(p.bias, 0, col, p.n, b);
        float y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            y[i] = (h[c][i] - mean) * rstd * (w[i] + p.w_offset);
            if (p.bias) y[i] += b[i];
        }
        ln_store<Elem, kVector>(p.y, row0, col, p.n, y);
    }
}

// layer_norm_bwd's per-thread column sums Σ dy · x̂ and Σ dy (its kChunks · 8 columns) in dynamic
// shared memory, 2 · kChunks · 8 · kThreads floats (registers would double the kernel's), each
// thread its own words (consecutive threads, consecutive words: no bank conflicts, no barriers);
// Σ dy only with a bias (dbias).
template <int kThreads, int kChunks>
struct LnColSums {
    float* s;
    static constexpr int kB = kChunks * 8 * kThreads;   // the Σ dy block after the Σ dy · x̂ one
    __device__ __forceinline__ explicit LnColSums(float* smem) : s(smem + threadIdx.x) {
#pragma unroll
        for (int k = 0; k < kChunks * 8; ++k) s[k * kThreads] = 0.f, s[kB + k * kThreads] = 0.f;
    }
    __device__ __forceinline__ void add(int c, int i, float dy, float xh, bool bias) {
        float& w = s[(c * 8 + i) * kThreads];
        w = fmaf(dy, xh, w);
        if (bias) s[kB + (c * 8 + i) * kThreads] += dy;
    }
    __device__ __forceinline__ float w(int c, int i) const { return s[(c * 8 + i) * kThreads]; }
    __device__ __forceinline__ float b(int c, int i) const { return s[kB + (c * 8 + i) * kThreads]; }
};

// layer_norm_bwd_dx's stand-in for LnColSums: no column sums (layer_norm_bwd_dw makes them).
struct LnNoColSums {
    __device__ __forceinline__ void add(int, int, float, float, bool) const {}
};

// One row's backward, the code both backwards run: dx (and dresidual) of row `row` written, each
// element's dy and x̂ handed to sums.add on the way (Sums: LnColSums or LnNoColSums).
template <class Elem, class Res, class W, int kThreads, int kChunks, bool kVector, class Sums>
__device__ __forceinline__ void ln_bwd_row(const LayerNormParams& p, int row, float inv_n, float* red, Sums sums) {
    const i64 row0 = static_cast<i64>(row) * p.n;
    const float mean = p.is_rms ? 0.f : p.mean[row];
    const float rstd = p.rstd[row];
    float xh[kChunks][8], g[kChunks][8];
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        const int col = (c * kThreads + threadIdx.x) * 8;
        ln_load_h<Elem, Res, kVector>(p, row0, col, xh[c]);
        ln_load<Elem, kVector>(p.dy, row0, col, p.n, g[c]);
        float w[8];
        ln_load<W, kVector>(p.weight, 0, col, p.n, w);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            xh[c][i] = (xh[c][i] - mean) * rstd;    // absent columns: dy = w = 0, so g = 0
            sums.add(c, i, g[c][i], xh[c][i], p.dbias != nullptr);
            g[c][i] *= w[i] + p.w_offset;          // dy -> g
            sg += g[c][i];
            sgx = fmaf(g[c][i], xh[c][i], sgx);
        }
    }
    const float mg = p.is_rms ? 0.f : ln_cta_sum<kThreads>(sg, red) * inv_n;
    const float mgx = ln_cta_sum<kThreads>(sgx, red) * inv_n;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        const int col = (c * kThreads + threadIdx.x) * 8;
        float dres[8], dh[8];
        if (p.dresidual_out) ln_load<Res, kVector>(p.dresidual_out, row0, col, p.n, dres);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            dh[i] = rstd * (g[c][i] - mg - xh[c][i] * mgx);
            if (p.dresidual_out) dh[i] += dres[i];
        }
        ln_store<Elem, kVector>(p.dx, row0, col, p.n, dh);
        if (p.dresidual) ln_store<Res, kVector>(p.dresidual, row0, col, p.n, dh);
    }
}

// dx (and dresidual) of one row per CTA.
template <class Elem, class Res, class W, int kThreads, int kChunks, bool kVector>
__global__ void __launch_bounds__(kThreads)
layer_norm_bwd_dx(const LayerNormParams p) {
    __shared__ float red[kThreads / 32];
    LnNoColSums none;
    ln_bwd_row<Elem, Res, W, kThreads, kChunks, kVector>(p, blockIdx.x, 1.f / static_cast<float>(p.n), red, none);
}

// dx (and dresidual) and the dweight / dbias partials in one pass: CTA b takes rows b, b + gridDim.x,
// ... (a row at a time, as layer_norm_bwd_dx) and keeps Σ dy · x̂ and Σ dy of its threads' columns
// (a thread's columns are the same in every row) in LnColSums, written to partials[b] at the end
// (splits = gridDim.x), so dy and h are read once.
template <class Elem, class Res, class W, int kThreads, int kChunks, bool kVector>
__global__ void __launch_bounds__(kThreads)
layer_norm_bwd(const LayerNormParams p) {
    __shared__ float red[kThreads / 32];
    extern __shared__ float col_sums[];
    LnColSums<kThreads, kChunks> sums(col_sums);
    const float inv_n = 1.f / static_cast<float>(p.n);
    for (int row = blockIdx.x; row < p.rows; row += gridDim.x)
        ln_bwd_row<Elem, Res, W, kThreads, kChunks, kVector>(p, row, inv_n, red, sums);
    float* out = p.partials + static_cast<i64>(blockIdx.x) * 2 * p.n;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        const int col = (c * kThreads + threadIdx.x) * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (col + i < p.n) {
                out[col + i] = sums.w(c, i);
                if (p.dbias) out[p.n + col + i] = sums.b(c, i);
            }
        }
    }
}

// Partial column sums Σ dy · x̂ and Σ dy over rows [blockIdx.y · rows_per_split, ...) for the
// CTA's 8 · kLnDwThreads columns, into partials[blockIdx.y].
template <class Elem, class Res, bool kVector>
__global__ void __launch_bounds__(kLnDwThreads)
layer_norm_bwd_dw(const LayerNormParams p) {
    const int col = (blockIdx.x * kLnDwThreads + threadIdx.x) * 8;
    if (col >= p.n) return;
    const int r0 = blockIdx.y * p.rows_per_split;
    const int r1 = min(p.rows, r0 + p.rows_per_split);
    float dw[8] = {}, db[8] = {};
#pragma unroll 4
    for (int row = r0; row < r1; ++row) {   // unrolled: four rows' loads in flight per thread
        const i64 row0 = static_cast<i64>(row) * p.n;
        const float mean = p.is_rms ? 0.f : p.mean[row];
        const float rstd = p.rstd[row];
        float hv[8], dy[8];
        ln_load_h<Elem, Res, kVector>(p, row0, col, hv);
        ln_load<Elem, kVector>(p.dy, row0, col, p.n, dy);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            dw[i] = fmaf(dy[i], (hv[i] - mean) * rstd, dw[i]);
            db[i] += dy[i];
        }
    }
    float* out = p.partials + static_cast<i64>(blockIdx.y) * 2 * p.n;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (col + i < p.n) {
            out[col + i] = dw[i];
            out[p.n + col + i] = db[i];
        }
    }
}

// dweight (and dbias) = the splits' partial sums for the CTA's kLnFinishCols columns: warp g adds
// splits g, g + kLnFinishGroups, ... (its lanes consecutive columns), four in flight; then the
// warps' sums add up through shared memory.
template <class W>
__global__ void __launch_bounds__(kLnFinishThreads)
layer_norm_bwd_dw_finish(const LayerNormParams p) {
    __shared__ float sums[2][kLnFinishGroups][kLnFinishCols];
    const int lane = threadIdx.x % kLnFinishCols, group = threadIdx.x / kLnFinishCols;
    const int col = blockIdx.x * kLnFinishCols + lane;
    float dw = 0.f, db = 0.f;
    if (col < p.n) {
        const float* in = p.partials + col;
        const i64 stride = 2 * static_cast<i64>(p.n);
#pragma unroll 4
        for (int s = group; s < p.splits; s += kLnFinishGroups) {
            dw += in[s * stride];
            if (p.dbias) db += in[s * stride + p.n];
        }
    }
    sums[0][group][lane] = dw;
    sums[1][group][lane] = db;
    __syncthreads();   // every group's sums are in shared memory
    if (group == 0 && col < p.n) {
#pragma unroll
        for (int g = 1; g < kLnFinishGroups; ++g) dw += sums[0][g][lane], db += sums[1][g][lane];
        LnIO<W>::store1(p.dweight, col, dw);
        if (p.dbias) LnIO<W>::store1(p.dbias, col, db);
    }
}

}  // namespace cuflash
