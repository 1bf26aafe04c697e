// cross_entropy.cu: the cross-entropy loss over vocab-sized rows of logits and its gradient, the
// kernels behind cuflash.ops.cross_entropy (flash-attn's ops.triton.cross_entropy). Not an
// attention family: helper kernels that cuflash/cross_entropy.py compiles and launches itself.
//
// Per row, with z = logits · logit_scale over this rank's n_cols classes (C classes over all
// ranks), s = label_smoothing, y = the row's label:
//
//   forward   lse  = log Σ exp(z)                      (this rank's columns)
//             part = -(1 - s) · z_y - s · Σ z / C      (z_y only when y is one of this rank's columns)
//             loss = lse + part + z_loss,   z_loss = lse_square_scale · lse²
//   backward  dlogits = dloss · logit_scale · (p · (1 + 2 · lse_square_scale · lse) - s / C - (1 - s) · onehot(y)),
//             p = exp(z - lse)                         (lse: the LSE over all ranks, or a given one)
//
// Rows whose label is ignore_index get loss = z_loss = 0 and a zero gradient. With a process
// group the host combines the ranks' lse and part (cuflash/ops/cross_entropy.py); loss and
// z_loss are then rewritten there, lse and part are what it reads.
//
// Arithmetic in fp32 on bf16, fp16 or fp32 logits. The forward reads each row once: an online
// log-sum-exp (running max m in the logits' raw units, s = Σ 2^((x - m) · scale·log2e)), so the
// LSE's rounding is m · scale's own plus log(s)'s, as a two-pass softmax's; the backward reads
// each element once and writes its gradient once (into the logits with inplace_backward).
//
// Work split: grid rows · splits CTAs of kThreads threads; CTA (row, split) takes the columns
// [split · split_cols, ...) of its row (the last split to the row's end). Each CTA reads its
// columns in 16-byte vectors from the first 16-byte boundary on (kUnroll vectors in flight
// per thread); the few columns before that boundary and after the last one go one element per
// thread, so any row stride and any vocab size (odd ones: 50257) take the vector loop.
// splits > 1 (few rows: the host splits rows to fill the GPU): each forward CTA writes its
// (m, s, Σ x) to partials and cross_entropy_fwd_combine merges them, one thread per row.
//
// Template parameters:
//   Elem      bf16, fp16 or float: logits and dlogits
//   kThreads  threads per CTA (a multiple of 32, >= 2 · 16-byte vector elements)
//   kUnroll   16-byte vectors per thread in flight (loads issued together, then one online step)
//   kVector   backward only: 16-byte stores of dlogits too (the host takes it when dlogits' rows
//             have the logits' 16-byte phase, always so in place); false: dlogits one element per store
#include "ptx.cuh"
#include "tile.cuh"
#include "params_cross_entropy.cuh"

namespace cuflash {

constexpr float kCeLog2e = 1.4426950408889634f;
constexpr float kCeLn2 = 0.6931471805599453f;
constexpr int kCeCombineThreads = 128;

// One logits / dlogits element as fp32 and back, and a 16-byte vector of them. bf16 and fp16
// travel as raw 16-bit storage (cuflash includes no cuda_fp16.h), fp32 as itself.
template <class Elem>
struct CeElem {
    using Storage = u16;
    static constexpr int kVec = 8;        // elements in 16 bytes
    static __device__ __forceinline__ float load(Storage v) { return to_float<Elem>(v); }
    static __device__ __forceinline__ Storage round(float v) { return static_cast<u16>(pack2<Elem>(v, 0.f) & 0xffffu); }
    static __device__ __forceinline__ void unpack(const u32x4& w, float (&x)[kVec]) {
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[2 * i] = to_float<Elem>(static_cast<u16>(words[i] & 0xffffu));
            x[2 * i + 1] = to_float<Elem>(static_cast<u16>(words[i] >> 16));
        }
    }
    static __device__ __forceinline__ u32x4 pack(const float (&x)[kVec]) {
        return u32x4{pack2<Elem>(x[0], x[1]), pack2<Elem>(x[2], x[3]), pack2<Elem>(x[4], x[5]), pack2<Elem>(x[6], x[7])};
    }
};
template <>
struct CeElem<float> {
    using Storage = float;
    static constexpr int kVec = 4;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float round(float v) { return v; }
    static __device__ __forceinline__ void unpack(const u32x4& w, float (&x)[kVec]) {
        x[0] = __uint_as_float(w.x), x[1] = __uint_as_float(w.y), x[2] = __uint_as_float(w.z), x[3] = __uint_as_float(w.w);
    }
    static __device__ __forceinline__ u32x4 pack(const float (&x)[kVec]) {
        return u32x4{__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3])};
    }
};

