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
    // The 16 keep bytes of query `row`, columns 16·block .. 16·block + 15, of head bh.
    __host__ __device__ __forceinline__ PhiloxWords bytes(int bh, int row, int block) const {
        return philox4x32_10(static_cast<u32>(block), static_cast<u32>(row), static_cast<u32>(bh),
                             offset_lo, k0, k1);
    }
    // Keep factor (scale or 0) of byte b (0..3) of a word.
    __host__ __device__ __forceinline__ float factor(u32 word, int b) const {
        return ((word >> (8 * b)) & 0xFFu) >= threshold ? scale : 0.f;
    }

#ifdef __CUDACC__
    // P ∘ Z / (1 - p) on a warp's P tile in the mma accumulator layout (also wgmma's, per
    // warp): kMT tiles of 16 query rows from query0 (rows g and g + 8 of each), columns from
    // key0 (a multiple of 16) in kNT / 2 blocks of 16; acc[mt][nt][2·half + e] is row
    // 16·mt + g + 8·half, column 8·nt + 2t + e. The four threads of a quad need words 0..3 of
    // the same two calls (rows g and g + 8) per block: each computes one call of every four
    // and a 4 x 4 transpose by shuffles hands each thread its word t.
    template <int kMT, int kNT>
    __device__ __forceinline__ void apply(float (&acc)[kMT][kNT][4], int bh, int query0, int key0,
                                          int g, int t) const {
        static_assert(kNT % 2 == 0, "dropout works on whole 16-column blocks");
        constexpr int kCalls = kMT * 2 * (kNT / 2);     // (mt, half, block) per quad
        const int lane = threadIdx.x % 32, quad0 = lane & ~3;
#pragma unroll
        for (int c0 = 0; c0 < kCalls; c0 += 4) {
            // call c = c0 + t (this thread's): its coordinates
            u32 mine[4] = {0u, 0u, 0u, 0u};
            {
                const int c = c0 + t;
                if (c < kCalls) {
                    const int mt = c / (2 * (kNT / 2)), half = (c / (kNT / 2)) % 2, blk = c % (kNT / 2);
                    const PhiloxWords w = bytes(bh, query0 + 16 * mt + g + 8 * half, key0 / 16 + blk);
#pragma unroll
                    for (int i = 0; i < 4; ++i) mine[i] = w.w[i];
                }
            }
            // round r: thread t receives word t of call c0 + (t + r) % 4 from quad lane
            // (t + r) % 4, which sends its word (t - r) % 4 (a 4 x 4 transpose in 3 shuffles)
            u32 recv[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const u32 out = pick4(mine, (t - r) & 3);
                recv[r] = r == 0 ? out : __shfl_sync(0xffffffffu, out, quad0 + ((t + r) & 3));
            }
            // call c0 + j arrived in round (j - t) % 4; j is compile-time, so acc's indices are
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                constexpr int kBlocks = kNT / 2;
                const int c = c0 + j;
                if (c < kCalls) {
                    const int mt = c / (2 * kBlocks), half = (c / kBlocks) % 2, blk = c % kBlocks;
                    const u32 word = pick4(recv, (j - t) & 3);
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        acc[mt][2 * blk][2 * half + e] *= factor(word, e);          // column 2t + e
                        acc[mt][2 * blk + 1][2 * half + e] *= factor(word, 2 + e);  // column 8 + 2t + e
                    }
                }
            }
        }
    }

    // The same on a transposed tile, as the backward holds Pᵀ and dPᵀ: acc[mt][nt][2·half + e]
    // is key key0 + 16·mt + g + 8·half (rows) and query query0 + 8·nt + 2t + e (columns); key0
    // and query0 multiples of 16. A 16 x 16 region needs 16 calls (one per query row), and
    // thread (g, t) needs word g / 2 (keys g and g + 8: bytes g % 2 and 2 + g % 2) of the calls
    // of its four queries 2t, 2t + 1, 8 + 2t, 9 + 2t (position j = 0..3). The 32 lanes compute
    // the 32 calls of two regions; in round r thread (g, t) reads its query j = (r + g/2) % 4
    // from the lane that computed it, which sends word (j - r) % 4 of its own j: every reader
    // of a lane in a round wants the same word, so one shuffle serves them all.
    template <int kMT, int kNT>
    __device__ __forceinline__ void apply_transposed(float (&acc)[kMT][kNT][4], int bh, int key0,
                                                     int query0, int g, int t) const {
        visit_transposed(acc, bh, key0, query0, g, t,
                         [this](float& x, u32 word, int b) { x *= factor(word, b); });
    }

    // The backward's form of the mask on Pᵀ: dropped elements negated, kept ones unchanged
    // (flash-attn's sign encoding). Pᵀ >= 0, so the sign then carries Z: dV takes the positive
    // part times 1 / (1 - p), dS = |Pᵀ| ∘ (Z ∘ dPᵀ - D) still needs the undropped P.
    template <int kMT, int kNT>
    __device__ __forceinline__ void negate_dropped_transposed(float (&acc)[kMT][kNT][4], int bh,
                                                              int key0, int query0, int g, int t) const {
        visit_transposed(acc, bh, key0, query0, g, t, [this](float& x, u32 word, int b) {
            if (((word >> (8 * b)) & 0xFFu) < threshold) x = -x;
        });
    }

    // apply_transposed's walk, with op(x, word, byte) applied to every element and its keep
    // byte (byte `byte` of `word`): the layout logic lives once for the scale and the sign.
    template <int kMT, int kNT, class Op>
    __device__ __forceinline__ void visit_transposed(float (&acc)[kMT][kNT][4], int bh, int key0,
                                                     int query0, int g, int t, Op op) const {
        static_assert(kNT % 2 == 0, "dropout works on whole 16-column blocks");
        constexpr int kBlocks = kNT / 2, kRegions = kMT * kBlocks;
        const int lane = threadIdx.x % 32;
        const int q_src = lane % 16, j_src = (q_src & 1) + 2 * (q_src >> 3);
#pragma unroll
        for (int a0 = 0; a0 < kRegions; a0 += 2) {
            u32 mine[4] = {0u, 0u, 0u, 0u};
            {
                const int a = a0 + lane / 16;
                if (a < kRegions) {
                    const int mt = a / kBlocks, blk = a % kBlocks;
                    const PhiloxWords w = bytes(bh, query0 + 16 * blk + q_src, key0 / 16 + mt);
#pragma unroll
                    for (int i = 0; i < 4; ++i) mine[i] = w.w[i];
                }
            }
#pragma unroll
            for (int da = 0; da < 2; ++da) {
                const int a = a0 + da;         // compile-time
                if (a >= kRegions) break;
                const int mt = a / kBlocks, blk = a % kBlocks;
                u32 recv[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int j = (r + g / 2) & 3;
                    const int src = 16 * da + 2 * t + (j & 1) + 8 * (j >> 1);
                    recv[r] = __shfl_sync(0xffffffffu, pick4(mine, (j_src - r) & 3), src);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {   // query 2t + (j & 1) + 8 (j >> 1) of the region
                    const u32 word = pick4(recv, (j - g / 2) & 3);
#pragma unroll
                    for (int half = 0; half < 2; ++half)
                        op(acc[mt][2 * blk + (j >> 1)][2 * half + (j & 1)], word, 2 * half + g % 2);
                }
            }
        }
    }

    // x[i] for a run-time i in 0..3, by selects (a run-time index into a register array would
    // put the array in local memory)
    __device__ __forceinline__ static u32 pick4(const u32 (&x)[4], int i) {
        return i == 0 ? x[0] : i == 1 ? x[1] : i == 2 ? x[2] : x[3];
    }
#endif
};

}  // namespace cuflash
