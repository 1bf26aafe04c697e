// dropout_packed.cuh: sm90_fwd's dropout applied to P_j once it is packed into the 16-bit A
// fragments of O += P_j V_j (kDropPacked), instead of to the fp32 P_j before the packing
// (philox.cuh Dropout::zero_dropped). The same canonical keep mask, the same result bit for bit
// (a dropped element is +0 either way; P_j's row sum l was taken before, undropped); a separate
// file, included by sm90_fwd.cu only, so that the families that include philox.cuh keep their
// code hash.
//
// Why: zero_dropped tests each keep byte and selects per fp32 element (a compare and a select per
// element, on top of the two adds that line the bytes up); on the packed fragments one byte
// permute with sign replication (ptx_sm90_store.cuh prmt_sign) makes the 32-bit mask of two
// elements from their keep flags, and one AND applies it: 8 instructions per 4 elements. And the
// Philox rounds then run where S_j's fp32 registers are dead (P_j lives in half as many).
//
// Layouts: Dropout::zero_dropped's (philox.cuh header): thread (g, t)'s call for rows g, g + 8 of
// the warp's 16 and the 32-key block blk covers its 8-column tiles nt = 4·blk + ct (ct = 0..3) with
// word ct, byte 2·half + e for row g + 8·half, column 8·nt + 2t + e. gemm.cuh pack_a_frags puts
// tile nt's (half 0: e = 0, 1) into frag[nt / 2][2·(nt % 2)] and (half 1) into
// frag[nt / 2][2·(nt % 2) + 1], element e = 0 in the low 16 bits.
//
// kDropEarly (draw_keep_signs / and_keep_signs): the Philox rounds of P_j run before S_j lands, in the
// wait for S_j's wgmma (S_j's mask depends on coordinates only), and leave one register per 4
// elements whose bytes' top bits are the keep flags (a SWAR compare against the threshold); after
// pack_p each fragment word takes one sign-replicating permute and one AND. The softmax's critical
// path then carries 1 instruction per element of dropout instead of ~4.5 (Philox's multiplies and
// the compare among them).
#pragma once
#include "philox.cuh"
#include "ptx_sm90_store.cuh"

namespace cuflash {

// P ∘ Z on a warp's packed P (kK16 = BN / 16 A fragments of 4 words): dropped elements +0. query0:
// the warp's first row (a multiple of 16), key0: the block's first key (a multiple of 32).
template <int kK16>
__device__ __forceinline__ void zero_dropped_packed(const Dropout& dropout, u32 (&frag)[1][kK16][4], int bh,
                                                    int query0, int key0, int g, int t) {
    static_assert(kK16 % 2 == 0, "dropout works on whole 32-key blocks (BN a multiple of 32)");
    // byte >= threshold as a carry into bit 15 / 31 of its 16-bit lane: b + 0x8000 - threshold
    const u32 bias = (0x8000u - dropout.threshold) * 0x00010001u;
#pragma unroll
    for (int blk = 0; blk < kK16 / 2; ++blk) {
        const PhiloxWords w = dropout.draw(bh, query0 + g, key0 + 32 * blk + 2 * t);
#pragma unroll
        for (int ct = 0; ct < 4; ++ct) {
            const u32 even = (w.w[ct] & 0x00FF00FFu) + bias;              // flags of bytes 0, 2 at bits 15, 31
            const u32 odd = __byte_perm(w.w[ct], 0u, 0x4341u) + bias;     // bytes 1, 3 likewise
            u32 (&f)[4] = frag[0][2 * blk + ct / 2];
            // row g (bytes 0, 1): even's byte 1 sign over the low half, odd's over the high half
            f[2 * (ct % 2)] &= prmt_sign(even, odd, 0xDD99u);
            // row g + 8 (bytes 2, 3): even's and odd's byte 3
            f[2 * (ct % 2) + 1] &= prmt_sign(even, odd, 0xFFBBu);
        }
    }
}

// The SWAR form of Dropout's keep test, byte >= threshold on four bytes at once (thresholds 0..256):
// with lo = threshold's low 7 bits, ((byte | 0x80) - lo) has its top bit set iff the byte's low 7
// bits are >= lo (no borrow leaves a byte: 128 + (byte & 0x7F) - lo >= 0); the byte's own top bit
// then decides with an OR (threshold < 128: a byte >= 128 is kept) or an AND (threshold >= 128: only
// bytes >= 128 can be kept). The two forms are one majority function (d & w) | ((d | w) & m) with
// m all ones or zero. threshold 256 (p rounds to 1: nothing kept): lo 0x80, m 0 give top bit 0.
struct KeepSwar {
    u32 lo4;   // lo in every byte
    u32 m;     // 0xFFFFFFFF (threshold < 128) or 0