// The online log-sum-exp of a set of logits x (raw units): m = max x, s = Σ 2^((x - m) · scale_log2),
// zsum = Σ x (label smoothing's term). The empty state is m = -inf, s = 0.
struct LseState {
    float m, s, zsum;

    static __device__ __forceinline__ LseState empty() { return LseState{neg_inf(), 0.f, 0.f}; }

    // Add N logits (-inf for absent ones; their raw sum comes in zsum_add). The exponents are
    // one FFMA each, x · scale_log2 - mb with mb = fl(m · scale_log2); mb's rounding error err
    // would shift every term by 2^err, so the new terms' sum is taken back by 1 - err · ln 2.
    // A max of -inf (nothing finite yet) takes base 0: every term is then 2^-inf = 0, no NaN.
    template <int N>
    __device__ __forceinline__ void add(const float (&x)[N], float zsum_add, float scale_log2) {
        float mx = m;
#pragma unroll
        for (int i = 0; i < N; ++i) mx = fmaxf(mx, x[i]);
        const float base = mx == neg_inf() ? 0.f : mx;
        const float mb = base * scale_log2;
        const float err = fmaf(base, scale_log2, -mb);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < N; ++i) sum += exp2_approx(fmaf(x[i], scale_log2, -mb));
        s = fmaf(sum, fmaf(-err, kCeLn2, 1.f), s * exp2_approx((m - base) * scale_log2));
        m = mx;
        zsum += zsum_add;
    }

    // Merge another state (another thread's or split's columns).
    __device__ __forceinline__ void merge(float m2, float s2, float zsum2, float scale_log2) {
        const float mx = fmaxf(m, m2);
        const float base = mx == neg_inf() ? 0.f : mx;
        s = s * exp2_approx((m - base) * scale_log2) + s2 * exp2_approx((m2 - base) * scale_log2);
        m = mx;
        zsum += zsum2;
    }
};

// The CTA's states merged; the result is valid in thread 0. red_smem: 3 · kThreads / 32 floats.
template <int kThreads>
__device__ __forceinline__ LseState reduce_cta(LseState st, float* red_smem, float scale_log2) {
    constexpr int kWarps = kThreads / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int d = 16; d > 0; d /= 2)
        st.merge(__shfl_xor_sync(0xffffffffu, st.m, d), __shfl_xor_sync(0xffffffffu, st.s, d),
                 __shfl_xor_sync(0xffffffffu, st.zsum, d), scale_log2);
    if (lane == 0) {
        red_smem[warp] = st.m;
        red_smem[kWarps + warp] = st.s;
        red_smem[2 * kWarps + warp] = st.zsum;
    }
    __syncthreads();  // every warp's state is in shared memory
    if (warp == 0) {
        st = lane < kWarps ? LseState{red_smem[lane], red_smem[kWarps + lane], red_smem[2 * kWarps + lane]}
                           : LseState::empty();
#pragma unroll
        for (int d = 16; d > 0; d /= 2)
            st.merge(__shfl_xor_sync(0xffffffffu, st.m, d), __shfl_xor_sync(0xffffffffu, st.s, d),
                     __shfl_xor_sync(0xffffffffu, st.zsum, d), scale_log2);
    }
    return st;
}

__device__ __forceinline__ i64 ce_label(const CrossEntropyParams& p, int row) {
    return p.labels_i64 ? static_cast<const i64*>(p.labels)[row] : static_cast<i64>(static_cast<const int*>(p.labels)[row]);
}

// A CTA's columns [c0, c1) of one row: the 16-byte vectors from the first 16-byte boundary
// (vec_begin, n_vec of them), and the edge columns before and after them (at most 2 (kVec - 1)).
template <class Elem>
struct CeSpan {
    int vec_begin, n_vec, head, tail_begin, n_edge;

    __device__ __forceinline__ CeSpan(const typename CeElem<Elem>::Storage* row, int c0, int c1) {
        using S = typename CeElem<Elem>::Storage;
        constexpr int kVec = CeElem<Elem>::kVec;
        const int phase = static_cast<int>((reinterpret_cast<u64>(row + c0) & 15) / sizeof(S));
        vec_begin = min(c1, c0 + (phase ? kVec - phase : 0));
        n_vec = (c1 - vec_begin) / kVec;
        head = vec_begin - c0;
        tail_begin = vec_begin + n_vec * kVec;
        n_edge = head + (c1 - tail_begin);
    }
    // edge column number e (0 .. n_edge - 1), given c0
    __device__ __forceinline__ int edge_col(int c0, int e) const { return e < head ? c0 + e : tail_begin + (e - head); }
};

