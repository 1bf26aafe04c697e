// philox.cuh: the random numbers of attention dropout (FlashAttention, Algorithms 2 and 4).
//
// Dropout keeps P_ij with probability 1 - p and scales the kept ones by 1 / (1 - p). The
// backward must drop exactly what the forward dropped without storing the mask, so the mask is
// a pure function of the element's coordinates: a counter-based generator, Philox4x32-10
// (Salmon et al., SC'11), evaluated where the element is computed, by the forward and the
// backward alike, whatever their tiling.
//
// The canonical mask (cuflash/dropout.py is its NumPy mirror; tests check them bit for bit):
//   key      (seed_lo, seed_hi ^ offset_hi)          seed and offset: 64-bit, per call
//   counter  (col / 16, row, batch·nheads + head, offset_lo)
//   output   four 32-bit words w = 0..3; byte b of word w belongs to column
//            16·(col / 16) + 2w + (b & 1) + 8·(b >> 1)
//   keep     that byte >= drop_threshold, drop_threshold = round(p · 256) (so the kept share is
//            1 - drop_threshold / 256, p rounded to 1/256)
// The byte order matches the mma.sync accumulator layout: the thread that holds columns
// 2t, 2t+1, 8+2t, 9+2t of a 16-column block (t = lane % 4) needs exactly word t of its row's
// call; the backward, whose tiles are transposed, needs word (key % 8) / 2 of its query rows'.
#pragma once

#include "ptx.cuh"

namespace cuflash {

struct PhiloxWords { u32 w[4]; };

__host__ __device__ __forceinline__ u32 mul_hi_u32(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return static_cast<u32>((static_cast<u64>(a) * b) >> 32);
#endif
}

// Philox4x32-10: ten rounds of two 32x32 -> 64-bit products and a Feistel-like mix, the key
// bumped by the golden-ratio Weyl constants between rounds.
__host__ __device__ __forceinline__ PhiloxWords philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3,
                                                               u32 k0, u32 k1) {
    constexpr u32 kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;   // round multipliers
    constexpr u32 kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;   // key schedule (Weyl) increments
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 hi0 = mul_hi_u32(kM0, c0), lo0 = kM0 * c0;
        const u32 hi1 = mul_hi_u32(kM1, c2), lo1 = kM1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += kW0;
        k1 += kW1;
    }
    return {{c0, c1, c2, c3}};
}

// The per-call dropout state: the keep test and the scale of kept values.
struct Dropout {
    u32 k0, k1;        // Philox key: seed_lo, seed_hi ^ offset_hi
    u32 offset_lo;     // the counter's last word
    u32 threshold;     // drop iff byte < threshold (round(p · 256))
    float scale;       // 1 / (1 - p)

    __host__ __device__ static Dropout make(u64 seed, u64 offset, float p) {
        Dropout d;
        d.k0 = static_cast<u32>(seed);
        d.k1 = static_cast<u32>(seed >> 32) ^ static_cast<u32>(offset >> 32);
        d.offset_lo = static_cast<u32>(offset);
        d.threshold = static_cast<u32>(p * 256.f + 0.5f);
        d.scale = 1.f / (1.f - p);
        return d;
    }
    // The 16 keep bytes of query `row`, columns 16·block .. 16·block + 15, of head bh.
    __host__ __device__ __forceinline__ PhiloxWords bytes(int bh, int row, int block) const {
        return philox4x32_10(static_cast<u32>(block), static_cast<u32>(row), static_cast<u32>(bh),
                             offset_lo, k0, k1);
    }
    // Keep factor (scale or 0) of byte b (0..3) of a word.
    __host__ __device__ __forceinline__ float factor(u32 word, int b) const {
        return ((word >> (8 * b)) & 0xFFu) >= threshold ? scale : 0.f;
    }
};

}  // namespace cuflash
