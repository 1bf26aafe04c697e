// rotary.cu: rotary position embedding (RoPE, Su et al. 2021) of a tensor of heads, the kernel
// behind cuflash.layers.rotary (flash-attn's apply_rotary_emb). Not an attention family: an
// elementwise helper that cuflash/rotary.py compiles and launches itself (no tuning, no registry).
//
// For each token at position pos (its row in the sequence + the sequence's offset) and each head,
// the first rotary_dim features form rotary_dim / 2 pairs (a, b), and pair c turns by the angle
// θ_{pos, c} whose cosine and sine are cos[pos][c], sin[pos][c]:
//
//     (a, b) -> (a cos θ - b sin θ,  a sin θ + b cos θ)      (sin_sign = -1: the turn by -θ)
//
// kInterleaved (GPT-J): pair c is features (2c, 2c + 1); otherwise (GPT-NeoX) (c, c + rotary_dim / 2).
// Features from rotary_dim on pass through (copied when out is not x). A position at or past
// seqlen_ro keeps its features (cos 1, sin 0), as flash-attn's kernel does for out-of-range rows.
// Arithmetic in fp32, each output rounded once (round to nearest even) to Elem.
//
// Layouts and fields: RotaryParams (params_rotary.cuh).
// Work split: grid (CTAs, batch), kRotaryThreads threads. A (token, head) row is cut into groups:
// kPairs consecutive pairs each (GPT-NeoX: kPairs features of each half; GPT-J: 2 kPairs neighbouring
// features), then, when out is not x, the pass-through features kTail at a time. 2^row_lanes_log2
// lanes of a warp share a row and stride over its groups, so a warp holds 32 >> row_lanes_log2 rows
// at once (no lane idles on a short row); the warps stride over the sequence's rows, so a varlen
// sequence longer than the grid's seqlen is covered too.
//
// Template parameters:
//   Elem          bf16, fp16 or float: x and out
//   Trig          bf16, fp16 or float: cos and sin (Elem, or fp32 tables)
//   kInterleaved  pair layout, as above
//   kVector       groups of 16 bytes of x, read and written by one vector access (kPairs = 8 for
//                 16-bit Elem, 4 for float; GPT-J half of that); the host takes this kernel only
//                 when the rotary half, the pass-through part, the strides and the addresses allow
//                 it (cuflash/rotary.py). false: one element per access (kPairs = 1)
#include "ptx.cuh"
#include "params_rotary.cuh"