// The row's loss terms from its merged state (one thread): lse, part, loss and z_loss written.
template <class Elem>
__device__ __forceinline__ void finish_row(const CrossEntropyParams& p, int row, const LseState& st, i64 label,
                                           float z_y) {
    const float lse = fmaf(st.m, p.logit_scale, logf(st.s));
    const float smooth = p.smoothing > 0.f ? p.smooth_per_class * (st.zsum * p.logit_scale) : 0.f;
    const float part = -(1.f - p.smoothing) * z_y - smooth;
    const float zl = p.lse_square_scale * lse * lse;
    const bool ignored = label == p.ignore_index;
    p.lse[row] = lse;
    p.part[row] = part;
    p.loss[row] = ignored ? 0.f : lse + part + zl;
    p.z_loss[row] = ignored ? 0.f : zl;
}

// z_y = the label's logit · logit_scale, 0 when the label is not one of this rank's columns
template <class Elem>
__device__ __forceinline__ float label_logit(const CrossEntropyParams& p, int row, i64 label) {
    using S = typename CeElem<Elem>::Storage;
    const i64 local = label - p.class_start;
    if (local < 0 || local >= p.n_cols) return 0.f;
    const S* logits = static_cast<const S*>(p.logits) + row * p.logits_row_stride;
    return CeElem<Elem>::load(logits[local]) * p.logit_scale;
}

template <class Elem, int kThreads, int kUnroll>
__global__ void __launch_bounds__(kThreads)
cross_entropy_fwd(const CrossEntropyParams p) {
    using E = CeElem<Elem>;
    using S = typename E::Storage;
    constexpr int kVec = E::kVec;
    static_assert(kThreads % 32 == 0 && kThreads >= 2 * kVec, "whole warps; one edge column per thread");
    __shared__ float red_smem[3 * kThreads / 32];

    const int row = blockIdx.x / p.splits, split = blockIdx.x % p.splits;
    const int c0 = split * p.split_cols;
    const int c1 = split + 1 == p.splits ? p.n_cols : c0 + p.split_cols;
    const S* logits = static_cast<const S*>(p.logits) + row * p.logits_row_stride;
    // thread 0 of a whole-row CTA loads the label's logit now; it is used after the row's loop
    i64 label = 0;
    float z_y = 0.f;
    if (p.splits == 1 && threadIdx.x == 0) {
        label = ce_label(p, row);
        z_y = label_logit<Elem>(p, row, label);
    }

    const CeSpan<Elem> span(logits, c0, c1);
    LseState st = LseState::empty();
    {   // edge columns: one each for the first n_edge threads
        float x[1] = {neg_inf()};
        float zs = 0.f;
        if (threadIdx.x < span.n_edge) zs = x[0] = E::load(logits[span.edge_col(c0, threadIdx.x)]);
        st.add(x, zs, p.scale_log2);
    }
    // whole steps of kUnroll vectors per thread (all loads issued first, no bounds checks), then
    // the thread's last few vectors one at a time
    const u32x4* vec = reinterpret_cast<const u32x4*>(logits + span.vec_begin);
    int v = threadIdx.x;
    for (; v + (kUnroll - 1) * kThreads < span.n_vec; v += kUnroll * kThreads) {
        u32x4 w[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) w[u] = vec[v + u * kThreads];
        float x[kUnroll * kVec];
        float zs = 0.f;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float xv[kVec];
            E::unpack(w[u], xv);
#pragma unroll
            for (int i = 0; i < kVec; ++i) zs += x[u * kVec + i] = xv[i];
        }
        st.add(x, zs, p.scale_log2);
    }
    for (; v < span.n_vec; v += kThreads) {
        float x[kVec];
        E::unpack(vec[v], x);
        float zs = 0.f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) zs += x[i];
        st.add(x, zs, p.scale_log2);
    }
    st = reduce_cta<kThreads>(st, red_smem, p.scale_log2);
    if (threadIdx.x != 0) return;
    if (p.splits == 1) {
        finish_row<Elem>(p, row, st, label, z_y);
    } else {
        float* part = p.partials + (static_cast<i64>(row) * p.splits + split) * 3;
        part[0] = st.m, part[1] = st.s, part[2] = st.zsum;
    }
}

