// philox.cuh: the random numbers of attention dropout (FlashAttention, Algorithms 2 and 4).
//
// Dropout keeps P_ij with probability 1 - p and scales the kept ones by 1 / (1 - p). The
// backward must drop exactly what the forward dropped without storing the mask, so the mask is
// a pure function of the element's coordinates: a counter-based generator, Philox4x32-7
// (Salmon et al., SC'11), evaluated where the element is computed, by the forward and the
// backward alike, whatever their tiling.
//
// The canonical mask (cuflash/dropout.py is its NumPy mirror; tests check them bit for bit).
// One Philox call covers the 16 elements that one thread of the mma / wgmma accumulator
// layout holds together in a 16-row x 32-column block (rows g, g + 8, columns 2t, 2t + 1
// of each 8-column group; g = row % 8, t = (col % 8) / 2):
//   key      (seed_lo, seed_hi ^ offset_hi)          seed and offset: 64-bit, per call
//   counter  (4·(col / 32) + (col % 8) / 2, 8·(row / 16) + row % 8, batch·nheads + head, offset_lo)
//   output   four 32-bit words w = 0..3; byte b of word w belongs to
//            row 16·(row / 16) + row % 8 + 8·(b >> 1), column 32·(col / 32) + 8w + 2·t + (b & 1)
//            (so element (row, col) is byte 2·((row % 16) / 8) + col % 2 of word (col % 32) / 8)
//   keep     that byte >= drop_threshold, drop_threshold = round(p · 256) (so the kept share is
//            1 - drop_threshold / 256, p rounded to 1/256)
// A forward thread (rows = queries) takes word nt % 4 of its call for its 8-column tile nt:
// one call per 16 elements, no data exchange (Dropout::zero_dropped). The backward's tiles are transposed (rows =
// keys): a thread holds keys g, g + 8 and queries 2t, 2t + 1, 8 + 2t, 9 + 2t of a 16 x 16
// block, i.e. half the bytes (one column parity) of two calls; the lanes g and g ^ 1 need the
// same two calls, so each draws one and hands the other the half it needs (one shuffle):
// one call per 8 elements where a warp holds 16 keys of a 32-key block (50% of the bytes used).
// Seven rounds (kPhiloxRounds): Salmon et al. report 7 as the fewest rounds of Philox4x32 that
// pass TestU01's BigCrush (Random123 ships known answers for 7 and 10; flash-attn 2 draws its
// dropout mask from a reduced-round Philox as well). Ten, the library default, would cost 43%
// more multiplies per keep byte on the softmax's critical path; the mask is a regularizer, not
// a Monte Carlo estimate, so BigCrush's bar is the margin that matters (CHANGELOG: the masks of
// a given seed changed when the rounds went from 10 to 7).
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