    __host__ __device__ static KeepSwar make(u32 threshold) {
        KeepSwar k;
        const u32 lo = threshold >= 256u ? 0x80u : threshold & 0x7Fu;
        k.lo4 = lo * 0x01010101u;
        k.m = threshold < 128u ? 0xFFFFFFFFu : 0u;
        return k;
    }
    // the keep flags of a word's 4 bytes as the top bits of its bytes
    __host__ __device__ __forceinline__ u32 signs(u32 w) const {
        const u32 d = (w | 0x80808080u) - lo4;
        return (d & w) | ((d | w) & m);
    }
};

// kDropEarly, part 1: the keep flags of a warp's P_j (rows query0 + g, + 8; the 32-key blocks from
// key0), keep[blk][ct] for word ct of the thread's call of block blk (the layout above): kWords 1, the
// byte signs; kWords 2, the two fragment words' 16-bit masks already (rows g and g + 8: one permute
// each, here instead of after the packing, for twice the registers). Then pinned (asm volatile, as
// reg_fence pins accumulators) so that ptxas computes them here, in the wait for S_j's wgmma, and not
// among the softmax's instructions that follow the wait.
// kRounds: the mask's (kPhiloxRounds); 0 only in sm90_fwd's timing form (kDropEarly 3: the counter as
// the "random" words, not the canonical mask) that measures what the rounds cost.
template <int kBlocks, int kWords, int kRounds = kPhiloxRounds>
__device__ __forceinline__ void draw_keep_flags(const Dropout& dropout, const KeepSwar& swar,
                                                u32 (&keep)[kBlocks][4][kWords], int bh, int query0, int key0,
                                                int g, int t) {
    static_assert(kWords == 1 || kWords == 2, "kWords: 1 (byte signs) or 2 (fragment masks)");
    // the blocks' first key pinned here: the rounds depend on it, so ptxas cannot hoist them above
    // this point (between the S and the P V wgmma issues, or above the turn's end)
    int col0 = key0 + 2 * t;
    asm volatile("" : "+r"(col0) :: "memory");
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk) {
        const PhiloxWords w = dropout.template draw<kRounds>(bh, query0 + g, col0 + 32 * blk);
#pragma unroll
        for (int ct = 0; ct < 4; ++ct) {
            const u32 signs = swar.signs(w.w[ct]);
            if constexpr (kWords == 1) {
                keep[blk][ct][0] = signs;
            } else {
                keep[blk][ct][0] = prmt_sign(signs, 0u, 0x9988u);   // row g: bytes 0, 1
                keep[blk][ct][1] = prmt_sign(signs, 0u, 0xBBAAu);   // row g + 8: bytes 2, 3
            }
        }
    }
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk)
#pragma unroll
        for (int ct = 0; ct < 4; ++ct)
#pragma unroll
            for (int i = 0; i < kWords; ++i) asm volatile("" : "+r"(keep[blk][ct][i]) :: "memory");
}

// kDropEarly, part 2: P ∘ Z on the packed fragments (kK16 = 2 kBlocks): byte 2·half + e of word ct
// is row g + 8·half, column e of fragment word frag[0][2·blk + ct / 2][2·(ct % 2) + half]; a
// permute replicates bytes 0, 1 (2, 3) signs over the low and high 16 bits (kWords 1; kWords 2 did
// it in part 1), one AND applies them.
template <int kK16, int kWords>
__device__ __forceinline__ void and_keep_flags(u32 (&frag)[1][kK16][4], const u32 (&keep)[kK16 / 2][4][kWords]) {
#pragma unroll
    for (int blk = 0; blk < kK16 / 2; ++blk)
#pragma unroll
        for (int ct = 0; ct < 4; ++ct) {
            u32 (&f)[4] = frag[0][2 * blk + ct / 2];
            if constexpr (kWords == 1) {
                f[2 * (ct % 2)] &= prmt_sign(keep[blk][ct][0], 0u, 0x9988u);       // row g: bytes 0, 1
                f[2 * (ct % 2) + 1] &= prmt_sign(keep[blk][ct][0], 0u, 0xBBAAu);   // row g + 8: bytes 2, 3
            } else {
                f[2 * (ct % 2)] &= keep[blk][ct][0];
                f[2 * (ct % 2) + 1] &= keep[blk][ct][1];
            }
        }
}

}  // namespace cuflash