// splits > 1: one thread per row merges the row's split states and finishes it.
template <class Elem>
__global__ void __launch_bounds__(kCeCombineThreads)
cross_entropy_fwd_combine(const CrossEntropyParams p) {
    const int row = blockIdx.x * kCeCombineThreads + threadIdx.x;
    if (row >= p.rows) return;
    LseState st = LseState::empty();
    const float* part = p.partials + static_cast<i64>(row) * p.splits * 3;
    for (int k = 0; k < p.splits; ++k) st.merge(part[3 * k], part[3 * k + 1], part[3 * k + 2], p.scale_log2);
    const i64 label = ce_label(p, row);
    finish_row<Elem>(p, row, st, label, label_logit<Elem>(p, row, label));
}

// One CTA's gradient columns [c0, c1) of a row: dlogits[col] = grad(logits[col] as fp32, col),
// rounded once to Elem (kVector: 16-byte loads and stores in whole steps of kUnroll vectors, as
// the forward's loop; else one element per access).
template <class Elem, int kThreads, bool kVector, int kUnroll, class Grad>
__device__ __forceinline__ void write_grad_span(const typename CeElem<Elem>::Storage* logits,
                                                typename CeElem<Elem>::Storage* dlogits, int c0, int c1,
                                                const Grad& grad) {
    using E = CeElem<Elem>;
    constexpr int kVec = E::kVec;
    if constexpr (kVector) {
        const CeSpan<Elem> span(logits, c0, c1);
        if (threadIdx.x < span.n_edge) {
            const int col = span.edge_col(c0, threadIdx.x);
            dlogits[col] = E::round(grad(E::load(logits[col]), col));
        }
        const u32x4* vec = reinterpret_cast<const u32x4*>(logits + span.vec_begin);
        u32x4* dvec = reinterpret_cast<u32x4*>(dlogits + span.vec_begin);
        auto step = [&](const u32x4& w, int v) {
            float x[kVec];
            E::unpack(w, x);
            const int col = span.vec_begin + v * kVec;
#pragma unroll
            for (int i = 0; i < kVec; ++i) x[i] = grad(x[i], col + i);
            dvec[v] = E::pack(x);
        };
        int v = threadIdx.x;
        for (; v + (kUnroll - 1) * kThreads < span.n_vec; v += kUnroll * kThreads) {
            u32x4 w[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) w[u] = vec[v + u * kThreads];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) step(w[u], v + u * kThreads);
        }
        for (; v < span.n_vec; v += kThreads) step(vec[v], v);
    } else {
        for (int col = c0 + threadIdx.x; col < c1; col += kThreads) dlogits[col] = E::round(grad(E::load(logits[col]), col));
    }
}

template <class Elem, int kThreads, bool kVector, int kUnroll>
__global__ void __launch_bounds__(kThreads)
cross_entropy_bwd(const CrossEntropyParams p) {
    using E = CeElem<Elem>;
    using S = typename E::Storage;
    static_assert(kThreads % 32 == 0 && kThreads >= 2 * E::kVec, "whole warps; one edge column per thread");

    const int row = blockIdx.x / p.splits, split = blockIdx.x % p.splits;
    const int c0 = split * p.split_cols;
    const int c1 = split + 1 == p.splits ? p.n_cols : c0 + p.split_cols;
    const S* logits = static_cast<const S*>(p.logits) + row * p.logits_row_stride;
    S* dlogits = static_cast<S*>(p.dlogits) + row * p.dlogits_row_stride;

    const i64 label = ce_label(p, row);
    if (label == p.ignore_index) {   // a zero row (the whole CTA takes this branch)
        write_grad_span<Elem, kThreads, kVector, kUnroll>(logits, dlogits, c0, c1, [](float, int) { return 0.f; });
        return;
    }
    const float c = p.grad_loss[row * p.grad_loss_stride] * p.logit_scale;
    const float lse = p.lse[row];
    const float factor = c * fmaf(2.f * p.lse_square_scale, lse, 1.f);
    const float flat = c * p.smooth_per_class;
    const float hit = (1.f - p.smoothing) * c;
    // the one-hot column when it is one of this CTA's, else -1 (an int compare per element)
    const i64 label_col = label - p.class_start;
    const int hit_col = c0 <= label_col && label_col < c1 ? static_cast<int>(label_col) : -1;
    // p = exp(z - lse) as 2^((x · scale - lse) · log2e): the difference rounded once at its own
    // (small) scale, not lse · log2e at lse's
    write_grad_span<Elem, kThreads, kVector, kUnroll>(logits, dlogits, c0, c1, [&](float x, int col) {
        const float g = fmaf(exp2_approx(fmaf(x, p.logit_scale, -lse) * kCeLog2e), factor, -flat);
        return col == hit_col ? g - hit : g;
    });
}

}  // namespace cuflash