namespace cuflash {

constexpr int kRotaryThreads = 128;

// One element of x / out / cos / sin as fp32, and back with one rounding. bf16 and fp16 travel
// as raw 16-bit storage (cuflash includes no cuda_fp16.h), fp32 as itself.
template <class T>
struct RotaryElem {
    using Storage = u16;
    static __device__ __forceinline__ float load(Storage v) { return to_float<T>(v); }
    static __device__ __forceinline__ Storage round(float v) { return static_cast<u16>(pack2<T>(v, 0.f) & 0xffffu); }
};
template <>
struct RotaryElem<float> {
    using Storage = float;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float round(float v) { return v; }
};

// N consecutive elements of storage S, moved by vector accesses (kVector: at most 16 bytes each,
// so the host guarantees that alignment) or one element at a time.
template <class S, int N, bool kVector>
struct alignas(kVector ? (N * sizeof(S) < 16 ? N * sizeof(S) : 16) : sizeof(S)) RotaryChunk {
    S v[N];
    __device__ __forceinline__ void load(const S* p) {
        if constexpr (kVector) {
            *this = *reinterpret_cast<const RotaryChunk*>(p);
        } else {
#pragma unroll
            for (int i = 0; i < N; ++i) v[i] = p[i];
        }
    }
    __device__ __forceinline__ void store(S* p) const {
        if constexpr (kVector) {
            *reinterpret_cast<RotaryChunk*>(p) = *this;
        } else {
#pragma unroll
            for (int i = 0; i < N; ++i) p[i] = v[i];
        }
    }
};

template <class Elem, class Trig, bool kInterleaved, bool kVector>
__global__ void __launch_bounds__(kRotaryThreads)
rotary(const RotaryParams p) {
    using X = RotaryElem<Elem>;
    using T = RotaryElem<Trig>;
    using XS = typename X::Storage;
    using TS = typename T::Storage;
    constexpr int kVecElems = 16 / sizeof(XS);                      // elements of x in 16 bytes
    constexpr int kPairs = kVector ? (kInterleaved ? kVecElems / 2 : kVecElems) : 1;
    constexpr int kTail = kVector ? kVecElems : 1;                  // pass-through elements per group
    using XChunk = RotaryChunk<XS, kInterleaved ? 2 * kPairs : kPairs, kVector>;
    using TChunk = RotaryChunk<TS, kPairs, kVector>;
    using TailChunk = RotaryChunk<XS, kTail, kVector>;
    static_assert(!kVector || (kInterleaved ? 2 * kPairs : kPairs) * sizeof(XS) == 16, "one 16-byte access of x");

    const int b = blockIdx.y;
    const int lane = threadIdx.x % 32;
    // the sequence's first row in x / out and its length
    i64 x_base = static_cast<i64>(b) * p.x_batch_stride, out_base = static_cast<i64>(b) * p.out_batch_stride;
    int len = p.seqlen;
    if (p.cu_seqlens != nullptr) {
        const int start = p.cu_seqlens[b];
        len = p.cu_seqlens[b + 1] - start;
        x_base = static_cast<i64>(start) * p.x_row_stride;
        out_base = static_cast<i64>(start) * p.out_row_stride;
    }
    int offset = p.seqlen_offset;
    if (p.seqlen_offsets != nullptr)
        offset = p.offsets_i64 ? static_cast<int>(static_cast<const i64*>(p.seqlen_offsets)[b])
                               : static_cast<const int*>(p.seqlen_offsets)[b];
    const int half = p.rotary_dim / 2;
    const int groups = half / kPairs;                                // rotary groups per row
    const int per_row = groups + (p.copy_tail ? (p.headdim - p.rotary_dim) / kTail : 0);
    const int row_lanes = 1 << p.row_lanes_log2;
    const int rows_per_warp = 32 >> p.row_lanes_log2;
    const int sub = lane >> p.row_lanes_log2, first = lane & (row_lanes - 1);
    const i64 warp = static_cast<i64>(blockIdx.x) * (kRotaryThreads / 32) + threadIdx.x / 32;
    const i64 row_step = static_cast<i64>(gridDim.x) * (kRotaryThreads / 32) * rows_per_warp;
    const i64 rows = static_cast<i64>(len) * p.nheads;
    for (i64 r = warp * rows_per_warp + sub; r < rows; r += row_step) {
        const int t = static_cast<int>(r / p.nheads), h = static_cast<int>(r % p.nheads);
        const XS* src = static_cast<const XS*>(p.x) + x_base + t * p.x_row_stride + h * p.x_head_stride;
        XS* dst = static_cast<XS*>(p.out) + out_base + t * p.out_row_stride + h * p.out_head_stride;
        const int pos = t + offset;
        const bool turn = 0 <= pos && pos < p.seqlen_ro;
        const TS* cos_row = static_cast<const TS*>(p.cos) + (turn ? pos * p.trig_row_stride : 0);
        const TS* sin_row = static_cast<const TS*>(p.sin) + (turn ? pos * p.trig_row_stride : 0);
        for (int j = first; j < per_row; j += row_lanes) {
            if (j >= groups) {                                       // pass-through features
                const int c = p.rotary_dim + (j - groups) * kTail;
                TailChunk tail;
                tail.load(src + c);
                tail.store(dst + c);
                continue;
            }
            const int c0 = j * kPairs;                               // first pair of the group
            TChunk cs, sn;
            if (turn) {
                cs.load(cos_row + c0);
                sn.load(sin_row + c0);
            }
            if constexpr (kInterleaved) {
                XChunk v;
                v.load(src + 2 * c0);
#pragma unroll
                for (int i = 0; i < kPairs; ++i) {
                    const float c = turn ? T::load(cs.v[i]) : 1.f, s = turn ? p.sin_sign * T::load(sn.v[i]) : 0.f;
                    const float a = X::load(v.v[2 * i]), bb = X::load(v.v[2 * i + 1]);
                    v.v[2 * i] = X::round(a * c - bb * s);
                    v.v[2 * i + 1] = X::round(a * s + bb * c);
                }
                v.store(dst + 2 * c0);
            } else {
                XChunk lo, hi;
                lo.load(src + c0);
                hi.load(src + c0 + half);
#pragma unroll
                for (int i = 0; i < kPairs; ++i) {
                    const float c = turn ? T::load(cs.v[i]) : 1.f, s = turn ? p.sin_sign * T::load(sn.v[i]) : 0.f;
                    const float a = X::load(lo.v[i]), bb = X::load(hi.v[i]);
                    lo.v[i] = X::round(a * c - bb * s);
                    hi.v[i] = X::round(a * s + bb * c);
                }
                lo.store(dst + c0);
                hi.store(dst + c0 + half);
            }
        }
    }
}

}  // namespace cuflash