// Philox4x32-R: R rounds of two 32x32 -> 64-bit products and a Feistel-like mix, the key
// bumped by the golden-ratio Weyl constants between rounds (R = 10 only for the known answers).
template <int kRounds>
__host__ __device__ __forceinline__ PhiloxWords philox4x32(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
    constexpr u32 kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;   // round multipliers
    constexpr u32 kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;   // key schedule (Weyl) increments
#pragma unroll
    for (int round = 0; round < kRounds; ++round) {
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

// The rounds of the dropout mask (cuflash/dropout.py PHILOX_ROUNDS: the same number).
constexpr int kPhiloxRounds = 7;

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
    // The state of one kernel launch: (seed, offset) read from device memory (rng_state:
    // int64[2], drawn per call by torch's generator, so CUDA-graph replays get fresh values
    // without re-recording), threshold and scale computed on the host (params.cuh).
    __device__ static Dropout load(const void* rng_state, int drop_threshold, float keep_scale) {
        const u64* state = static_cast<const u64*>(rng_state);
        Dropout d = make(state[0], state[1], 0.f);
        d.threshold = static_cast<u32>(drop_threshold);
        d.scale = keep_scale;
        return d;
    }
    // The call that covers element (row, col) of head bh (the canonical counter above): its
    // 16 keep bytes, those of rows g, g + 8 and columns 8w + 2t + e of the 16 x 32 block.
    // (kRounds: the mask's; another count only for timing what the rounds cost: dropout_packed.cuh)
    template <int kRounds = kPhiloxRounds>
    __host__ __device__ __forceinline__ PhiloxWords draw(int bh, int row, int col) const {
        const u32 c0 = 4u * (static_cast<u32>(col) / 32u) + (static_cast<u32>(col) % 8u) / 2u;
        const u32 c1 = 8u * (static_cast<u32>(row) / 16u) + static_cast<u32>(row) % 8u;
        return philox4x32<kRounds>(c0, c1, static_cast<u32>(bh), offset_lo, k0, k1);
    }
    // Whether byte b (0..3) of a word keeps its element.
    __host__ __device__ __forceinline__ bool keeps(u32 word, int b) const {
        return ((word >> (8 * b)) & 0xFFu) >= threshold;
    }
    // Keep factor (scale or 0) of byte b (0..3) of a word.
    __host__ __device__ __forceinline__ float factor(u32 word, int b) const {
        return keeps(word, b) ? scale : 0.f;
    }
    // Whether element (row, col) of head bh is kept (one call per element: for host tests).
    __host__ __device__ bool keep(int bh, int row, int col) const {
        const PhiloxWords w = draw(bh, row, col);
        return keeps(w.w[(col % 32) / 8], 2 * ((row % 16) / 8) + col % 2);
    }

#ifdef __CUDACC__
    // P ∘ Z on a warp's P tile in the mma accumulator layout (also wgmma's, per warp): the
    // dropped elements zeroed, the kept ones unchanged (the forwards scale O by 1 / (1 - p) in
    // their epilogue, with 1 / l: one multiply per row instead of one per element). kMT tiles
    // of 16 query rows from query0 (a multiple of 16; rows g and g + 8 of each), columns from
    // key0 (a multiple of 32) in kNT / 4 blocks of 32; acc[mt][nt][2·half + e] is row
    // 16·mt + g + 8·half, column 8·nt + 2t + e, i.e. byte 2·half + e of word nt % 4 of the
    // thread's own call for (mt, nt / 4): one call per 16 elements, nothing exchanged.
    template <int kMT, int kNT>
    __device__ __forceinline__ void zero_dropped(float (&acc)[kMT][kNT][4], int bh, int query0, int key0,
                                                 int g, int t) const {
        static_assert(kNT % 4 == 0, "dropout works on whole 32-column blocks (BN, Bc multiples of 32)");
        // byte >= threshold as a carry into bit 15 / 31 of its 16-bit lane: b + 0x8000 - threshold
        const u32 bias = (0x8000u - threshold) * 0x00010001u;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int blk = 0; blk < kNT / 4; ++blk) {
                const PhiloxWords w = draw(bh, query0 + 16 * mt + g, key0 + 32 * blk + 2 * t);
#pragma unroll
                for (int ct = 0; ct < 4; ++ct) {
                    float (&x)[4] = acc[mt][4 * blk + ct];
                    const u32 even = (w.w[ct] & 0x00FF00FFu) + bias;                 // bytes 0, 2
                    const u32 odd = __byte_perm(w.w[ct], 0u, 0x4341u) + bias;        // bytes 1, 3
                    x[0] = even & 0x8000u ? x[0] : 0.f;
                    x[1] = odd & 0x8000u ? x[1] : 0.f;
                    x[2] = even & 0x80000000u ? x[2] : 0.f;
                    x[3] = odd & 0x80000000u ? x[3] : 0.f;
                }
            }
    }

    // The same on a transposed tile, as the backward holds Pᵀ and dPᵀ: acc[mt][nt][2·half + e]
    // is key key0 + 16·mt + g + 8·half (rows) and query query0 + 8·nt + 2t + e (columns); key0
    // and query0 multiples of 16 (kPairs: key0 a multiple of 32, kMT even; visit_transposed).
    template <bool kPairs = false, int kMT, int kNT>
    __device__ __forceinline__ void apply_transposed(float (&acc)[kMT][kNT][4], int bh, int key0,
                                                     int query0, int g, int t) const {
        visit_transposed<kPairs>(acc, bh, key0, query0, g, t,
                                 [this](float& x, bool kept) { x = kept ? x * scale : 0.f; });
    }

    // The backward's form of the mask on Pᵀ: dropped elements negated, kept ones unchanged
    // (flash-attn's sign encoding). Pᵀ >= 0, so the sign then carries Z: dV takes the positive
    // part times 1 / (1 - p), dS = |Pᵀ| ∘ (Z ∘ dPᵀ - D) still needs the undropped P.
    template <bool kPairs = false, int kMT, int kNT>
    __device__ __forceinline__ void negate_dropped_transposed(float (&acc)[kMT][kNT][4], int bh,
                                                              int key0, int query0, int g, int t) const {
        visit_transposed<kPairs>(acc, bh, key0, query0, g, t, [](float& x, bool kept) { if (!kept) x = -x; });
    }

    // apply_transposed's walk, with op(x, kept) applied to every element: the layout logic
    // lives once for the scale, the sign and sm90_bwd's keep bits. Per 16 keys x 16 queries
    // (mt, qb), thread (g, t) holds keys g, g + 8 (halves hk) and queries 2t + e, 8 + 2t + e
    // (e = 0, 1; halves hr), which are byte 2·hr + g % 2 of words 2·kpar + hk (kpar: the 16
    // keys' half of their 32-key block) of the calls of query rows 2t (e = 0) and 2t + 1
    // (e = 1). Lanes g and g ^ 1 need the same two calls and the other column parity of them:
    // lane g draws the call e = g % 2 and sends lane g ^ 1 the four bytes of parity 1 - g % 2
    // (visit_half): one call per 8 elements. kPairs (the caller guarantees key0 % 32 == 0 and
    // an even kMT): tiles 2m and 2m + 1 are the two halves of one 32-key block, and one call
    // serves both (words 0, 1 and 2, 3): one call per 16 elements.
    template <bool kPairs = false, int kMT, int kNT, class Op>
    __device__ __forceinline__ void visit_transposed(float (&acc)[kMT][kNT][4], int bh, int key0,
                                                     int query0, int g, int t, Op op) const {
        static_assert(kNT % 2 == 0, "dropout works on whole 16-query blocks");
        static_assert(!kPairs || kMT % 2 == 0, "kPairs: whole 32-key blocks");
        const int gp = g & 1;
        if constexpr (kPairs) {
#pragma unroll
            for (int m = 0; m < kMT / 2; ++m)
#pragma unroll
                for (int qb = 0; qb < kNT / 2; ++qb) {
                    const PhiloxWords w = draw(bh, query0 + 16 * qb + 2 * t + gp, key0 + 32 * m + g);
                    visit_half(acc[2 * m], qb, w.w[0], w.w[1], gp, op);
                    visit_half(acc[2 * m + 1], qb, w.w[2], w.w[3], gp, op);
                }
        } else {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                const int key = key0 + 16 * mt + g;           // this thread's first key of the tile
                const bool kpar = (key & 16) != 0;
#pragma unroll
                for (int qb = 0; qb < kNT / 2; ++qb) {
                    const PhiloxWords w = draw(bh, query0 + 16 * qb + 2 * t + gp, key);
                    visit_half(acc[mt], qb, kpar ? w.w[2] : w.w[0], kpar ? w.w[3] : w.w[1], gp, op);
                }
            }
        }
    }

    // One 16 x 16 block (keys of one tile, queries 16·qb..) of visit_transposed: w0, w1 the words
    // of this thread's call for its keys g (hk = 0) and g + 8 (hk = 1); one shuffle with lane ^ 4.
    template <int kNT, class Op>
    __device__ __forceinline__ void visit_half(float (&acc)[kNT][4], int qb, u32 w0, u32 w1, int gp,
                                               Op op) const {
        // byte_perm selectors: bytes 0, 2 (parity 0) or 1, 3 (parity 1) of the two words
        const u32 own = __byte_perm(w0, w1, gp ? 0x7531u : 0x6420u);
        const u32 other = __shfl_xor_sync(0xffffffffu, __byte_perm(w0, w1, gp ? 0x6420u : 0x7531u), 4);
        // byte 2·hk + hr of each: element (hk, hr) of query parity e
        const u32 bytes[2] = {gp ? other : own, gp ? own : other};
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int hk = 0; hk < 2; ++hk)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr)
                    op(acc[2 * qb + hr][2 * hk + e], keeps(bytes[e], 2 * hk + hr));
    }

    // visit_transposed's keep test for one 16-key tile (kMT = 1), as bits: bit 4·nt + i is
    // whether acc[0][nt][i] is kept. The 16-query blocks run one at a time (not unrolled),
    // so one call's state is live, not kNT / 2 of them: sm90_bwd draws this next to dK and dV.
    template <int kNT>
    __device__ __forceinline__ u32 keep_bits_transposed(int bh, int key0, int query0, int g, int t) const {
        static_assert(kNT % 2 == 0 && kNT <= 8, "one keep bit per element of a thread, 32 at most");
        const int gp = g & 1, key = key0 + g;
        // byte b >= threshold as a carry: b + 256 - threshold reaches bit 8 of its 16-bit lane
        const u32 bias = (256u - threshold) * 0x00010001u;
        u32 bits = 0;
#pragma unroll 1
        for (int qb = 0; qb < kNT / 2; ++qb) {
            const PhiloxWords w = draw(bh, query0 + 16 * qb + 2 * t + gp, key);
            const u32 w0 = key & 16 ? w.w[2] : w.w[0], w1 = key & 16 ? w.w[3] : w.w[1];
            // own: bytes of column parity gp (this thread's keys) of its call (query parity e = gp);
            // the other parity goes to lane g ^ 1, which sends this thread its call's (e = 1 - gp)
            const u32 own = __byte_perm(w0, w1, gp ? 0x7531u : 0x6420u);
            const u32 other = __shfl_xor_sync(0xffffffffu, __byte_perm(w0, w1, gp ? 0x6420u : 0x7531u), 4);
            u32 block = 0;   // bit 4·hr + 2·hk + e: acc[0][2·qb + hr][2·hk + e], byte 2·hk + hr of e's word
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 word = (e == gp) ? own : other;
                const u32 even = (word & 0x00FF00FFu) + bias, odd = ((word >> 8) & 0x00FF00FFu) + bias;
                block |= (((even >> 8) & 1u) | ((even >> 22) & 4u) | ((odd >> 4) & 16u) | ((odd >> 18) & 64u)) << e;
            }
            bits |= block << (8 * qb);
        }
        return bits;
    }
#endif
};

}  // namespace cuflash
