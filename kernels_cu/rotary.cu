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
// Work split: grid (CTAs, batch), kRotaryThreads threads; one warp per (token, head) row, its lanes
// over the pairs, then over the pass-through features; the warps stride over the sequence's
// rows, so a varlen sequence longer than the grid's seqlen is still covered.
//
// Template parameters:
//   Elem          bf16, fp16 or float: x and out
//   Trig          bf16, fp16 or float: cos and sin (Elem, or fp32 tables)
//   kInterleaved  pair layout, as above
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

template <class Elem, class Trig, bool kInterleaved>
__global__ void __launch_bounds__(kRotaryThreads)
rotary(const RotaryParams p) {
    using X = RotaryElem<Elem>;
    using T = RotaryElem<Trig>;
    using XS = typename X::Storage;
    using TS = typename T::Storage;
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
    const int warps = gridDim.x * (kRotaryThreads / 32);
    const i64 rows = static_cast<i64>(len) * p.nheads;
    for (i64 r = static_cast<i64>(blockIdx.x) * (kRotaryThreads / 32) + threadIdx.x / 32; r < rows; r += warps) {
        const int t = static_cast<int>(r / p.nheads), h = static_cast<int>(r % p.nheads);
        const XS* src = static_cast<const XS*>(p.x) + x_base + t * p.x_row_stride + h * p.x_head_stride;
        XS* dst = static_cast<XS*>(p.out) + out_base + t * p.out_row_stride + h * p.out_head_stride;
        const int pos = t + offset;
        const bool turn = 0 <= pos && pos < p.seqlen_ro;
        const TS* cos_row = static_cast<const TS*>(p.cos) + (turn ? pos * p.trig_row_stride : 0);
        const TS* sin_row = static_cast<const TS*>(p.sin) + (turn ? pos * p.trig_row_stride : 0);
        for (int c = lane; c < half; c += 32) {
            const int i0 = kInterleaved ? 2 * c : c, i1 = kInterleaved ? 2 * c + 1 : c + half;
            const float a = X::load(src[i0]), bb = X::load(src[i1]);
            const float cs = turn ? T::load(cos_row[c]) : 1.f;
            const float sn = turn ? p.sin_sign * T::load(sin_row[c]) : 0.f;
            dst[i0] = X::round(a * cs - bb * sn);
            dst[i1] = X::round(a * sn + bb * cs);
        }
        if (p.copy_tail)
            for (int c = p.rotary_dim + lane; c < p.headdim; c += 32) dst[c] = src[c];
    }
}

}  // namespace cuflash
