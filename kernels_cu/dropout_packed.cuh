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

}  // namespace cuflash
