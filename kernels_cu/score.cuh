// score.cuh: score modifiers, applied to S = Q Kᵀ between the product and the (online)
// softmax: softcapping and ALiBi, as compile-time flags (kSoftcap, kAlibi). Both leave a kernel
// unchanged when off.
//
// The kernels keep S in raw units (not yet multiplied by the softmax scale: the softmax's
// exp2 multiplies by scale·log2(e)), while both modifiers are defined on the scaled score
// x = scale·S (flash-attn's definitions, cuflash.reference's):
//   softcap  x -> softcap·tanh(x / softcap)
//   ALiBi    x -> x - slope·|i + seqlen_k - seqlen_q - j|        (query i, key j; after softcap)
// so in raw units S -> (softcap / scale)·tanh(S·scale / softcap) - (slope / scale)·|...|, with
// the three factors computed once (softcap_in = scale / softcap and softcap_out = softcap /
// scale on the host, slope / scale per CTA). The mask (mask.cuh) comes after: a hidden
// element is -inf whatever its modified score.
//
// Backward: P is recomputed through the same modifiers; dS gains the factor d S'/d S = 1 - t²
// (t = the tanh, kept per element), ALiBi's bias has no gradient.
#pragma once
#include "ptx.cuh"

namespace cuflash {

template <bool kSoftcap, bool kAlibi>
struct ScoreMod {
    static constexpr bool kOn = kSoftcap || kAlibi;
    float softcap_in;    // scale / softcap
    float softcap_out;   // softcap / scale
    float slope;         // ALiBi slope / scale of this (batch, head)
    int offset;          // seqlen_k - seqlen_q: query i's diagonal key is i + offset

    // slopes: fp32, slopes[batch·slopes_batch_stride + head] (null unless kAlibi)
    __device__ __forceinline__ ScoreMod(float softcap_in_, float softcap_out_, const float* slopes,
                                        i64 slopes_batch_stride, int batch, int head,
                                        float softmax_scale, int seqlen_q, int seqlen_k)
        : softcap_in(softcap_in_), softcap_out(softcap_out_), slope(0.f), offset(kAlibi ? seqlen_k - seqlen_q : 0) {
        if (kAlibi) slope = slopes[batch * slopes_batch_stride + head] / softmax_scale;
    }

    // One element of S (raw units), query `query`, key `key`: the modified score; `t` gets the
    // tanh (softcap only) for the backward's 1 - t².
    __device__ __forceinline__ float apply(float s, int query, int key, float& t) const {
        if (kSoftcap) {
            t = tanh_approx(s * softcap_in);
            s = softcap_out * t;
        }
        if (kAlibi) s = fmaf(-slope, fabsf(static_cast<float>(query + offset - key)), s);
        return s;
    }
    __device__ __forceinline__ float apply(float s, int query, int key) const {
        float t;
        return apply(s, query, key, t);
    }

    // A tile of S (rows are queries, columns keys) in the mma C layout (ptx.cuh): element e of
    // tile (mt, nt) is query query0 + 16·mt + g + 8·(e / 2), key key0 + 8·nt + 2t + e % 2.
    template <int kMT, int kNT>
    __device__ __forceinline__ void apply(float (&acc)[kMT][kNT][4], int query0, int key0, int g,
                                          int t) const {
        if (!kOn) return;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc[mt][nt][e] = apply(acc[mt][nt][e], query0 + mt * 16 + g + 8 * (e / 2),
                                           key0 + nt * 8 + 2 * t + e % 2);
    }
};

}  // namespace cuflash
